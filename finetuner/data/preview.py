"""A few examples of a data file as the model will see them: tokens, and which are trained on.

Uses the same path as training (:func:`finetuner.data.pipeline.load_examples` and
:func:`finetuner.data.pipeline.encode_example` with the model's tokenizer and chat template), so what is
shown is exactly what the trainer computes the loss on. Loads a tokenizer, never a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from finetuner.data.pipeline import IGNORE_INDEX, DataStats, chat_template_for, encode_example, load_examples
from finetuner.config.recipe import DataSection


@dataclass
class ExamplePreview:
    """One encoded example: runs of text, each trained on or masked."""

    where: str
    segments: list[tuple[str, bool]]  # (text, trained)
    n_tokens: int
    n_trained: int
    truncated: bool

    def highlighted(self) -> list[tuple[str, str | None]]:
        """``(text, label)`` pairs for a highlighted-text view: 'trained' or 'masked'."""
        return [(t, "trained" if trained else "masked") for t, trained in self.segments]


@dataclass
class DataPreview:
    path: str
    format: str
    rows_read: int
    examples: list[ExamplePreview] = field(default_factory=list)


def segments(tokenizer: Any, ids: list[int], labels: list[int]) -> list[tuple[str, bool]]:
    """Consecutive tokens with the same trained/masked state, decoded together."""
    runs: list[tuple[str, bool]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            text = tokenizer.decode(ids[start:i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            runs.append((text, labels[start] != IGNORE_INDEX))
            start = i
    return runs


def load_preview_tokenizer(model: str, trust_remote_code: bool = False):
    from finetuner.model.loading import open_tokenizer

    return open_tokenizer(model, "the model", trust_remote_code=trust_remote_code)


def preview_data(
    path: str,
    tokenizer: Any,
    n: int = 3,
    max_seq_len: int = 2048,
    train_on_prompt: bool = False,
    fmt: str = "auto",
    columns: dict[str, str] | None = None,
) -> DataPreview:
    """The first ``n`` examples of ``path`` encoded as for training (``fmt`` and ``columns`` as
    ``data.format`` and ``data.columns``)."""
    cfg = DataSection(path=path, format=fmt, columns=columns, max_seq_len=max_seq_len, train_on_prompt=train_on_prompt, max_examples=n)
    stats = DataStats()
    examples = load_examples(path, cfg, stats)
    template = chat_template_for(tokenizer, cfg)
    out = DataPreview(path, stats.format.get(path, fmt), stats.rows)
    for ex in examples[:n]:
        enc = encode_example(ex, tokenizer, template, max_seq_len, train_on_prompt)
        ids, labels = enc["input_ids"], enc["labels"]
        out.examples.append(
            ExamplePreview(
                where=ex.get("_where", ""),
                segments=segments(tokenizer, ids, labels),
                n_tokens=len(ids),
                n_trained=sum(t != IGNORE_INDEX for t in labels),
                truncated=bool(enc["truncated"]),
            )
        )
    return out

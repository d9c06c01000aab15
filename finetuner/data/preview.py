"""A few examples of a data file as the model will see them: tokens, and which are trained on;
for preference data, the prompt beside its chosen and rejected responses (or beside a rated
response and its label); for ``objective: grpo``, the prompts and the columns the rewards get.

Uses the same path as training (:func:`finetuner.data.pipeline.load_examples` and
:func:`finetuner.data.pipeline.encode_example` with the model's tokenizer and chat template), so what is
shown is exactly what the trainer computes the loss on (an example cut at ``max_seq_len`` tokens is
shown up to its last whole word, then "…"). Loads a tokenizer, never a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from finetuner.config.sections import DataSection
from finetuner.data.formats import AUTO_OBJECTIVE, KIND_WORDS, OBJECTIVES_OF_KIND, SUPERVISED, file_kind
from finetuner.data.pipeline import IGNORE_INDEX, DataStats, chat_template_for, encode_example, load_examples
from finetuner.data.preference import load_preference_examples
from finetuner.objectives.specs import offered_for_kind
from finetuner.text import drop_partial_word


@dataclass
class ExamplePreview:
    """One encoded example: runs of text, each trained on or masked."""

    where: str
    segments: list[tuple[str, bool]]  # (text, trained)
    n_tokens: int
    n_trained: int
    truncated: bool
    #: the example's pictures (paths), in order
    images: list[str] = field(default_factory=list)

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
    """The tokenizer of ``model`` (a preset's short name: its packaged GGUF file, or its hub id)."""
    from finetuner.model.loading import open_tokenizer
    from finetuner.model.shapes import preset_model

    return open_tokenizer(preset_model(model) or model, "the model", trust_remote_code=trust_remote_code)


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
        runs = segments(tokenizer, ids, labels)
        if enc["truncated"] and runs:  # cut at a token, perhaps inside a word: shown up to its last whole word
            runs[-1] = (drop_partial_word(runs[-1][0]), runs[-1][1])
        out.examples.append(
            ExamplePreview(
                where=ex.get("_where", ""),
                segments=runs,
                n_tokens=len(ids),
                n_trained=sum(t != IGNORE_INDEX for t in labels),
                truncated=bool(enc["truncated"]),
                images=list(ex.get("images") or []),
            )
        )
    return out


# --------------------------------------------------------------------------- preference data
@dataclass
class PreferenceExample:
    """One row of preference data as training reads it: the prompt (chat messages, a system
    message first when there is one) and either a chosen and a rejected response (pairs) or one
    response rated desirable or not (KTO's rated responses)."""

    where: str
    prompt: list[dict[str, str]]
    chosen: str | None = None
    rejected: str | None = None
    response: str | None = None
    desirable: bool | None = None


@dataclass
class PreferencePreview:
    """The first examples of a file of preference pairs or rated responses (:func:`preview_preferences`)."""

    path: str
    kind: str  # "pairs" or "rated" (finetuner.data.formats.preference_kind)
    layout: str  # as finetuner.data.preference names it: sharegpt_ranking, trl, columns, kto_messages, kto_completion
    rows_read: int
    examples: list[PreferenceExample] = field(default_factory=list)

    @property
    def what(self) -> str:
        """What the file holds, in words (:data:`finetuner.data.formats.KIND_WORDS`)."""
        return KIND_WORDS[self.kind]

    @property
    def fits(self) -> str:
        """The objectives the file fits, in words (``dpo, orpo or simpo``; ``kto``)."""
        return OBJECTIVES_OF_KIND[self.kind]

    @property
    def objectives(self) -> tuple[str, ...]:
        """The objectives the file fits (their descriptions' data kind): the paired ones for pairs, kto for rated responses."""
        return offered_for_kind(self.kind)


def preview_preferences(path: str, n: int = 3, system_prompt: str | None = None) -> PreferencePreview:
    """The first ``n`` examples of a file of preference pairs or rated responses, read by training's
    own reader (:func:`finetuner.data.preference.load_preference_examples`): the same layout
    detection and the same row checks, so a bad row among them is a :class:`UserError` naming its
    file and row. A file of supervised examples gets the error training gives it for a paired
    objective (it names the objective the file fits)."""
    kind = file_kind(path)  # what profile_data and the planner take the file for
    objective = AUTO_OBJECTIVE["pairs" if kind == SUPERVISED else kind]
    cfg = DataSection(path=path, system_prompt=system_prompt, max_examples=n)
    stats = DataStats()
    examples = load_preference_examples(path, objective, cfg, stats)
    out = PreferencePreview(path, kind, stats.format.get(path, "preference"), stats.rows)
    for ex in examples[:n]:
        if kind == "pairs":
            out.examples.append(PreferenceExample(ex["_where"], ex["prompt"], chosen=ex["chosen"], rejected=ex["rejected"]))
        else:
            out.examples.append(PreferenceExample(ex["_where"], ex["prompt"], response=ex["completion"], desirable=ex["desirable"]))
    return out


# --------------------------------------------------------------------------- prompts (objective grpo)
@dataclass
class PromptExample:
    """One row's prompt as ``objective: grpo`` reads it: its messages (a system message first when there is
    one) and the row's other columns, which the reward functions get by name."""

    where: str
    messages: list[dict[str, str]]
    columns: dict[str, Any]


@dataclass
class PromptsPreview:
    """The first prompts of a file (:func:`preview_prompts`)."""

    path: str
    rows_read: int
    examples: list[PromptExample] = field(default_factory=list)


def preview_prompts(path: str, n: int = 3, columns: dict[str, str] | None = None,
                    system_prompt: str | None = None) -> PromptsPreview:
    """The first ``n`` prompts of ``path`` read as the GRPO trainer reads them
    (:func:`finetuner.data.prompts.prompt_of`: a prompts-only file, or the prompt side of any supported
    format; ``columns`` as ``data.columns``): a row among them without a prompt is a :class:`UserError`
    naming its place."""
    from finetuner.data.formats import RowError, read_rows
    from finetuner.data.prompts import prompt_of
    from finetuner.errors import UserError

    out = PromptsPreview(path, 0)
    for raw in read_rows(path, "train", []):
        out.rows_read += 1
        try:
            p = prompt_of(raw.data, columns, system_prompt)
        except RowError as e:
            raise UserError(f"{raw.place}: {e}.") from None
        out.examples.append(PromptExample(raw.place, p.messages, p.columns))
        if len(out.examples) >= n:
            break
    return out

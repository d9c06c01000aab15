"""How long a data set's examples are, in tokens, for the planner — without torch.

The planner needs three facts from the data: the longest example (so the sequence length is not
cut below what the data need without saying so), the typical length (short examples are packed),
and the share of tokens that are trained on (responses only: the chunked loss works on those).

Tokens are counted with the model's own ``tokenizer.json`` (the ``tokenizers`` library, no
transformers) when the model is a local folder or in the hub cache; otherwise from characters,
at 3.5 characters per token (English text with 32k-150k vocabularies: Llama-2 ~3.6, Llama-3 ~4.3;
the low end, so lengths are over- rather than under-estimated). Each message adds a few tokens
of chat-template markup (``TEMPLATE_TOKENS_PER_MESSAGE``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetuner.data_formats import RowError, detect_format, normalize, read_rows
from finetuner.errors import UserError
from finetuner.fileio import expand_user, exists

CHARS_PER_TOKEN = 3.5
TEMPLATE_TOKENS_PER_MESSAGE = 5
#: Read at most this many rows (the length distribution of a large set is clear long before).
MAX_ROWS = 20_000


@dataclass
class DataProfile:
    path: str
    format: str
    rows: int
    lengths: list[int]
    trained_tokens: int
    total_tokens: int
    counted_with: str
    notes: list[str] = field(default_factory=list)
    requested_seq_len: int | None = None

    @property
    def mean_tokens(self) -> float:
        return statistics.fmean(self.lengths)

    @property
    def max_tokens(self) -> int:
        return max(self.lengths)

    def percentile(self, q: float) -> int:
        s = sorted(self.lengths)
        return s[min(len(s) - 1, int(math.ceil(q / 100 * len(s))) - 1)]

    @property
    def label_fraction(self) -> float:
        return max(0.01, min(1.0, self.trained_tokens / max(1, self.total_tokens)))

    @property
    def suggested_seq_len(self) -> int:
        """The longest example rounded up to 256 tokens (examples are never cut), at least 256;
        short examples get 2048 with packing instead (see :meth:`should_pack`)."""
        need = max(256, int(math.ceil(self.max_tokens / 256) * 256))
        if self.should_pack(2048) and need <= 2048:
            return 2048
        return need

    def should_pack(self, seq_len: int) -> bool:
        """Pack when examples average under half the sequence: padding would waste more than half."""
        return self.mean_tokens < seq_len / 2

    def truncated(self, seq_len: int) -> int:
        return sum(n > seq_len for n in self.lengths)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "rows": self.rows,
            "mean_tokens": round(self.mean_tokens, 1),
            "p50_tokens": self.percentile(50),
            "p95_tokens": self.percentile(95),
            "max_tokens": self.max_tokens,
            "label_fraction": round(self.label_fraction, 3),
            "counted_with": self.counted_with,
            "histogram": histogram(self.lengths),
        }


def histogram(lengths: list[int], bins: int = 20) -> list[dict[str, int]]:
    """Counts of examples per length bin (for the UI's chart)."""
    top = max(lengths) or 1
    width = max(1, int(math.ceil(top / bins)))
    counts = [0] * bins
    for n in lengths:
        counts[min(bins - 1, n // width)] += 1
    return [{"from": i * width, "to": (i + 1) * width, "count": c} for i, c in enumerate(counts)]


def _tokenizer_counter(model: str | None):
    """A ``text -> n_tokens`` function from the model's tokenizer.json, if it can be found offline."""
    if not model:
        return None, None
    candidates = [expand_user(model) / "tokenizer.json"]
    try:
        from huggingface_hub import try_to_load_from_cache

        if "/" in model and not exists(model):
            cached = try_to_load_from_cache(model, "tokenizer.json")
            if isinstance(cached, str):
                candidates.append(Path(cached))
    except Exception:  # noqa: BLE001 - an optional speed-up only
        pass
    for c in candidates:
        if exists(c, "file"):
            try:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(c))
                return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), f"tokenizer {c}"
            except Exception:  # noqa: BLE001
                continue
    return None, None


def profile_data(path: str, model: str | None = None, seq_len: int | None = None, fmt: str = "auto") -> DataProfile:
    """Read a data file and measure its examples' lengths (see the module doc)."""
    count, how = _tokenizer_counter(model)
    if count is None:
        count, how = (lambda text: int(math.ceil(len(text) / CHARS_PER_TOKEN))), f"{CHARS_PER_TOKEN} characters per token"
    lengths: list[int] = []
    trained = total = 0
    detected = None
    bad: list[RowError] = []
    for raw in read_rows(path, bad=bad):
        if len(lengths) >= MAX_ROWS:
            break
        f = fmt if fmt != "auto" else (detected or detect_format(raw.data))
        if f is None:
            raise UserError(
                f"{raw.source}, {raw.where}: cannot tell the data format from its fields ({', '.join(map(str, raw.data)) if isinstance(raw.data, dict) else type(raw.data).__name__}).",
                hint="Use alpaca (instruction/output), chat (messages or conversations), text, or prompt/completion fields.",
            )
        detected = detected or f
        try:
            ex = normalize(raw.data, f)
        except RowError:
            continue  # the trainer reports bad rows with their place; the planner only measures
        if "messages" in ex:
            prompt = sum(count(m["content"]) + TEMPLATE_TOKENS_PER_MESSAGE for m in ex["messages"] if m["role"] != "assistant")
            answer = sum(count(m["content"]) + TEMPLATE_TOKENS_PER_MESSAGE for m in ex["messages"] if m["role"] == "assistant")
        elif "text" in ex:
            prompt, answer = 0, count(ex["text"])
        else:
            prompt, answer = count(ex["prompt"]), count(ex["completion"])
        lengths.append(prompt + answer)
        trained += answer
        total += prompt + answer
    if not lengths:
        raise UserError(f"{path}: no usable examples to measure.", hint="Check the file with `finetuner run` for row errors.")
    profile = DataProfile(str(path), detected or fmt, len(lengths), lengths, trained, total, how, requested_seq_len=seq_len)
    if seq_len is not None:
        cut = profile.truncated(seq_len)
        if cut and not profile.should_pack(seq_len):
            profile.notes.append(
                f"{cut} of {len(lengths)} examples are longer than --seq-len {seq_len} tokens (longest {profile.max_tokens}) "
                "and will be truncated"
            )
    return profile

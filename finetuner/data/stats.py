"""How long a data set's examples are, in tokens, for the planner.

The planner needs three facts from the data: the longest example (so the sequence length is not
cut below what the data need without saying so), the typical length (short examples are packed),
and the share of tokens that are trained on (responses only: the chunked loss works on those).

When the model's tokenizer loads from a local folder or a GGUF file, the first ``EXACT_ROWS`` rows are
tokenized as training tokenizes them (the trainer's own encoding, with the model's chat template), and
the rest are counted with that tokenizer plus the template tokens measured on those rows. Otherwise
tokens are counted with the model's own ``tokenizer.json`` (the ``tokenizers`` library, no
transformers) when the model is in the hub cache, or from characters,
at 3.5 characters per token (English text with 32k-150k vocabularies: Llama-2 ~3.6, Llama-3 ~4.3;
the low end, so lengths are over- rather than under-estimated), and each message adds a few tokens
of chat-template markup (``TEMPLATE_TOKENS_PER_MESSAGE``).

Rows become examples through the trainer's own reader
(:class:`~finetuner.data.formats.FileExamples`: the same format detection, ``data.columns`` and
checks), so the planner measures what training will train on; rows that cannot be used (a line
that is not valid JSON, a row without a response, ...) are counted in a note that names the first
one's place and says what ``finetuner run`` will do with them (:func:`bad_rows_note`).
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.data.formats import (
    AUTO_OBJECTIVE,
    KIND_UNITS,
    SUPERVISED,
    FileExamples,
    RowError,
    WrongObjective,
    delimiter_note,
    format_label,
)
from finetuner.data import tools
from finetuner.data.picture_counts import add_picture_tokens, picture_lengths, picture_processor_of, preset_pictures
from finetuner.data.thinking import statement
from finetuner.data.tools import statement as tool_statement
from finetuner.errors import UserError
from finetuner.fileio import expand_user, exists
from finetuner.surface import say

CHARS_PER_TOKEN = 3.5
TEMPLATE_TOKENS_PER_MESSAGE = 5
#: Read at most this many rows (the length distribution of a large set is clear long before).
MAX_ROWS = 20_000
#: Rows tokenized exactly as training tokenizes them (the trainer's own ``encode_example``/``encode_prompt``
#: with the model's tokenizer and chat template) when the model's tokenizer loads from a local folder or GGUF
#: file: their lengths are the trainer's, and the chat template's own tokens measured on them (a default system
#: prompt, role markers: SmolLM2's rows of bike_shop.jsonl are 80 tokens, where a fixed 5 a message counted 58)
#: replace ``TEMPLATE_TOKENS_PER_MESSAGE`` for the rows after them, which are counted (a template renders in
#: Python: 0.3-0.7 ms a row, measured on the demo's and SmolLM2's chat rows, so 20,000 rows would add 6-14 s to a plan).
EXACT_ROWS = 1_000


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
    #: roles read from named columns (data.columns, or found by their names: question/answer, ...)
    columns: dict[str, str] = field(default_factory=dict)
    #: rows that cannot be used (invalid JSON, or not normalisable), and the first one's message
    bad_rows: int = 0
    first_bad_row: str | None = None
    #: what the rows are: ``supervised`` (supervised examples), ``pairs`` (a chosen and a rejected response:
    #: DPO, ORPO, SimPO) or ``rated`` (a response with a true/false label: KTO). For pairs, a length is
    #: the longer of the example's two sequences (prompt + chosen, prompt + rejected).
    kind: str = SUPERVISED
    #: examples whose conversation starts with a system message (the file's, or data.system_prompt's)
    system_rows: int = 0
    #: the examples' pictures, and the image tokens the model's processor makes of them (0 where it did not
    #: run: a text model, or no processor here); the lengths count those tokens where it ran
    pictures: int = 0
    picture_tokens: int = 0
    #: the largest picture's pixels, and the processor's pixel budget ``(fewest, most)`` where it sizes pictures
    #: by their pixel count (finetuner.model.vision.pixel_budget; the most: ``max_pixels`` when one was given)
    largest_picture: int = 0
    pixel_budget: tuple[int, int] | None = None
    #: the rows' reasoning and a thinking template's forms (finetuner.data.thinking.statement), None without either
    thinking: dict[str, Any] | None = None
    #: the rows with tools: how they render and their schemas' tokens (finetuner.data.tools.statement), None without
    tools: dict[str, Any] | None = None

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
            "kind": self.kind,
            "format": self.format,
            "format_label": format_label(self.format, self.columns),
            "columns": dict(self.columns),
            "rows": self.rows,
            "bad_rows": self.bad_rows,
            "first_bad_row": self.first_bad_row,
            "mean_tokens": round(self.mean_tokens, 1),
            "p50_tokens": self.percentile(50),
            "p95_tokens": self.percentile(95),
            "max_tokens": self.max_tokens,
            "label_fraction": round(self.label_fraction, 3),
            "counted_with": self.counted_with,
            "histogram": histogram(self.lengths),
            "pictures": self.pictures,
            "picture_tokens": self.picture_tokens,
            "largest_picture": self.largest_picture,
            "pixel_budget": list(self.pixel_budget) if self.pixel_budget else None,
            "thinking": self.thinking,
            "tools": self.tools,
        }


def histogram(lengths: list[int], bins: int = 20) -> list[dict[str, int]]:
    """Counts of examples per length bin (for the UI's chart)."""
    top = max(lengths) or 1
    width = max(1, int(math.ceil(top / bins)))
    counts = [0] * bins
    for n in lengths:
        counts[min(bins - 1, n // width)] += 1
    return [{"from": i * width, "to": (i + 1) * width, "count": c} for i, c in enumerate(counts)]


#: The most characters of one text that are tokenized to count its tokens; a longer text's count is
#: extrapolated from its first this-many characters (the planner needs lengths, not exact ids, and
#: a tokenizer's memory grows with its input: a 10 MB row took the UI to 2.9 GB).
MAX_COUNTED_CHARS = 200_000


def bounded(count):
    """``count`` (text -> tokens) that tokenizes at most :data:`MAX_COUNTED_CHARS` characters of a text
    and scales the count of a longer text by its length."""
    def counted(text: str) -> int:
        if len(text) <= MAX_COUNTED_CHARS:
            return count(text)
        return int(math.ceil(count(text[:MAX_COUNTED_CHARS]) * len(text) / MAX_COUNTED_CHARS))

    return counted


def _tokenizer_counter(model: str | None):
    """A ``text -> n_tokens`` function from the model's tokenizer.json, if it can be found offline."""
    if not model:
        return None, None
    from finetuner.model import gguf_base
    from finetuner.model.shapes import preset_model

    model = preset_model(model) or model  # a preset's short name: its packaged GGUF file, or its hub id
    if gguf_base.is_gguf_name(model) and exists(expand_user(model), "file"):
        folder, extra = gguf_base.pretrained_args(model, "tokenizer")
        if extra:  # not converted yet: read it from the file once (transformers; the conversion cache keeps it)
            from finetuner.model.loading import open_tokenizer

            try:
                open_tokenizer(model, "the model")
            except Exception:  # noqa: BLE001 - an optional precision only: characters per token instead
                return None, None
            folder, extra = gguf_base.pretrained_args(model, "tokenizer")
        model = folder
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
                return bounded(lambda text: len(tok.encode(text, add_special_tokens=False).ids)), f"tokenizer {c}"
            except Exception:  # noqa: BLE001
                continue
    return None, None


def _encoder(model: str | None, chat_template: str | None = None) -> tuple[Any, str] | None:
    """The model's transformers tokenizer and the chat template training renders with
    (:func:`finetuner.data.pipeline.chat_template_for`: ``data.chat_template``, the tokenizer's, else finetuner's
    fallback), when the tokenizer loads from a local folder or a GGUF file (its conversion cache); None
    otherwise (a hub id: nothing is downloaded to plan)."""
    if not model:
        return None
    from finetuner.model import gguf_base
    from finetuner.model.shapes import preset_model

    model = preset_model(model) or model
    local = expand_user(model)
    gguf = gguf_base.is_gguf_name(model) and exists(local, "file")
    files = [local] if gguf else [f for f in (local / "tokenizer.json", local / "tokenizer_config.json") if exists(f, "file")]
    if not files:
        return None
    return _loaded_encoder(model, chat_template, tuple(f.stat().st_mtime_ns for f in files))


@functools.lru_cache(maxsize=4)
def _loaded_encoder(model: str, chat_template: str | None, stamp: tuple[int, ...]) -> tuple[Any, str] | None:
    """:func:`_encoder`'s tokenizer, loaded once per model, template and version of its files (``stamp``)."""
    from finetuner.config.sections import DataSection
    from finetuner.data.pipeline import chat_template_for
    from finetuner.model.loading import open_tokenizer
    from finetuner.quiet import quieted

    try:
        with quieted():
            tok = open_tokenizer(model, "the model")
            return tok, chat_template_for(tok, DataSection(path="-", chat_template=chat_template))
    except Exception:  # noqa: BLE001 - an optional precision only: the counted lengths instead
        return None


def _counters(model: str | None, chat_template: str | None):
    """``(encoder, count, how)``: the model's tokenizer and chat template where they load here (:func:`_encoder`),
    a ``text -> tokens`` counter (that tokenizer's, else its ``tokenizer.json``, else ``CHARS_PER_TOKEN``) and
    what the counts were made with."""
    encoder = _encoder(model, chat_template)
    if encoder is not None:
        tok = encoder[0]
        fast = getattr(tok, "backend_tokenizer", None)  # the same ids as tok(text), without its per-call overhead
        count = ((lambda text: len(fast.encode(text, add_special_tokens=False).ids)) if fast is not None else
                 (lambda text: len(tok(text, add_special_tokens=False)["input_ids"])))
        return encoder, bounded(count), f"the model's tokenizer and chat template ({model})"
    count, how = _tokenizer_counter(model)
    if count is None:
        count, how = (lambda text: int(math.ceil(len(text) / CHARS_PER_TOKEN))), f"{CHARS_PER_TOKEN} characters per token"
    return None, count, how


def profile_data(
    path: str,
    model: str | None = None,
    seq_len: int | None = None,
    fmt: str = "auto",
    *,
    columns: dict[str, str] | None = None,
    on_bad_row: str = "error",
    system_prompt: str | None = None,
    chat_template: str | None = None,
    max_pixels: int | None = None,
    thinking: str = "auto",
    reasoning: str = "auto",
) -> DataProfile:
    """Read a data file and measure its examples' lengths (see the module doc); ``max_pixels``: ``data.max_pixels``
    for a model that sizes pictures by their pixel count.

    Rows become examples exactly as in training (:class:`~finetuner.data.formats.FileExamples`
    with ``data.format`` = ``fmt``, ``data.columns`` = ``columns`` and ``data.system_prompt``).
    Rows that cannot be used are counted in a note naming the first one's place and what
    ``finetuner run`` will do with them (``on_bad_row``, as ``data.on_bad_row``). Where the model's
    tokenizer loads here, the first ``EXACT_ROWS`` are tokenized as training tokenizes them
    (``chat_template``: ``data.chat_template``) and the rest counted with the template's measured tokens.
    """
    with phases.phase("measure", unit="rows"):  # the tokenizer's load, then each row counted (_sft_lengths)
        encoder, count, how = _counters(model, chat_template)
        src = FileExamples(path, fmt, columns, system_prompt)
        try:
            chats: list[list[dict[str, Any]]] = []  # the rows' conversations, for the reasoning statement
            tool_use = {"rows": 0, "schema_tokens": 0}  # rows with tools, and their schemas' tokens (_sft_lengths)
            lengths, trained, total, system_rows = _sft_lengths(src, count, encoder, (thinking, reasoning), chats,
                                                                tool_use)
        except WrongObjective as e:  # the first row is preference data (format auto, no columns): measure it as such
            return _profile_preference(path, e.kind, count, how, seq_len, on_bad_row, system_prompt)
    try:
        pictures = src.pictures
        processor = picture_processor_of(model, max_pixels) if pictures else None
        preset = None if processor is not None or not pictures else preset_pictures(model, max_pixels)
        if processor is not None:  # every row through the processor: its pictures' tokens are the trainer's
            src = FileExamples(path, fmt, columns, system_prompt)
            lengths, trained, total, picture_tokens, largest = picture_lengths(src, processor, chat_template, MAX_ROWS)
            how = f"the model's processor and chat template ({model})"
        elif preset is not None:  # the text counted; each picture's tokens from the preset
            picture_tokens, largest = add_picture_tokens(FileExamples(path, fmt, columns, system_prompt), lengths,
                                                         preset.tokens, preset.limit)
            total += picture_tokens
            how += f"; image tokens: {preset.counted}"
    except WrongObjective as e:  # the first row is preference data (format auto, no columns): measure it as such
        return _profile_preference(path, e.kind, count, how, seq_len, on_bad_row, system_prompt)
    layout = src.layout
    sep = delimiter_note(path)
    profile = _profile(path, layout.format if layout else fmt, SUPERVISED, lengths, trained, total, how, seq_len, src.bad,
                       on_bad_row, columns=dict(layout.columns) if layout else {})
    profile.system_rows = system_rows
    profile.pictures = pictures
    profile.thinking = statement(*(encoder or (None, None)), chats, thinking, reasoning)
    if profile.thinking:
        profile.notes.append(profile.thinking["reason"])
    profile.tools = tool_statement(tools.renders_tools(*encoder) if encoder is not None else None, tool_use["rows"],
                                   tool_use["schema_tokens"], total)
    if profile.tools:
        profile.notes.append(profile.tools["reason"])
    if processor is not None or preset is not None:
        from finetuner.model.vision import pixel_budget

        profile.picture_tokens, profile.largest_picture = picture_tokens, largest
        profile.pixel_budget = pixel_budget(processor) if processor is not None else preset.budget
        at = (f"pictures of at most {profile.pixel_budget[1]:,} pixels" if profile.pixel_budget
              else "at the processor's settings" if processor is not None
              else "every picture resized to its tower's size")
        whose = "the model's processor" if processor is not None else preset.source
        profile.notes.append(f"{pictures} picture(s): {picture_tokens:,} image tokens in all, "
                             f"{picture_tokens / pictures:.0f} a picture on average ({whose}, {at}), "
                             "counted in the examples' lengths")
    elif pictures:
        profile.notes.append(f"{pictures} picture(s) in the rows, not counted in the lengths: "
                             + ("no model given to count their image tokens" if not model else
                                f"{model} reads no pictures here (a text model, or its processor is not on this "
                                "machine): a picture run needs an image-text-to-text model"))
    if sep:
        profile.notes.append(sep)
    if layout.columns and not columns:
        profile.notes.append(
            f"columns found by their names: {', '.join(f'{r} = {c}' for r, c in layout.columns.items())}; "
            + say(cli="to map them otherwise, name them (data.columns in a recipe, --column ROLE=COLUMN to plan)",
                  ui="to map them otherwise, choose others in the Data tab's column menus")
        )
    if seq_len is not None:
        cut = profile.truncated(seq_len)
        if cut and not profile.should_pack(seq_len):
            profile.notes.append(
                f"{cut} of {len(lengths)} examples are longer than the sequence length, {seq_len} tokens (longest {profile.max_tokens}), "
                "and will be truncated"
            )
    return profile


def _sft_lengths(src: FileExamples, count, encoder: tuple[Any, str] | None = None,
                 settings: tuple[str, str] = ("auto", "auto"), chats: list | None = None,
                 tool_use: dict[str, int] | None = None) -> tuple[list[int], int, int, int]:
    """Each supervised example's tokens (at most ``MAX_ROWS``), the trained and total tokens, and how many of the
    examples start with a system message. With an
    ``encoder`` (:func:`_encoder`) the first ``EXACT_ROWS`` are the trainer's own encoding
    (:func:`finetuner.data.pipeline.encode_example`, the loss on the responses), and the rest are counted with
    the template tokens per prompt and per response message measured on those; without one a chat message
    counts ``TEMPLATE_TOKENS_PER_MESSAGE`` of markup. A row's tool schemas count in its prompt and its calls in its
    answer (``tool_use`` adds up the rows with tools and the schemas' tokens); ``settings``: ``data.thinking`` and
    ``data.reasoning``. A row the trainer's encoding refuses is added to ``src.bad`` with its place."""
    from finetuner.data.pipeline import IGNORE_INDEX, encode_example

    counted: list[tuple[int, int, int, int] | None] = []  # per row: prompt and answer tokens, their messages
    exact: list[tuple[int, int]] = []  # the exactly encoded rows' (length, trained)
    extra_p: list[float] = []
    extra_a: list[float] = []
    system_rows = 0
    for ex in src:
        phases.advance()  # the open "measure" phase's count (profile_data)
        if "messages" in ex:
            system_rows += ex["messages"][0]["role"] == "system"
            if chats is not None:
                chats.append(ex["messages"])
            schemas = count(json.dumps(ex["tools"], ensure_ascii=False)) if ex.get("tools") else 0
            if tool_use is not None and tools.has_tools(ex["messages"], ex.get("tools")):
                tool_use["rows"] += 1
                tool_use["schema_tokens"] += schemas
            prompt = schemas + sum(count(m["content"]) for m in ex["messages"] if m["role"] != "assistant")
            answer = sum(count(m["content"]) + sum(count(tools.call_text(c)) for c in m.get("tool_calls") or [])
                         for m in ex["messages"] if m["role"] == "assistant")
            n_p = sum(m["role"] != "assistant" for m in ex["messages"])
            n_a = len(ex["messages"]) - n_p
            chars = sum(len(m["content"]) for m in ex["messages"])
        elif "text" in ex:
            prompt, answer, n_p, n_a, chars = 0, count(ex["text"]), 0, 1, len(ex["text"])
        else:
            prompt, answer, n_p, n_a = count(ex["prompt"]), count(ex["completion"]), 1, 1
            chars = len(ex["prompt"]) + len(ex["completion"])
        enc = None
        # a row longer than MAX_COUNTED_CHARS is counted (bounded) instead: its tokenizer's memory grows with it
        if encoder is not None and len(exact) < EXACT_ROWS and chars <= MAX_COUNTED_CHARS:
            try:
                enc = encode_example(ex, encoder[0], encoder[1], 1 << 30, False, *settings)
            except RowError as e:  # the trainer refuses it too, before training: the plan says so (first_bad_row)
                src.bad.append(RowError(f"{ex['_where']}: {e}."))
                continue
        if enc is not None and enc["input_ids"]:
            n, a = len(enc["input_ids"]), sum(1 for x in enc["labels"] if x != IGNORE_INDEX)
            exact.append((n, a))
            counted.append(None)
            if n_p:
                extra_p.append((n - a - prompt) / n_p)
            if n_a:
                extra_a.append((a - answer) / n_a)
        else:
            counted.append((prompt, answer, n_p, n_a) if "messages" in ex or encoder is not None
                           else (prompt, answer, 0, 0))  # counted without a template: no markup
        if len(counted) >= MAX_ROWS:
            break
    per_p = statistics.fmean(extra_p) if extra_p else TEMPLATE_TOKENS_PER_MESSAGE
    per_a = statistics.fmean(extra_a) if extra_a else TEMPLATE_TOKENS_PER_MESSAGE
    lengths: list[int] = []
    trained = total = 0
    done = iter(exact)
    for row in counted:
        if row is None:
            n, a = next(done)
        else:
            prompt, answer, n_p, n_a = row
            a = max(1, round(answer + per_a * n_a))
            n = max(0, round(prompt + per_p * n_p)) + a
        lengths.append(n)
        trained += a
        total += n
    return lengths, trained, total, system_rows


def _profile_preference(path: str, kind: str, count, how: str, seq_len: int | None, on_bad_row: str,
                        system_prompt: str | None) -> DataProfile:
    """:func:`profile_data` for a file of pairs or rated responses, read by the preference
    trainer's own reader (:func:`finetuner.data.preference.read_preference_file`)."""
    from finetuner.config.sections import DataSection
    from finetuner.data.preference import read_preference_file

    bad: list[RowError] = []
    rows, info = read_preference_file(path, AUTO_OBJECTIVE[kind], DataSection(path=path, system_prompt=system_prompt), bad)
    lengths: list[int] = []
    trained = total = 0
    for ex in rows:
        prompt = sum(count(m["content"]) + TEMPLATE_TOKENS_PER_MESSAGE for m in ex["prompt"])
        answers = [ex["chosen"], ex["rejected"]] if kind == "pairs" else [ex["completion"]]
        scored = [count(a) + TEMPLATE_TOKENS_PER_MESSAGE for a in answers]
        lengths.append(prompt + max(scored))
        trained += sum(scored)
        total += len(scored) * prompt + sum(scored)
        if len(lengths) >= MAX_ROWS:
            break
    profile = _profile(path, info["layout"], kind, lengths, trained, total, how, seq_len, bad, on_bad_row)
    if seq_len is not None and profile.truncated(seq_len):
        profile.notes.append(
            f"{profile.truncated(seq_len)} of {len(lengths)} examples are longer than the sequence length, {seq_len} tokens "
            f"(longest {profile.max_tokens}): their prompts will be cut from the start"
        )
    return profile


def profile_prompts(
    path: str,
    model: str | None = None,
    *,
    columns: dict[str, str] | None = None,
    on_bad_row: str = "error",
    system_prompt: str | None = None,
    chat_template: str | None = None,
) -> DataProfile:
    """:func:`profile_data` for ``objective: grpo``: each row's prompt, read as the GRPO trainer reads it
    (:func:`finetuner.data.prompts.prompt_of`: a prompts-only file, or the prompt side of supervised data,
    preference pairs or chat), measured as :func:`profile_data` measures a prompt (each message's tokens
    plus ``TEMPLATE_TOKENS_PER_MESSAGE``, and the generation prompt's). The profile's ``kind`` is
    ``prompts``, its lengths are the prompts' (the completions are generated, so no token is trained on
    from the file: ``trained_tokens`` is 0). Rows without a prompt are counted as :func:`profile_data`
    counts bad rows. Where the model's tokenizer loads here, the first ``EXACT_ROWS`` prompts are the GRPO
    trainer's own encoding (:func:`finetuner.data.prompts.encode_prompt`), and the template's measured tokens
    replace ``TEMPLATE_TOKENS_PER_MESSAGE`` for the rest."""
    from finetuner.data.formats import read_rows
    from finetuner.data.prompts import encode_prompt, prompt_of

    encoder, count, how = _counters(model, chat_template)
    bad: list[RowError] = []
    lengths: list[int | None] = []
    counted: list[tuple[int, int]] = []  # the counted rows' content tokens and messages
    extra: list[float] = []  # the exactly encoded rows' template tokens per message
    for raw in read_rows(path, "train", bad):
        try:
            p = prompt_of(raw.data, columns, system_prompt)
        except RowError as e:
            bad.append(RowError(f"{raw.place}: {e}."))
            continue
        content = sum(count(m["content"]) for m in p.messages)
        chars = sum(len(m["content"]) for m in p.messages)
        if encoder is not None and len(extra) < EXACT_ROWS and chars <= MAX_COUNTED_CHARS:  # the GRPO trainer's own encoding
            try:
                n = len(encode_prompt(p, encoder[0], encoder[1]))
                extra.append((n - content) / (len(p.messages) + 1))
                lengths.append(n)
            except RowError:
                lengths.append(None)
                counted.append((content, len(p.messages) + 1))
        else:
            lengths.append(None)
            counted.append((content, len(p.messages) + 1))  # its messages and the generation prompt
        if len(lengths) >= MAX_ROWS:
            break
    per = statistics.fmean(extra) if extra else TEMPLATE_TOKENS_PER_MESSAGE
    rest = iter(counted)
    for i, n in enumerate(lengths):
        if n is None:  # a counted prompt: its content and the template's measured tokens for its messages
            content, messages = next(rest)
            lengths[i] = max(1, round(content + per * messages))
    return _profile(path, "prompts", "prompts", lengths, 0, sum(lengths), how, None, bad, on_bad_row, columns=columns)


def _profile(path: str, fmt: str, kind: str, lengths: list[int], trained: int, total: int, how: str, seq_len: int | None,
             bad: list[RowError], on_bad_row: str, columns: dict[str, str] | None = None) -> DataProfile:
    """The profile of measured examples, with the note on the rows that cannot be used; a
    :class:`UserError` when none can."""
    if not lengths:
        first = f" (first: {str(bad[0]).rstrip('.')})" if bad else ""
        raise UserError(
            f"{path}: no usable {KIND_UNITS[kind]} to measure: {len(bad)} row(s) cannot be used{first}." if bad
            else f"{path}: no usable examples to measure: the file has no rows.",
            hint="Fix the rows; `finetuner run` names each with its place." if bad else None,
        )
    profile = DataProfile(str(path), fmt, len(lengths), lengths, trained, total, how, requested_seq_len=seq_len,
                          columns=columns or {}, bad_rows=len(bad), first_bad_row=str(bad[0]) if bad else None, kind=kind)
    if bad:
        profile.notes.append(bad_rows_note(len(bad), len(lengths), str(bad[0]), on_bad_row, len(lengths) >= MAX_ROWS))
    return profile


def bad_rows_note(n_bad: int, n_good: int, first: str, on_bad_row: str, partial: bool = False) -> str:
    """What the planner says about rows that cannot be used: how many, the first one's place, and
    what ``finetuner run`` will do with them."""
    rows = f"{n_bad} row{'s' if n_bad != 1 else ''}" + (" in the rows read" if partial else f" of {n_bad + n_good}")
    head = f"{rows} cannot be used (first: {first.rstrip('.')})"
    if on_bad_row == "skip":
        return f"{head}; the run skips them (data.on_bad_row: skip) and trains on the other {n_good:,}"
    return (
        f"{head}; the run stops at the first one (data.on_bad_row: error): fix the file, or set "
        f"data.on_bad_row: skip to skip them and train on the other {n_good:,}"
    )

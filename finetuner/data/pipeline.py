"""The data pipeline: files → normalised examples → tokens with a loss mask → batches.

Steps, each a function here:

1. :func:`load_examples` reads every file of ``data.path`` (see :mod:`finetuner.data.formats`),
   detects or checks its format (or takes the columns ``data.columns`` names) and normalises
   each row; a bad row stops with its file and row,
   or is skipped and counted (``data.on_bad_row: skip``).
2. :func:`tokenize_examples` renders chat rows with the tokenizer's chat template (or the
   recipe's, or a built-in fallback; a row's tools with ``tools=``, :mod:`finetuner.data.tools`) and labels only
   the assistant replies and calls (``-100`` elsewhere) unless ``train_on_prompt``; it truncates to ``max_seq_len`` through ``datasets.map``.
3. :func:`pack` optionally packs short examples into full rows; position ids restart at every
   example so attention stays inside it (transformers builds a block-diagonal mask from them).
   ``data.packing: auto`` packs when examples average under half of ``max_seq_len``
   (:func:`resolve_packing`).
4. :class:`Collator` pads a micro-batch on the right.

:func:`prepare_data` stores the result of steps 1-3 on disk (:mod:`finetuner.data.cache`), keyed
by the data files' bytes, the tokenizer, the chat template and the settings: a second run with
the same inputs loads it instead of tokenizing again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import finetuner.phases as phases
from finetuner.data.split import held_out_checked, pack_bins
from finetuner.data.formats import IGNORE_INDEX, FileExamples, RowError
from finetuner.data.images import encode_pictured
from finetuner.data import template_choice, thinking, tools
from finetuner.data.textcut import char_budget, head, head_messages
from finetuner.errors import UserError, interruption
from finetuner.config.sections import DataSection

log = logging.getLogger(__name__)

# the fallback template lives with the one decision that picks it (finetuner.data.template_choice)
FALLBACK_CHAT_TEMPLATE = template_choice.FALLBACK_CHAT_TEMPLATE


@dataclass
class DataStats:
    """What the pipeline did, reported in events and the run summary."""

    format: dict[str, str] = field(default_factory=dict)
    #: per file, the roles read from columns named in data.columns or found by their names (question/answer, ...)
    columns: dict[str, dict[str, str]] = field(default_factory=dict)
    rows: int = 0
    skipped: int = 0
    skipped_reasons: list[str] = field(default_factory=list)
    truncated: int = 0
    dropped_empty: int = 0
    train_examples: int = 0
    val_examples: int = 0
    train_tokens: int = 0
    trained_tokens: int = 0
    packed_rows: int | None = None
    packing: bool | None = None
    cache: str | None = None  # "hit", "miss", "rebuilt" (an entry failed its checks: cache_note says why) or None (not cached)
    cache_note: str | None = None
    prepare_s: float | None = None  # wall time of prepare_data (reading, tokenizing, packing or the cache)
    pictures: int = 0  # the training rows' pictures (an image-text-to-text model's data, finetuner.data.images)
    replay_rows: int = 0  # the base model's answers to general prompts mixed into the training rows (data.replay)
    #: the rows' reasoning (how many, in which form, trained or dropped, how the template renders it) and a thinking
    #: template's forms (finetuner.data.thinking.statement); None for rows without reasoning and a template without
    #: the switch
    thinking: dict[str, Any] | None = None
    #: how the rows with tools rendered and their schemas' tokens (finetuner.data.tools.statement), None without:
    #: "hermes" is finetuner's fallback format, which the run's model then calls tools in
    tools: dict[str, Any] | None = None
    #: the system message every row of data.path starts with (the file's own, or data.system_prompt's), else None:
    #: the model learned its answers under it, so chat, the UI and the Ollama Modelfile ask with it (run_system_prompt)
    system_prompt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["skipped_reasons"] = self.skipped_reasons[:20]
        return d


# --------------------------------------------------------------------------- loading
def load_examples(paths: str | Sequence[str], cfg: DataSection, stats: DataStats) -> list[dict[str, Any]]:
    """Read and normalise the rows of every path (:class:`~finetuner.data.formats.FileExamples`,
    with ``data.format`` and ``data.columns``); each example keeps ``_where`` for errors."""
    examples: list[dict[str, Any]] = []
    for path in [paths] if isinstance(paths, str) else paths:
        src = FileExamples(path, cfg.format, cfg.columns, cfg.system_prompt, cfg.split)
        n_before = len(examples)
        for ex in src:
            raise_or_skip(src.bad, cfg, stats)
            examples.append(ex)
            if cfg.max_examples and len(examples) >= cfg.max_examples:
                break
        raise_or_skip(src.bad, cfg, stats)
        stats.rows += src.rows
        stats.format[path] = src.layout.format if src.layout else cfg.format
        if src.layout and src.layout.columns:
            stats.columns[path] = dict(src.layout.columns)
        if len(examples) == n_before:
            raise UserError(f"{path}: no usable rows.", hint="The file is empty or every row was skipped.")
    return examples


def shared_system(examples: Sequence[dict[str, Any]]) -> str | None:
    """The system message every example's conversation starts with, when all of them start with the same one;
    None when one has none (a prompt/completion or text row, or a conversation without a system turn) or another."""
    found: set[str] = set()
    for ex in examples:
        msgs = ex.get("messages") or []
        if not msgs or msgs[0]["role"] != "system":
            return None
        found.add(msgs[0]["content"])
        if len(found) > 1:
            return None
    return found.pop() if found else None


def run_system_prompt(recipe_system: str | None, data_stats: dict[str, Any] | None) -> str | None:
    """The system prompt a run's model is asked with when the user gives none: the recipe's ``data.system_prompt``,
    else the one every training row carried (``data_stats``: the run's :class:`DataStats` as metrics.json keeps it)."""
    return recipe_system or (data_stats or {}).get("system_prompt") or None


def raise_or_skip(bad: list[RowError], cfg: DataSection, stats: DataStats) -> None:
    """The rows found bad so far: the first raised (``data.on_bad_row: error``), or all counted as skipped."""
    if not bad:
        return
    if cfg.on_bad_row == "error":
        raise UserError(str(bad[0]), hint="Fix the row, or set data.on_bad_row: skip to skip bad rows and count them.")
    stats.skipped += len(bad)
    stats.skipped_reasons += [str(b) for b in bad]
    bad.clear()


# --------------------------------------------------------------------------- tokenizing
def chat_template_for(tokenizer: Any, cfg: DataSection) -> str:
    """The template training renders with: :func:`finetuner.data.template_choice.for_tokenizer`."""
    choice = template_choice.for_tokenizer(cfg.chat_template, tokenizer)
    if choice.source == "fallback" and choice.why not in _SAID:  # once a process (the data is rendered in parts)
        _SAID.add(choice.why)
        log.warning("Chat template: %s.", choice.why)
    return choice.template


_SAID: set[str] = set()


def _render(tokenizer: Any, template: str, messages: list[dict[str, str]], gen: bool, **switches: Any) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen,
                                         **switches)


_CLOSINGS: dict[tuple[int, str], str] = {}


def turn_closing(tokenizer: Any, template: str) -> str:
    """What the template writes after an assistant reply's text (``<|im_end|>``, ``<|eot_id|>``, ``</s>``), from a
    probe conversation; white space around it left out."""
    key = (id(tokenizer), template)
    if key not in _CLOSINGS:
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "zq8v reply"}]
        text = _render(tokenizer, template, probe, gen=False)
        _CLOSINGS[key] = text[text.rindex("zq8v reply") + len("zq8v reply"):].strip()
    return _CLOSINGS[key]


def _call_span(tokenizer: Any, template: str, text: str, prefix: str) -> tuple[int, int] | None:
    """Where an earlier turn's tool call lies in ``text`` when the template writes that turn otherwise as the last
    one (Qwen3's think block): from the end of the generation ``prefix`` (less the empty think block a non-thinking
    prompt ends in) to the template's turn closing, inclusive; None when ``text`` does not continue that prefix."""
    header = thinking.without_empty_block(prefix)
    closing = turn_closing(tokenizer, template)
    end = text.find(closing, len(header)) if closing and text.startswith(header) else -1
    return (len(header), end + len(closing)) if end >= 0 else None


def cut_example(ex: dict[str, Any], budget: int) -> dict[str, Any]:
    """``ex`` with its text cut to the first ``budget`` characters (:mod:`finetuner.data.textcut`):
    the same kept tokens, without tokenizing what truncation drops."""
    if ex.get("messages"):
        return {**ex, "messages": head_messages(ex["messages"], budget)}
    if ex.get("text") is not None:
        return {**ex, "text": head(ex["text"], budget)}
    if ex.get("prompt") is not None and ex.get("completion") is not None:
        prompt = head(ex["prompt"], budget)
        return {**ex, "prompt": prompt, "completion": head(ex["completion"], budget - len(prompt))}
    return ex


def encode_example(ex: dict[str, Any], tokenizer: Any, template: str, max_len: int, train_on_prompt: bool,
                   thinking_setting: str = "auto", reasoning_setting: str = "auto") -> dict[str, Any]:
    """Tokens and labels for one normalised example; labels are ``-100`` where no loss is taken.
    Only the characters ``max_len`` tokens can hold are tokenized (:func:`cut_example`). A thinking template's
    row renders in the form :mod:`finetuner.data.thinking` decides (``thinking_setting``: ``data.thinking``); an
    earlier reply such a template, or a template given tools, writes otherwise than it was answered is context,
    not a label (Mistral's writes the tools before the last user message only), a tool call excepted where the
    template only drops its think block (Qwen3's). The reasoning each turn keeps is ``data.reasoning``'s (:func:`thinking.with_reasoning`). A row with
    tools renders through the template with ``tools=`` where it renders them, else in finetuner's fallback format
    (:mod:`finetuner.data.tools`). The labels are the assistant's replies and calls, never a template-made empty
    think block; a row whose whole text renders none is a :class:`RowError` (one whose replies only the cut
    took away is truncated, and left to the caller's count)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    budget = char_budget(tokenizer, max_len)
    ex = cut_example(ex, budget)
    if ex.get("messages"):
        msgs, switches = thinking.row_for(template, ex["messages"], thinking_setting)
        msgs = thinking.with_reasoning(tokenizer, template, msgs, reasoning_setting)
        schemas = ex.get("tools") or []
        if tools.has_tools(msgs, schemas):
            msgs, extra = tools.prompt_form(tokenizer, template, msgs, schemas)
            switches = {**switches, **extra}
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
        try:
            text = _render(tokenizer, template, msgs, gen=False, **switches)
            spans = []
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                prefix = _render(tokenizer, template, msgs[:i], gen=True, **switches) if i else ""
                upto = _render(tokenizer, template, msgs[: i + 1], gen=False, **switches)
                joined = (thinking.joined_reply(prefix, upto) if switches and i == last and text.startswith(upto)
                          and not upto.startswith(prefix) else None)
                if joined is not None:  # the reply after the non-thinking prompt's empty think block (thinking.py)
                    text, upto = joined + text[len(upto):], joined
                if text.startswith(upto) and upto.startswith(prefix):
                    span = (len(prefix), len(upto))
                elif m.get("tool_calls") and i < last:  # a call the template writes otherwise when it is last
                    span = _call_span(tokenizer, template, text, prefix)
                else:
                    span = None
                if span is None:
                    if switches and i < last:  # an earlier reply a thinking or tools template moves: context
                        continue
                    raise RowError(
                        "the chat template does not render conversations as prefixes of each other, "
                        "so replies cannot be located; set data.chat_template to a template that does"
                    )
                start = span[0] if thinking.wrote_reasoning(m) else thinking.past_empty_block(text, *span)
                spans.append((start, span[1]))
        except RowError:
            raise
        except Exception as e:  # jinja errors raised by the template for this conversation
            raise RowError(f"the chat template failed on this conversation: {e}") from None
        # contents filling the budget were cut (here or by the caller, tokenize_examples): a reply the cut took away
        # is truncation, counted by the caller, not a template's fault
        cut_short = sum(len(m["content"]) for m in ex["messages"] if isinstance(m.get("content"), str)) >= budget
        if not train_on_prompt and not cut_short and not any(text[s:e].strip() for s, e in spans):
            raise RowError("no token of the row is a label: the chat template renders no assistant reply or call of "
                           "it to learn (every token would be masked)")
        enc = tokenizer(head(text, budget), add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if train_on_prompt:
            labels = list(ids)
        else:
            # a token is trained on if it overlaps a reply (a token may straddle the boundary)
            labels = [
                t if any(start < e and end > s for s, e in spans) else IGNORE_INDEX
                for t, (start, end) in zip(ids, enc["offset_mapping"])
            ]
    elif ex.get("text") is not None:
        ids = tokenizer(ex["text"], add_special_tokens=True)["input_ids"] + eos
        labels = list(ids)
    else:
        prompt, completion = ex["prompt"], ex["completion"]
        enc = tokenizer(prompt + completion, add_special_tokens=True, return_offsets_mapping=True)
        ids = enc["input_ids"] + eos
        cut = len(prompt)
        labels = [
            t if (train_on_prompt or end > cut) else IGNORE_INDEX
            for t, (_start, end) in zip(enc["input_ids"], enc["offset_mapping"])
        ] + eos
    truncated = len(ids) > max_len
    return {"input_ids": ids[:max_len], "labels": labels[:max_len], "truncated": truncated}


def tokenize_examples(examples: list[dict[str, Any]], tokenizer: Any, cfg: DataSection, stats: DataStats,
                      processor: Any = None):
    """Tokenize with ``datasets.map``; returns a ``datasets.Dataset`` of input_ids/labels (and ``images``, the
    pictures' paths, with a ``processor``: an image-text-to-text model's, :mod:`finetuner.data.images`)."""
    import datasets

    template = chat_template_for(processor or tokenizer, cfg)
    budget = char_budget(tokenizer, cfg.max_seq_len)
    if processor is None:  # a picture's tokens are not known before the processor runs: pictured rows are not cut
        examples = [cut_example(ex, budget) for ex in examples]  # before Arrow copies them
    rows = {
        # as JSON: Arrow would give every message (and every call's arguments) the keys of all the others, as None
        "messages": [json.dumps(ex["messages"]) if ex.get("messages") else None for ex in examples],
        "tools": [json.dumps(ex["tools"]) if ex.get("tools") else None for ex in examples],
        "text": [ex.get("text") for ex in examples],
        "prompt": [ex.get("prompt") for ex in examples],
        "completion": [ex.get("completion") for ex in examples],
        "images": [ex.get("images") or [] for ex in examples],
        "_where": [ex["_where"] for ex in examples],
    }
    ds = datasets.Dataset.from_dict(rows)
    phases.expect(len(examples))  # the open phase's count (a run's "tokenize"): advanced batch by batch below
    advance = phases.Advance()  # what datasets can hash (the module's thread state it cannot pickle)

    def _encode(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": [], "error": []}
        if processor is not None:
            out["images"] = []
        for i in range(len(batch["_where"])):
            ex = {k: batch[k][i] for k in ("messages", "text", "prompt", "completion", "images")}
            ex["messages"] = json.loads(ex["messages"]) if ex["messages"] else None
            if batch["tools"][i]:
                ex["tools"] = json.loads(batch["tools"][i])
            try:
                if processor is not None and ex["messages"]:
                    enc = encode_pictured(ex, processor, template, cfg.max_seq_len, cfg.train_on_prompt)
                elif ex["images"]:
                    raise RowError(f"the row has {len(ex['images'])} picture(s), but {cfg_model_hint(processor)}")
                else:
                    enc = encode_example(ex, tokenizer, template, cfg.max_seq_len, cfg.train_on_prompt, cfg.thinking,
                                         cfg.reasoning)
                err = ""
            except RowError as e:
                enc, err = {"input_ids": [], "labels": [], "truncated": False, "images": []}, f"{batch['_where'][i]}: {e}."
            for k in out:
                if k != "error":
                    out[k].append(enc.get(k, []))
            out["error"].append(err)
        advance(len(batch["_where"]))  # nothing in a worker process (num_proc): its count comes at the end
        return out

    try:
        ds = ds.map(
            _encode,
            batched=True,
            batch_size=256,
            num_proc=_num_proc(cfg, len(ds)) if processor is None else None,
            remove_columns=["messages", "tools", "text", "prompt", "completion", "images"],
            desc="Tokenizing",
        )
    except BaseException as e:  # Ctrl-C while worker processes tokenize: datasets' clean-up may raise a TimeoutError over it
        stop = interruption(e)
        if stop is None:
            raise
        _end_worker_processes()
        raise stop from None
    errors = [e for e in ds["error"] if e]
    if errors:
        if cfg.on_bad_row == "error":
            raise UserError(errors[0], hint="Fix the row, or set data.on_bad_row: skip.")
        stats.skipped += len(errors)
        stats.skipped_reasons += errors
    stats.truncated += int(sum(ds["truncated"]))
    keep = [i for i, (e, labels) in enumerate(zip(ds["error"], ds["labels"])) if not e and any(t != IGNORE_INDEX for t in labels)]
    stats.dropped_empty += len(ds) - len(errors) - len(keep)
    ds = ds.select(keep).remove_columns(["error", "truncated"])
    if len(ds) == 0:
        files = ", ".join(dict.fromkeys(where.rpartition(", ")[0] for where in rows["_where"]))
        raise UserError(
            f"{files}: no example has any token to train on after truncation to data.max_seq_len {cfg.max_seq_len}.",
            hint=f"Raise data.max_seq_len (now {cfg.max_seq_len}) or check the data.",
        )
    return ds


def cfg_model_hint(processor: Any) -> str:
    """Why a row's pictures cannot be used (no processor: the model reads text only)."""
    return ("the model reads only text: pictures need an image-text-to-text model (LLaVA, Qwen2.5-VL, Gemma 3, "
            "SmolVLM ...); fine-tune one of those, or drop the pictures from the data")


def _end_worker_processes() -> None:
    """End the processes a ``datasets.map`` cut short left behind: a Ctrl-C during the pool's start
    skips its clean-up, and its manager process (not a daemon) would keep this process from exiting."""
    import importlib

    for name in ("multiprocess", "multiprocessing"):
        try:
            children = importlib.import_module(name).active_children()
        except Exception:  # noqa: BLE001 - not installed, or nothing to ask
            continue
        for child in children:
            child.terminate()
        for child in children:
            child.join(5)
            if child.is_alive():
                child.kill()
                child.join(5)


def _num_proc(cfg: DataSection, n_rows: int) -> int | None:
    """Worker processes for tokenizing: the recipe's, or up to 8 for large data sets (>= 20k rows)."""
    if cfg.num_proc:
        return cfg.num_proc if n_rows > 1000 else None
    if n_rows >= 20_000:
        import os

        n = min(8, (os.cpu_count() or 1) - 1)
        return n if n > 1 else None
    return None


# --------------------------------------------------------------------------- packing
def resolve_packing(setting: bool | str, lengths: Sequence[int], max_seq_len: int) -> bool:
    """``data.packing``: ``auto`` packs when examples average under half of ``max_seq_len``.

    Below that, padding each example to the longest in its micro-batch wastes most of the
    compute, and a packed row holds two or more examples; above it, packing gains little and
    mixes long examples for nothing.
    """
    if setting != "auto":
        return bool(setting)
    return bool(lengths) and sum(lengths) / len(lengths) < max_seq_len / 2


def pack(ds, max_len: int, seed: int):
    """Greedily pack examples (in a seeded random order) into rows of at most ``max_len`` tokens.

    Each packed row carries ``position_ids`` that restart at 0 for every example: with no
    attention mask, transformers turns them into a block-diagonal causal mask, so tokens never
    attend across examples (``transformers.masking_utils.find_packed_sequence_indices``).
    """
    import datasets

    all_ids, all_labels = ds["input_ids"], ds["labels"]  # whole columns: no per-row Arrow reads
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for positions in pack_bins([len(ids) for ids in all_ids], max_len, seed):  # the plan counts rows with it too
        cur: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
        for i in positions:
            ids, labels = all_ids[i], all_labels[i]
            cur["input_ids"] += ids
            # the first token of an example must not be a target of the previous example's last one
            cur["labels"] += [IGNORE_INDEX] + labels[1:]
            cur["position_ids"] += list(range(len(ids)))
        for k in rows:
            rows[k].append(cur[k])
    return datasets.Dataset.from_dict(rows)


# --------------------------------------------------------------------------- putting it together
@dataclass
class PreparedData:
    train: Any
    val: Any | None
    stats: DataStats
    chat_template: str


def prepare_data(cfg: DataSection, tokenizer: Any, seed: int, processor: Any = None) -> PreparedData:
    """Everything from ``data.path`` to tokenized (and optionally packed) train/val sets.

    Served from the on-disk cache (:mod:`finetuner.data.cache`) when the same files, tokenizer,
    template, settings and seed were prepared before (``data.cache: false`` turns it off). With an
    image-text-to-text model's ``processor`` the rows' pictures are encoded with it
    (:mod:`finetuner.data.images`) and nothing is cached (the key does not cover the pictures' bytes).
    """
    import time

    from finetuner.data import cache as data_cache

    t0 = time.perf_counter()
    if processor is not None:
        prepared = _prepare_uncached(cfg, tokenizer, seed, processor)
        prepared.stats.prepare_s = round(time.perf_counter() - t0, 3)
        return prepared
    template = chat_template_for(tokenizer, cfg)
    key = data_cache.cache_key(cfg, tokenizer, template, seed) if cfg.cache else None
    rebuilt = None
    if key is not None:
        hit = data_cache.load(key, lambda: _profile_rows(cfg))
        if isinstance(hit, str):
            rebuilt = hit
        elif hit is not None:
            train, val, stats = hit
            stats = DataStats(**stats)
            stats.cache, stats.cache_note = "hit", None  # (an entry stored when it was rebuilt keeps that run's note)
            stats.prepare_s = round(time.perf_counter() - t0, 3)
            log.info("Tokenized data from the cache: %s", data_cache.cache_dir(key))
            return PreparedData(train, val, stats, template)
    prepared = _prepare_uncached(cfg, tokenizer, seed)
    if key is not None:
        prepared.stats.cache = "miss" if rebuilt is None else "rebuilt"
        prepared.stats.cache_note = rebuilt
        data_cache.store(key, prepared.train, prepared.val, prepared.stats.to_dict())
    prepared.stats.prepare_s = round(time.perf_counter() - t0, 3)
    return prepared


def _profile_rows(cfg: DataSection) -> int:
    """The rows of ``data.path`` as the pipeline reads them now (its profile): what a cached entry must have been made of."""
    stats = DataStats()
    load_examples(cfg.path, cfg, stats)
    return stats.rows


def tool_use(examples: Sequence[dict[str, Any]], tokenizer: Any, template: str) -> dict[str, Any] | None:
    """What the run keeps of its rows' tools (:func:`finetuner.data.tools.statement`), None without any."""
    used = [ex for ex in examples if ex.get("messages") and tools.has_tools(ex["messages"], ex.get("tools"))]
    if not used:
        return None
    schema = sum(len(tokenizer(json.dumps(ex["tools"], ensure_ascii=False), add_special_tokens=False)["input_ids"])
                 for ex in used if ex.get("tools"))
    return tools.statement(tools.renders_tools(tokenizer, template), len(used), schema)


def _prepare_uncached(cfg: DataSection, tokenizer: Any, seed: int, processor: Any = None) -> PreparedData:
    stats = DataStats()
    examples = load_examples(cfg.path, cfg, stats)
    stats.system_prompt = shared_system(examples)
    if processor is None:
        stats.thinking = thinking.statement(tokenizer, chat_template_for(tokenizer, cfg),
                                            (ex.get("messages") for ex in examples), cfg.thinking, cfg.reasoning)
        stats.tools = tool_use(examples, tokenizer, chat_template_for(tokenizer, cfg))
    train = tokenize_examples(examples, tokenizer, cfg, stats, processor)
    val = None
    if cfg.val_path:
        val = tokenize_examples(load_examples(cfg.val_path, cfg, stats), tokenizer, cfg, stats, processor)
    elif cfg.val_size > 0:
        n_val = held_out_checked(cfg.val_size, len(train))  # as the plan counts them
        split = train.train_test_split(test_size=n_val, seed=seed, shuffle=True)
        train, val = split["train"], split["test"]
    stats.train_examples = len(train)
    stats.val_examples = len(val) if val is not None else 0
    lengths = [len(x) for x in train["input_ids"]]
    stats.train_tokens = sum(lengths)
    stats.trained_tokens = sum(sum(1 for t in labels if t != IGNORE_INDEX) for labels in train["labels"])
    kept = ("input_ids", "labels", "images")
    train = train.remove_columns([c for c in train.column_names if c not in kept])
    if val is not None:
        val = val.remove_columns([c for c in val.column_names if c not in kept])
    stats.pictures = sum(len(x) for x in train["images"]) if "images" in train.column_names else 0
    if stats.pictures and cfg.packing is True:
        raise UserError("data.packing: true, but the rows have pictures, which are not packed.",
                        hint="Set data.packing to auto or false.")
    stats.packing = resolve_packing(cfg.packing, lengths, cfg.max_seq_len) and not stats.pictures
    if stats.packing:
        train = pack(train, cfg.max_seq_len, seed)
        stats.packed_rows = len(train)
        if val is not None:
            val = pack(val, cfg.max_seq_len, seed)
    return PreparedData(train, val, stats, chat_template_for(processor or tokenizer, cfg))


class Collator:
    """Pads a list of examples on the right into a batch of tensors."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        n = max(len(x["input_ids"]) for x in batch)
        packed = "position_ids" in batch[0]
        ids, labels, extra = [], [], []
        for x in batch:
            pad = n - len(x["input_ids"])
            ids.append(x["input_ids"] + [self.pad_token_id] * pad)
            labels.append(x["labels"] + [IGNORE_INDEX] * pad)
            if packed:  # padding is one more "example" with its own positions
                extra.append(x["position_ids"] + list(range(pad)))
            else:
                extra.append([1] * len(x["input_ids"]) + [0] * pad)
        out = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
        if packed:
            out["position_ids"] = torch.tensor(extra)
            out["num_tokens"] = sum(len(x["input_ids"]) for x in batch)
        else:
            out["attention_mask"] = torch.tensor(extra)
            out["num_tokens"] = int(out["attention_mask"].sum())
        return out

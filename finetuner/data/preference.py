"""Preference data: files of pairs (DPO, ORPO, SimPO) or rated responses (KTO) → tokens.

Formats, detected from a row's keys (:func:`finetuner.data.formats.preference_kind`):

=====================  ================================================================
layout                 row keys
=====================  ================================================================
``sharegpt_ranking``   LLaMA-Factory's ranking ShareGPT: ``conversations`` (or ``messages``)
                       ending with the user's turn, ``chosen`` and ``rejected`` each one
                       message (from/value or role/content) or a text; optional ``system``
``trl``                TRL's preference format: ``prompt``, ``chosen``, ``rejected``, each a
                       text or a list of role/content messages; without ``prompt``, chosen and
                       rejected are whole conversations that differ only in the last reply
``columns``            ``system`` (optional), ``question`` / ``prompt`` / ``instruction`` (and
                       ``input``), ``chosen``, ``rejected`` texts
``kto_messages``       KTO: ``messages`` ending with the assistant's reply, boolean ``label``
``kto_completion``     KTO: ``prompt`` and ``completion`` (texts or message lists), ``label``
=====================  ================================================================

Every example becomes a prompt (a list of chat messages) and one response per side; the chat
template renders them as in SFT (:func:`finetuner.data.pipeline.chat_template_for`) and only the
response's tokens are scored. A sequence longer than ``data.max_seq_len`` loses the start of its
prompt first (the end of the prompt, next to the response, is kept), the end of its response only
when the response alone does not fit.

A bad row (the same chosen and rejected, a side missing, an empty response, chosen and rejected
after different prompts) is named with its file and row, and stops the run or is skipped
(``data.on_bad_row``) like SFT's. A file of one kind of data given to a recipe of another
objective gets an error saying which objective it fits.

Examples are plain dicts: pairs hold ``chosen_ids``/``chosen_labels``/``rejected_ids``/
``rejected_labels``; rated ones ``input_ids``/``labels``/``desirable`` plus ``kl_ids``/``kl_labels``
(this prompt with a response to another prompt: the mismatched pair KTO estimates its reference
point from; see :func:`mismatched_partners`). Each has ``idx``, its place in its split (the key of
precomputed reference scores).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from finetuner.data.split import held_out_checked, shuffled_split
from finetuner.config.sections import DataSection
from finetuner.data.formats import (
    CHAT_ROLES,
    SHAREGPT_ROLES,
    SUPERVISED,
    RowError,
    detect_layout,
    preference_kind,
    read_rows,
    wrong_objective,
)
from finetuner.data.pipeline import IGNORE_INDEX, DataStats, PreparedData, chat_template_for, raise_or_skip
from finetuner.data.textcut import char_budget
from finetuner.objectives.specs import spec_of
from finetuner.data import textcut
from finetuner.data.tools import refuse_calls
from finetuner.errors import UserError

log = logging.getLogger(__name__)

PROMPT_COLUMNS = ("prompt", "question", "instruction", "query")


# --------------------------------------------------------------------------- rows
def _text(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise RowError(f"{what} must be text, got {type(v).__name__}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise RowError(f"{what} contains an unpaired surrogate: not valid Unicode text") from None
    return v


def _message(m: Any, what: str) -> dict[str, str]:
    """One message in OpenAI (role/content) or ShareGPT (from/value) form, as role/content."""
    if not isinstance(m, dict):
        raise RowError(f"{what} must be a message (role/content or from/value), got {type(m).__name__}")
    refuse_calls(m, what, "preference pairs")
    if "from" in m or "value" in m:
        role, content, roles = m.get("from"), m.get("value"), SHAREGPT_ROLES
    else:
        role, content, roles = m.get("role"), m.get("content"), {r: r for r in CHAT_ROLES}
    if not isinstance(role, str) or role not in roles:
        raise RowError(f"{what}: unknown role {role!r} (expected one of {', '.join(sorted(roles))})")
    return {"role": roles[role], "content": _text(content, f"{what}: the content")}


def _messages(v: Any, what: str) -> list[dict[str, str]]:
    if not isinstance(v, list):
        raise RowError(f"{what} must be a list of messages, got {type(v).__name__}")
    return [_message(m, f"{what}, message {i}") for i, m in enumerate(v, start=1)]


def _response(v: Any, key: str) -> str:
    """A response: a text, one assistant message, or a list of exactly one assistant message."""
    if v is None:
        raise RowError(f"missing '{key}': a pair needs both a chosen and a rejected response")
    if isinstance(v, list):
        if len(v) != 1:
            raise RowError(f"'{key}' must hold one reply (a text or one assistant message), got {len(v)} messages")
        v = v[0]
    if isinstance(v, dict):
        m = _message(v, f"'{key}'")
        if m["role"] != "assistant":
            raise RowError(f"'{key}' must be the assistant's reply, got a {m['role']} message")
        v = m["content"]
    text = _text(v, f"'{key}'")
    if not text.strip():
        raise RowError(f"'{key}' is empty: there is no response to score")
    return text


def _with_system(prompt: list[dict[str, str]], system: Any) -> list[dict[str, str]]:
    if system and (not prompt or prompt[0]["role"] != "system"):
        return [{"role": "system", "content": _text(system, "'system'")}, *prompt]
    return prompt


def _check_prompt(prompt: list[dict[str, str]]) -> list[dict[str, str]]:
    if not any(m["role"] == "user" and m["content"].strip() for m in prompt):
        raise RowError("the prompt is empty: there is no user message to answer")
    if prompt[-1]["role"] != "user":
        raise RowError(f"the prompt must end with the user's turn, not the {prompt[-1]['role']}'s")
    return prompt


def _split_conversations(chosen: list[dict[str, str]], rejected: list[dict[str, str]]) -> tuple[list, str, str]:
    """TRL's implicit prompt: two whole conversations that differ only in their last reply."""
    for side, conv in (("chosen", chosen), ("rejected", rejected)):
        if not conv or conv[-1]["role"] != "assistant":
            raise RowError(f"'{side}' must end with the assistant's reply")
    if chosen[:-1] != rejected[:-1]:
        i = next((i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])) if a != b), min(len(chosen), len(rejected)) - 1)
        raise RowError(f"chosen and rejected have different prompts (they differ at message {i + 1}): a pair answers one prompt")
    for side, conv in (("chosen", chosen), ("rejected", rejected)):
        if not conv[-1]["content"].strip():
            raise RowError(f"'{side}' is empty: there is no response to score")
    return chosen[:-1], chosen[-1]["content"], rejected[-1]["content"]


def pair_layout(row: dict[str, Any]) -> str:
    """Which pair layout a row is in (see the module's table)."""
    if "conversations" in row or "messages" in row:
        return "sharegpt_ranking"
    if "prompt" in row and (isinstance(row.get("prompt"), list) or isinstance(row.get("chosen"), (list, dict))):
        return "trl"
    if "prompt" not in row and isinstance(row.get("chosen"), list):
        return "trl"
    return "columns"


def normalize_pair(row: Any, layout: str, system_prompt: str | None = None) -> dict[str, Any]:
    """One row of pairs as ``{"prompt": messages, "chosen": text, "rejected": text}``."""
    if not isinstance(row, dict):
        raise RowError(f"expected an object with named fields, got {type(row).__name__}")
    system = row.get("system") or system_prompt
    if layout == "sharegpt_ranking":
        key = "conversations" if "conversations" in row else "messages"
        prompt = _messages(row[key], f"'{key}'")
        chosen, rejected = _response(row.get("chosen"), "chosen"), _response(row.get("rejected"), "rejected")
    elif layout == "trl" and "prompt" not in row:
        for side in ("chosen", "rejected"):
            if row.get(side) is None:
                raise RowError(f"missing '{side}': a pair needs both a chosen and a rejected response")
        prompt, chosen, rejected = _split_conversations(_messages(row["chosen"], "'chosen'"), _messages(row["rejected"], "'rejected'"))
    else:
        col = next((c for c in PROMPT_COLUMNS if c in row), None)
        if col is None:
            raise RowError(f"missing the prompt: a column named {', '.join(PROMPT_COLUMNS)}")
        p = row[col]
        if isinstance(p, list):
            prompt = _messages(p, f"'{col}'")
        else:
            text = _text(p, f"'{col}'")
            extra = row.get("input") if col == "instruction" else None
            if extra:
                text = f"{text}\n\n{_text(extra, chr(39) + 'input' + chr(39))}" if text.strip() else extra
            prompt = [{"role": "user", "content": text}]
        # TRL conversational pairs may repeat the prompt in chosen/rejected: keep the last reply
        ch, rj = row.get("chosen"), row.get("rejected")
        if isinstance(ch, list) and isinstance(rj, list) and len(ch) > 1 and len(rj) > 1:
            head_c, chosen, rejected = _split_conversations(_messages(ch, "'chosen'"), _messages(rj, "'rejected'"))
            if head_c and head_c != prompt[-len(head_c):]:
                raise RowError("'chosen' repeats a prompt that is not the row's 'prompt': a pair answers one prompt")
        else:
            chosen, rejected = _response(ch, "chosen"), _response(rj, "rejected")
    prompt = _check_prompt(_with_system(prompt, system))
    if chosen.strip() == rejected.strip():
        raise RowError("'chosen' and 'rejected' are the same response: the pair says nothing about which is better")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def normalize_rated(row: Any, system_prompt: str | None = None) -> dict[str, Any]:
    """One row of KTO's unpaired data as ``{"prompt": messages, "completion": text, "desirable": bool}``."""
    if not isinstance(row, dict):
        raise RowError(f"expected an object with named fields, got {type(row).__name__}")
    label = row.get("label")
    if not isinstance(label, bool):
        raise RowError(f"'label' must be true (a desirable response) or false (an undesirable one), got {label!r}")
    if "messages" in row:
        conv = _messages(row["messages"], "'messages'")
        if not conv or conv[-1]["role"] != "assistant":
            raise RowError("'messages' must end with the assistant's reply (the response the label rates)")
        prompt, completion = conv[:-1], conv[-1]["content"]
        if not completion.strip():
            raise RowError("the last message is empty: there is no response to score")
    else:
        p = row.get("prompt")
        if p is None:
            raise RowError("missing 'prompt'")
        prompt = _messages(p, "'prompt'") if isinstance(p, list) else [{"role": "user", "content": _text(p, "'prompt'")}]
        completion = _response(row.get("completion"), "completion")
    prompt = _check_prompt(_with_system(prompt, row.get("system") or system_prompt))
    return {"prompt": prompt, "completion": completion, "desirable": label}


def read_preference_file(path: str, objective: str, cfg: DataSection, bad: list[RowError]) -> tuple[Iterator[dict[str, Any]], dict[str, Any]]:
    """The normalised examples of one file for ``objective``, and what was found (``layout``,
    ``rows``); bad rows go to ``bad``. A :class:`UserError` when the file holds data for another objective."""
    want = spec_of(objective).data_kind
    info: dict[str, Any] = {"layout": None, "rows": 0}

    def rows() -> Iterator[dict[str, Any]]:
        for raw in read_rows(path, cfg.split, bad):
            info["rows"] += 1
            if info["layout"] is None:
                kind = preference_kind(raw.data)
                if kind is None:
                    found = detect_layout(raw.data)
                    what = f" (format {found.describe()})" if found else ""
                    if found is None:
                        cols = ", ".join(map(str, raw.data)) if isinstance(raw.data, dict) else type(raw.data).__name__
                        raise UserError(
                            f"{raw.place}: cannot read preference data from these columns ({cols}).",
                            hint="Pairs need chosen and rejected (with conversations, prompt or question); KTO's rated "
                            "responses need messages or prompt/completion and a true/false label.",
                        )
                    raise wrong_objective(raw.place, SUPERVISED, objective, what)
                if kind != want:
                    raise wrong_objective(raw.place, kind, objective)
                info["layout"] = pair_layout(raw.data) if kind == "pairs" else (
                    "kto_messages" if "messages" in raw.data else "kto_completion")
            # each row by its own keys (the first row's layout names the file in the stats)
            layout = pair_layout(raw.data) if want == "pairs" and isinstance(raw.data, dict) else info["layout"]
            try:
                ex = normalize_pair(raw.data, layout, cfg.system_prompt) if want == "pairs" else normalize_rated(raw.data, cfg.system_prompt)
            except RowError as e:
                bad.append(RowError(f"{raw.place}: {e} (preference layout '{layout}')."))
                continue
            ex["_where"] = raw.place
            yield ex

    return rows(), info


# --------------------------------------------------------------------------- tokens
def _render(tokenizer: Any, template: str, messages: list[dict[str, str]], gen: bool) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen)


def split_tokens(tokenizer: Any, template: str, prompt: list[dict[str, str]], response: str,
                 max_len: int | None = None) -> tuple[list[int], list[int]]:
    """The tokens of the prompt (with the generation prompt) and of the response (with the end of
    its turn), as the whole conversation tokenizes; a token straddling the boundary is the response's.
    With ``max_len`` (the tokens :func:`join` keeps), only what those can hold is tokenized
    (:mod:`finetuner.data.textcut`): the end of each prompt message and the start of the response."""
    if max_len is not None:
        budget = char_budget(tokenizer, max_len)
        prompt = [{**m, "content": textcut.tail(m["content"], budget)} if isinstance(m.get("content"), str) else m for m in prompt]
        response = textcut.head(response, budget)
    try:
        head = _render(tokenizer, template, prompt, gen=True)
        full = _render(tokenizer, template, [*prompt, {"role": "assistant", "content": response}], gen=False)
    except Exception as e:  # jinja errors raised by the template for this conversation
        raise RowError(f"the chat template failed on this conversation: {e}") from None
    if not full.startswith(head):
        raise RowError("the chat template does not render the prompt as the start of the conversation, so the "
                       "response cannot be located; set data.chat_template to a template that does")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    k = next((i for i, (_s, e) in enumerate(enc["offset_mapping"]) if e > len(head)), len(ids))
    return ids[:k], ids[k:]


def join(prompt: list[int], response: list[int], max_len: int) -> tuple[list[int], list[int], bool]:
    """Prompt + response tokens in ``max_len``, and their labels (the response's only). Too long:
    the start of the prompt goes first (at least half of ``max_len`` stays for the prompt when it
    has that many), then the end of the response."""
    truncated = len(prompt) + len(response) > max_len
    if truncated:
        keep = max(max_len - len(response), min(len(prompt), max_len // 2))
        prompt = prompt[len(prompt) - keep:]
        response = response[: max_len - len(prompt)]
    return prompt + response, [IGNORE_INDEX] * len(prompt) + list(response), truncated


def mismatched_partners(prompts: list[Any]) -> list[int] | None:
    """For each rated example, the one whose response makes its mismatched pair: the next example
    (wrapping around) whose prompt differs from its own, so that no pair is a second answer to the
    same prompt (a file that lists both answers to a prompt back to back would otherwise pair them);
    None when every example has the same prompt."""
    n = len(prompts)
    # the examples that start a run of equal prompts, going round the list (the last one precedes the first)
    starts = [i for i in range(n) if prompts[i] != prompts[i - 1]]
    if not starts:
        return None
    partners, following = [0] * n, starts[0]  # after the last run comes the first (there are at least two)
    for i in range(n - 1, -1, -1):
        partners[i] = following
        if prompts[i] != prompts[i - 1]:
            following = i
    return partners


def encode_examples(examples: list[dict[str, Any]], tokenizer: Any, template: str, cfg: DataSection,
                    stats: DataStats, key: str = "data.path") -> list[dict[str, Any]]:
    """Tokens and labels of every example (see the module's docstring for the fields); ``key``: the
    recipe key that named the examples' files, for the error about rated rows of a single prompt."""
    out: list[dict[str, Any]] = []
    bad: list[str] = []
    split: list[tuple[dict[str, Any], tuple[list[int], list[int]]]] = []
    for ex in examples:
        try:
            if "chosen" in ex:
                pc, rc = split_tokens(tokenizer, template, ex["prompt"], ex["chosen"], cfg.max_seq_len)
                pr, rr = split_tokens(tokenizer, template, ex["prompt"], ex["rejected"], cfg.max_seq_len)
                c_ids, c_labels, c_cut = join(pc, rc, cfg.max_seq_len)
                r_ids, r_labels, r_cut = join(pr, rr, cfg.max_seq_len)
                stats.truncated += int(c_cut or r_cut)
                out.append({"chosen_ids": c_ids, "chosen_labels": c_labels, "rejected_ids": r_ids, "rejected_labels": r_labels})
            else:
                split.append((ex, split_tokens(tokenizer, template, ex["prompt"], ex["completion"], cfg.max_seq_len)))
        except RowError as e:
            bad.append(f"{ex['_where']}: {e}.")
    partners = mismatched_partners([ex["prompt"] for ex, _ in split])
    if split and partners is None:
        where = split[0][0]["_where"].rpartition(", ")[0] or split[0][0]["_where"]
        raise UserError(
            f"{key}: every rated row of {where} has the same prompt ({len(split)} row{'s' if len(split) > 1 else ''}); KTO "
            "measures each response against a response to another prompt, so it needs rows of at least two prompts.",
            hint="Add rated rows for other prompts to the file.",
        )
    for i, (ex, (p, r)) in enumerate(split):
        ids, labels, cut = join(p, r, cfg.max_seq_len)
        stats.truncated += int(cut)
        # the mismatched pair: this prompt, the response of the next example with another prompt
        kl_ids, kl_labels, _ = join(p, split[partners[i]][1][1], cfg.max_seq_len)
        out.append({"input_ids": ids, "labels": labels, "desirable": ex["desirable"], "kl_ids": kl_ids, "kl_labels": kl_labels})
    if bad:
        if cfg.on_bad_row == "error":
            raise UserError(bad[0], hint="Fix the row, or set data.on_bad_row: skip.")
        stats.skipped += len(bad)
        stats.skipped_reasons += bad
    return out


# --------------------------------------------------------------------------- putting it together
def load_preference_examples(paths: str | list[str], objective: str, cfg: DataSection, stats: DataStats) -> list[dict[str, Any]]:
    examples: list[dict[str, Any]] = []
    for path in [paths] if isinstance(paths, str) else paths:
        bad: list[RowError] = []
        rows, info = read_preference_file(path, objective, cfg, bad)
        n_before = len(examples)
        for ex in rows:
            raise_or_skip(bad, cfg, stats)
            examples.append(ex)
            if cfg.max_examples and len(examples) >= cfg.max_examples:
                break
        raise_or_skip(bad, cfg, stats)
        stats.rows += info["rows"]
        stats.format[path] = info["layout"] or "preference"
        if len(examples) == n_before:
            raise UserError(f"{path}: no usable rows.", hint="The file is empty or every row was skipped.")
    return examples


def prepare_preference_data(cfg: DataSection, objective: str, tokenizer: Any, seed: int) -> PreparedData:
    """Train and validation examples of a preference objective (not packed, not cached: the examples
    are plain lists of token ids, tokenized in a few seconds for thousands of pairs)."""
    import time

    t0 = time.perf_counter()
    if cfg.columns or cfg.format != "auto":
        key = "columns" if cfg.columns else "format"
        raise UserError(
            f"data.{key}: objective '{objective}' finds its columns by their names (conversations/prompt/question, "
            "chosen, rejected; or messages/prompt/completion and label): remove data.{key}.".replace("{key}", key)
        )
    stats = DataStats()
    template = chat_template_for(tokenizer, cfg)
    train = encode_examples(load_preference_examples(cfg.path, objective, cfg, stats), tokenizer, template, cfg, stats)
    val = None
    if cfg.val_path:
        val = encode_examples(load_preference_examples(cfg.val_path, objective, cfg, stats), tokenizer, template, cfg, stats,
                              "data.val_path")
    elif cfg.val_size > 0:
        n_val = held_out_checked(cfg.val_size, len(train))  # as the plan counts them
        held, kept = shuffled_split(len(train), n_val, seed)
        val, train = [train[i] for i in held], [train[i] for i in kept]
    for split in (train, val or []):
        for i, ex in enumerate(split):
            ex["idx"] = i
    stats.train_examples, stats.val_examples = len(train), len(val) if val is not None else 0
    seqs = [(ex[f"{s}_ids"], ex[f"{s}_labels"]) for ex in train for s in ("chosen", "rejected")] if train and "chosen_ids" in train[0] \
        else [(ex["input_ids"], ex["labels"]) for ex in train]
    stats.train_tokens = sum(len(ids) for ids, _ in seqs)
    stats.trained_tokens = sum(sum(1 for t in labels if t != IGNORE_INDEX) for _, labels in seqs)
    stats.packing = False
    stats.prepare_s = round(time.perf_counter() - t0, 3)
    return PreparedData(train, val, stats, template)


class PreferenceCollator:
    """A micro-batch of pairs as one batch of ``2n`` rows (the chosen responses, then the rejected),
    or of ``n`` rated responses then their ``n`` mismatched pairs; padded on the right."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        if "chosen_ids" in batch[0]:
            seqs = [(x["chosen_ids"], x["chosen_labels"]) for x in batch] + [(x["rejected_ids"], x["rejected_labels"]) for x in batch]
        else:
            seqs = [(x["input_ids"], x["labels"]) for x in batch] + [(x["kl_ids"], x["kl_labels"]) for x in batch]
        n = max(len(ids) for ids, _ in seqs)
        out = {
            "input_ids": torch.tensor([ids + [self.pad_token_id] * (n - len(ids)) for ids, _ in seqs]),
            "labels": torch.tensor([labels + [IGNORE_INDEX] * (n - len(labels)) for _, labels in seqs]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (n - len(ids)) for ids, _ in seqs]),
            "idx": torch.tensor([x["idx"] for x in batch]),
            "num_tokens": sum(len(ids) for ids, _ in seqs),
        }
        if "desirable" in batch[0]:
            out["desirable"] = torch.tensor([x["desirable"] for x in batch])
        return out

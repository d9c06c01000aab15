"""The prompts of ``objective: grpo``: the prompt side of any supported data format, or a file of
prompts alone, tokenized with the chat template's generation prompt.

A row gives its prompt from, in this order:

* ``prompt`` (or the column ``data.columns.prompt`` names): a text (TRL's *standard* format, the
  reward functions get texts) or a list of messages (TRL's *conversational* format: they get
  message lists);
* ``messages`` / ``conversations`` (chat data, preference pairs in ShareGPT form): the conversation up
  to its last user turn (the replies after it are dropped);
* ``instruction`` (with ``input``), ``question``, ``query`` or ``problem``: alpaca-style instruction
  data and question/answer files, the reply column (if any) kept for the rewards.

Every other column of the row is kept as it is and handed to the reward functions by name
(``answer`` for an exact-match reward, for example), as TRL does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetuner.config.sections import DataSection
from finetuner.data.formats import SHAREGPT_ROLES, RowError, read_rows
from finetuner.data.pipeline import DataStats, PreparedData, chat_template_for, raise_or_skip
from finetuner.errors import UserError
from finetuner.data.split import held_out_checked, shuffled_split
from finetuner.data.tools import refuse_calls

#: columns read as the prompt (a text) when the row has no ``prompt`` or conversation
QUESTION_KEYS = ("instruction", "question", "query", "problem")


@dataclass
class PromptRow:
    """A prompt as the reward functions see it (a text or a list of messages), its messages for the
    chat template, and the row's other columns."""

    prompt: str | list[dict[str, str]]
    messages: list[dict[str, str]]
    columns: dict[str, Any]


def _messages(turns: Any, what: str) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise RowError(f"'{what}' must be a text or a non-empty list of messages")
    out = []
    for i, t in enumerate(turns, start=1):
        if not isinstance(t, dict):
            raise RowError(f"'{what}' turn {i} must be an object with role and content")
        refuse_calls(t, f"'{what}' turn {i}", "GRPO prompts")
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        if role not in SHAREGPT_ROLES or not isinstance(content, str):
            raise RowError(f"'{what}' turn {i}: needs a known role and a text content")
        out.append({"role": SHAREGPT_ROLES[role], "content": content})
    return out


def prompt_of(row: Any, columns: dict[str, str] | None = None, system_prompt: str | None = None) -> PromptRow:
    """The prompt of one raw row (see the module's docstring); a :class:`RowError` saying what is missing."""
    if isinstance(row, str):
        row = {"prompt": row}
    if not isinstance(row, dict):
        raise RowError(f"expected an object with named fields, got {type(row).__name__}")
    key = (columns or {}).get("prompt") or ("prompt" if "prompt" in row else None)
    used: set[str] = set()
    if key is not None:
        if key not in row:
            raise RowError(f"missing '{key}' (data.columns.prompt)")
        value, used = row[key], {key}
        if isinstance(value, str):
            if not value.strip():
                raise RowError(f"'{key}' is empty")
            prompt: str | list[dict[str, str]] = value
            messages = [{"role": "user", "content": value}]
        else:
            messages = _messages(value, key)
            prompt = messages
    elif "messages" in row or "conversations" in row:
        key = "messages" if "messages" in row else "conversations"
        messages, used = _messages(row[key], key), {key}
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages or messages[-1]["role"] != "user":
            raise RowError(f"'{key}' has no user turn to answer")
        prompt = messages
    else:
        key = next((k for k in QUESTION_KEYS if isinstance(row.get(k), str) and row[k].strip()), None)
        if key is None:
            raise RowError(f"no prompt: give a 'prompt' column (or messages, or one of {', '.join(QUESTION_KEYS)}), "
                           "or name the column with data.columns.prompt")
        text, used = row[key], {key}
        if key == "instruction" and isinstance(row.get("input"), str) and row["input"].strip():
            text, used = f"{text}\n\n{row['input']}", {key, "input"}
        prompt, messages = text, [{"role": "user", "content": text}]
    system = row.get("system") if isinstance(row.get("system"), str) else system_prompt
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
        used.add("system")
    return PromptRow(prompt, messages, {k: v for k, v in row.items() if k not in used})


def encode_prompt(p: PromptRow, tokenizer: Any, template: str) -> list[int]:
    """The prompt's tokens: its messages rendered with the generation prompt (the assistant's turn opened)."""
    try:
        text = tokenizer.apply_chat_template(p.messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja errors raised by the template for this conversation
        raise RowError(f"the chat template failed on this prompt: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_prompts(paths: str | list[str], cfg: DataSection, tokenizer: Any, template: str, max_prompt_len: int,
                 stats: DataStats) -> list[dict[str, Any]]:
    """The prompt examples of every path: ``prompt_ids``, ``prompt``, ``columns`` and ``where``."""
    out: list[dict[str, Any]] = []
    for path in [paths] if isinstance(paths, str) else paths:
        bad: list[RowError] = []
        n_before = len(out)
        for raw in read_rows(path, cfg.split, bad):
            stats.rows += 1
            try:
                p = prompt_of(raw.data, cfg.columns, cfg.system_prompt)
                ids = encode_prompt(p, tokenizer, template)
                if len(ids) > max_prompt_len:
                    raise RowError(f"the prompt is {len(ids)} tokens, longer than data.max_seq_len - grpo.max_new_tokens "
                                   f"({max_prompt_len})")
            except RowError as e:
                bad.append(RowError(f"{raw.place}: {e}."))
                raise_or_skip(bad, cfg, stats)
                continue
            out.append({"prompt_ids": ids, "prompt": p.prompt, "columns": p.columns, "where": raw.place})
            if cfg.max_examples and len(out) >= cfg.max_examples:
                break
        raise_or_skip(bad, cfg, stats)
        stats.format[path] = "prompts"
        if len(out) == n_before:
            raise UserError(f"{path}: no usable prompts.", hint="The file is empty or every row was skipped.")
    return out


def prepare_prompts(cfg: DataSection, tokenizer: Any, seed: int, max_new_tokens: int) -> PreparedData:
    """Train and validation prompts (``data.val_size`` held out at random with ``seed``, or ``data.val_path``)."""
    stats = DataStats()
    template = chat_template_for(tokenizer, cfg)
    limit = cfg.max_seq_len - max_new_tokens
    train = load_prompts(cfg.path, cfg, tokenizer, template, limit, stats)
    val = None
    if cfg.val_path:
        val = load_prompts(cfg.val_path, cfg, tokenizer, template, limit, stats)
    elif cfg.val_size > 0:
        n_val = held_out_checked(cfg.val_size, len(train), "prompts")
        held = set(shuffled_split(len(train), n_val, seed)[0])
        val = [train[i] for i in sorted(held)]
        train = [x for i, x in enumerate(train) if i not in held]
    stats.train_examples, stats.val_examples = len(train), len(val or [])
    stats.train_tokens = sum(len(x["prompt_ids"]) for x in train)
    stats.packing = False
    return PreparedData(train, val, stats, template)

"""Reading data files as they are, detecting their format, and normalising rows.

Supported inputs: JSON (an array, or JSON Lines in a .json file), JSONL, CSV and Parquet
files, and hub data set ids (through :func:`datasets.load_dataset`).

Formats, detected from a row's keys unless the recipe names one:

==============  ============================================================  ==============
format          row keys                                                      normalised to
==============  ============================================================  ==============
``alpaca``      ``instruction``, ``input`` (optional), ``output``,            messages
                optional ``system`` and ``history`` ([[prompt, reply], ...])
``chat``        ``messages`` (OpenAI: role/content) or ``conversations``      messages
                (ShareGPT: from/value; optional ``system``, ``tools``)
``text``        ``text``                                                      text
``completion``  ``prompt``, ``completion``                                    prompt/completion
==============  ============================================================  ==============

A row that cannot be read becomes a :class:`RowError` naming the file and row; the caller
either stops with it or skips the row and counts it (``data.on_bad_row``).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetuner.errors import UserError
from finetuner.fileio import exists

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
}
CHAT_ROLES = {"system", "user", "assistant", "tool"}


class RowError(ValueError):
    """One row of a data file cannot be used; the message says why."""


@dataclass
class RawRow:
    """A row as read from its source, with where it came from (for error messages)."""

    source: str
    where: str  # "line 12" / "row 12"
    data: Any

    @property
    def place(self) -> str:
        return f"{self.source}, {self.where}"


# --------------------------------------------------------------------------- reading
def _decode(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(
            f"{path}: line {line}: not UTF-8 text (byte {e.start}).",
            hint="Save the file as UTF-8, or check that it is a data file at all.",
        ) from None


def _json_lines(path: Path, text: str, bad: list[RowError]) -> Iterator[RawRow]:
    # lines end at \n (or \r\n) only: str.splitlines() would also split at U+2028, U+0085, ...,
    # which JSON allows unescaped inside strings
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield RawRow(str(path), f"line {lineno}", json.loads(line))
        except json.JSONDecodeError as e:
            bad.append(RowError(f"{path}, line {lineno}: invalid JSON ({e.msg}, column {e.colno})."))
        except RecursionError:
            bad.append(RowError(f"{path}, line {lineno}: invalid JSON (nested too deeply)."))


def read_rows(path: str, split: str = "train", bad: list[RowError] | None = None) -> Iterator[RawRow]:
    """Yield the rows of a local file or hub data set; unreadable JSON lines go to ``bad``."""
    bad = bad if bad is not None else []
    p = Path(path)
    if not exists(p):
        yield from _hub_rows(path, split)
        return
    if p.is_dir():
        raise UserError(f"{p}: is a folder; data.path must name a file (.json, .jsonl, .csv, .parquet).")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        yield from _json_lines(p, _decode(p), bad)
    elif suffix == ".json":
        text = _decode(p)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":  # JSON Lines saved as .json
                yield from _json_lines(p, text, bad)
                return
            raise UserError(f"{p}: line {e.lineno}, column {e.colno}: invalid JSON ({e.msg}).") from None
        except RecursionError:
            raise UserError(f"{p}: invalid JSON: arrays or objects nested too deeply.") from None
        if isinstance(data, dict):
            if detect_format(data) is not None:  # one row (JSON Lines with a single line)
                data = [data]
            else:  # {"data": [rows]}
                data = next((v for v in data.values() if isinstance(v, list)), None) if len(data) == 1 else None
        if not isinstance(data, list):
            raise UserError(f"{p}: expected a JSON array of rows (or JSON Lines, one object per line).")
        for i, row in enumerate(data, start=1):
            yield RawRow(str(p), f"row {i}", row)
    elif suffix == ".csv":
        text = _decode(p)
        # newline="": lines end at \n, \r or \r\n only (str.splitlines() would also split cells at
        # U+2028, U+0085, \x1c, ... and silently break rows apart)
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            for row in reader:
                if None in row:
                    bad.append(RowError(f"{p}, line {reader.line_num}: more fields than the header has."))
                    continue
                yield RawRow(str(p), f"line {reader.line_num}", dict(row))
        except csv.Error as e:
            raise UserError(f"{p}, line {reader.line_num}: invalid CSV ({e}).") from None
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise UserError(f"{p}: not a readable Parquet file ({e}).") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield RawRow(str(p), f"row {i}", row)
    else:
        raise UserError(
            f"{p}: unsupported file type '{suffix or '(none)'}'.",
            hint="Use .json, .jsonl, .csv or .parquet.",
        )


def _hub_rows(name: str, split: str) -> Iterator[RawRow]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # network, missing repo, missing split
        raise UserError(
            f"data.path: could not load '{name}' as a local file or a hub data set ({type(e).__name__}: {e}).",
            hint="Check the path, or the hub id and your connection (HF_HUB_OFFLINE must be unset).",
        ) from None
    for i, row in enumerate(ds, start=1):
        yield RawRow(name, f"row {i}", row)


# --------------------------------------------------------------------------- formats
def detect_format(row: Any) -> str | None:
    """The format a row is in, from its keys, or ``None`` if none fits."""
    if not isinstance(row, dict):
        return None
    keys = set(row)
    if "messages" in keys or "conversations" in keys:
        return "chat"
    if "instruction" in keys and "output" in keys:
        return "alpaca"
    if "prompt" in keys and "completion" in keys:
        return "completion"
    if "text" in keys:
        return "text"
    return None


def _valid_text(v: str, what: str) -> str:
    """``v`` if it is valid Unicode: JSON's \\ud800-style escapes can carry lone surrogates, which
    no tokenizer or Arrow table takes."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(f"{what} contains an unpaired surrogate (\\u{ord(v[e.start]):04x} at character {e.start + 1}): "
                       "not valid Unicode text") from None
    return v


def _text(row: dict, key: str, *, required: bool = True) -> str:
    v = row.get(key)
    if v is None:
        if required:
            raise RowError(f"missing '{key}'")
        return ""
    if not isinstance(v, str):
        raise RowError(f"'{key}' must be text, got {type(v).__name__}")
    return _valid_text(v, f"'{key}'")


def _check_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    prev = None
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system" and i != 0:
            raise RowError(f"message {i + 1}: a system message must come first")
        if role in ("user", "assistant") and role == prev:
            raise RowError(f"messages {i} and {i + 1} are both '{role}': turns must alternate user/assistant")
        prev = role
    while messages and messages[-1]["role"] != "assistant":
        messages = messages[:-1]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise RowError("no assistant reply to train on")
    return messages


def normalize(row: Any, fmt: str, system_prompt: str | None = None) -> dict[str, Any]:
    """Turn one raw row into ``{"messages": [...]}``, ``{"text": ...}`` or ``{"prompt", "completion"}``."""
    if not isinstance(row, dict):
        raise RowError(f"expected an object with named fields, got {type(row).__name__}")
    if fmt == "text":
        text = _text(row, "text")
        if not text.strip():
            raise RowError("'text' is empty")
        return {"text": text}
    if fmt == "completion":
        prompt, completion = _text(row, "prompt"), _text(row, "completion")
        if not completion.strip():
            raise RowError("'completion' is empty")
        return {"prompt": prompt, "completion": completion}
    if fmt == "alpaca":
        instruction, extra, output = _text(row, "instruction"), _text(row, "input", required=False), _text(row, "output")
        if not output.strip():
            raise RowError("'output' is empty: nothing to train on")
        if not (instruction.strip() or extra.strip()):
            raise RowError("'instruction' and 'input' are both empty")
        messages: list[dict[str, str]] = []
        system = row.get("system") or system_prompt
        if system:
            messages.append({"role": "system", "content": _valid_text(str(system), "'system'")})
        history = row.get("history") or []
        if not isinstance(history, list):
            raise RowError(f"'history' must be a list of [prompt, reply] pairs, got {type(history).__name__}")
        for j, pair in enumerate(history):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise RowError(f"'history' item {j + 1} must be a [prompt, reply] pair of texts")
            for x in pair:
                _valid_text(x, f"'history' item {j + 1}")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        user = f"{instruction}\n\n{extra}" if instruction.strip() and extra.strip() else (instruction or extra)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return {"messages": _check_turns(messages)}
    if fmt == "chat":
        if "messages" in row:
            turns, role_key, content_key, roles = row["messages"], "role", "content", {r: r for r in CHAT_ROLES}
        elif "conversations" in row:
            turns, role_key, content_key, roles = row["conversations"], "from", "value", SHAREGPT_ROLES
        else:
            raise RowError("missing 'messages' (or ShareGPT 'conversations')")
        if not isinstance(turns, list) or not turns:
            raise RowError("the conversation must be a non-empty list of turns")
        messages = []
        for i, t in enumerate(turns, start=1):
            if not isinstance(t, dict):
                raise RowError(f"turn {i} must be an object with '{role_key}' and '{content_key}'")
            role, content = t.get(role_key), t.get(content_key)
            if not isinstance(role, str) or role not in roles:
                raise RowError(f"turn {i}: unknown {role_key} {role!r} (expected one of {', '.join(sorted(roles))})")
            if not isinstance(content, str):
                raise RowError(f"turn {i}: '{content_key}' must be text")
            messages.append({"role": roles[role], "content": _valid_text(content, f"turn {i}: '{content_key}'")})
        system = row.get("system") or system_prompt
        tools = row.get("tools")
        if tools:
            tools_text = tools if isinstance(tools, str) else json.dumps(tools, ensure_ascii=False)
            system = (f"{system}\n\n" if system else "") + f"You can call these tools:\n{tools_text}"
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": _valid_text(str(system), "'system'")})
        return {"messages": _check_turns(messages)}
    raise RowError(f"unknown format {fmt!r}")

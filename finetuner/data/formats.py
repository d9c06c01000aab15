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
                (ShareGPT: from/value; optional ``system``, ``tools``; tool
                calls and results: :mod:`finetuner.data.tools`)
``text``        ``text``                                                      text
``completion``  ``prompt``, ``completion``                                    prompt/completion
==============  ============================================================  ==============

Other column names are mapped to *roles* with ``data.columns`` (role: column), e.g.
``{prompt: question, response: answer}``. The roles (:data:`finetuner.config.columns.ROLES`): ``prompt``, ``input``,
``response``, ``system`` (alpaca-style instruction data, rendered with the chat template;
``completion`` takes ``prompt`` and ``response`` only), ``messages`` (chat) and ``text``. Named
columns imply the format (messages: chat, text: text, otherwise alpaca) unless ``data.format``
names one. A role left out is read from the format's usual column (:data:`~finetuner.config.columns.FORMAT_COLUMNS`).

Without ``data.columns``, a file whose keys fit none of the formats above is still read when it
has one of the column pairs in :data:`COMMON_PAIRS` (in any case), question/answer for example:
the pair gives the prompt and the response, and an ``input`` or ``context`` column the input,
a ``system`` column the system prompt.

:class:`FileExamples` is the one place that turns a file's rows into examples: the trainer
(:func:`finetuner.data.pipeline.load_examples`) and the planner (:func:`finetuner.data.stats.profile_data`)
both read through it. A row that cannot be read becomes a :class:`RowError` naming the file and
row; the caller either stops with it or skips the row and counts it (``data.on_bad_row``).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetuner.data import scope
from finetuner.objectives.specs import first_for_kind, in_words, offered_for_kind
from finetuner.data.rows import (  # noqa: F401 - read from here by the pipeline, images, chat
    IGNORE_INDEX, IMAGE_PLACEHOLDER, PictureRefused, RawRow, RowError, attach_pictures, content_parts, picture_path,
    valid_text,
)
from finetuner.data import tools
from finetuner.config.columns import FORMAT_COLUMNS, REQUIRED_ROLES, ROLES, ROLES_LINE, check_columns
from finetuner.errors import UserError
from finetuner.fileio import exists
from finetuner.locate import check_hub, locate

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

#: ``(prompt column, response column, format)`` found without ``data.columns`` when a row fits no
#: format by its keys; names compare in any case, the first pair the row has wins.
COMMON_PAIRS = (
    ("instruction", "output", "alpaca"),
    ("prompt", "completion", "completion"),
    ("question", "answer", "alpaca"),
    ("instruction", "response", "alpaca"),
    ("query", "response", "alpaca"),
    ("prompt", "response", "alpaca"),
    ("input", "output", "alpaca"),
)
#: With a pair found for alpaca, the columns read as its optional roles (any case, first found).
COMMON_EXTRAS = {"input": ("input", "context"), "system": ("system",)}


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


#: Field separators a CSV file may use instead of commas (found by :func:`csv_delimiter`).
OTHER_DELIMITERS = ";\t|"


def csv_delimiter(text: str) -> str:
    """The field separator of a CSV file's ``text``: ``,`` unless its header is one column when split at
    commas and :class:`csv.Sniffer` finds ``;``, a tab or ``|`` that splits it (Excel in many locales
    writes ``;``)."""
    sample = "\n".join(text.split("\n", 50)[:50])
    header = next(csv.reader(io.StringIO(sample, newline="")), [])
    if len(header) != 1:
        return ","
    try:
        found = csv.Sniffer().sniff(sample, delimiters=OTHER_DELIMITERS).delimiter
    except csv.Error:
        return ","
    split = next(csv.reader(io.StringIO(sample, newline=""), delimiter=found), [])
    return found if len(split) > 1 else ","


def delimiter_note(path: str) -> str | None:
    """A note for a CSV file whose fields are not separated by commas: which separator was found."""
    p = Path(path)
    if p.suffix.lower() != ".csv" or not exists(p, "file"):
        return None
    try:
        with open(p, "rb") as f:
            head = f.read(65536).decode("utf-8-sig", errors="replace")
    except OSError:
        return None
    d = csv_delimiter(head)
    name = {"\t": "tabs", ";": "semicolons (;)", "|": "bars (|)"}.get(d)
    return f"{p.name}: fields separated by {name}, found in the file (read as such)" if name else None


def read_rows(path: str, split: str = "train", bad: list[RowError] | None = None) -> Iterator[RawRow]:
    """Yield the rows of a local file or hub data set; unreadable JSON lines go to ``bad``."""
    bad = bad if bad is not None else []
    p = locate(scope.data_file(path), "data.path")  # within the web UI's scope, when it has one
    if isinstance(p, str):
        yield from _hub_rows(p, split)
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
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=csv_delimiter(text))
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
    check_hub(name, "data.path", "dataset")
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
@dataclass
class Layout:
    """How a file's rows become examples: the format, and the columns named for its roles
    (``data.columns``, or found by :data:`COMMON_PAIRS`); other roles use :data:`FORMAT_COLUMNS`."""

    format: str
    columns: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """``alpaca`` or ``alpaca (prompt: question, response: answer)``."""
        if not self.columns:
            return self.format
        return f"{self.format} ({', '.join(f'{r}: {c}' for r, c in self.columns.items())})"

    def describe_quoted(self) -> str:
        """``'alpaca'``, or ``'question/answer', columns prompt: question, response: answer`` (for row errors): the
        layout as the plan's data line names it (:func:`format_label`: the file's own columns)."""
        named = f", columns {', '.join(f'{r}: {c}' for r, c in self.columns.items())}" if self.columns else ""
        label = format_label(self.format, self.columns)
        return f"'{label if label != FORMAT_LABELS.get(self.format) else self.format}'{named}"


def detect_layout(row: Any) -> Layout | None:
    """The layout a row is in, from its keys (the formats' own names, then :data:`COMMON_PAIRS`),
    or ``None`` if none fits."""
    if not isinstance(row, dict):
        return None
    keys = set(row)
    if "messages" in keys or "conversations" in keys:
        return Layout("chat")
    if "instruction" in keys and "output" in keys:
        return Layout("alpaca")
    if "prompt" in keys and "completion" in keys:
        return Layout("completion")
    if "text" in keys:
        return Layout("text")
    by_lower: dict[str, str] = {}
    for k in row:
        if isinstance(k, str):
            by_lower.setdefault(k.strip().lower(), k)
    for prompt, response, fmt in COMMON_PAIRS:
        if prompt in by_lower and response in by_lower:
            columns = {"prompt": by_lower[prompt], "response": by_lower[response]}
            if fmt == "alpaca":
                for role, names in COMMON_EXTRAS.items():
                    col = next((by_lower[n] for n in names if n in by_lower and by_lower[n] not in columns.values()), None)
                    if col is not None:
                        columns[role] = col
            return Layout(fmt, columns)
    return None


def preference_kind(row: Any) -> str | None:
    """``pairs`` for a row of preference pairs (``chosen`` and ``rejected``: LLaMA-Factory's ranking
    ShareGPT, TRL's preference format, columns), ``rated`` for a row of KTO's unpaired data (a
    boolean ``label`` with ``messages`` or ``prompt``/``completion``), else ``None``
    (:mod:`finetuner.data.preference` reads them)."""
    if not isinstance(row, dict):
        return None
    if "chosen" in row or "rejected" in row:
        return "pairs"
    if isinstance(row.get("label"), bool) and ("messages" in row or "completion" in row):
        return "rated"
    return None


def file_columns(path: str) -> list[str]:
    """The columns of a data file, as its first row names them (in the file's order), for choosing
    ``data.columns``; empty when the file has no row or its first row is not an object."""
    for raw in read_rows(path, "train", []):
        return [str(k) for k in raw.data] if isinstance(raw.data, dict) else []
    return []


#: The kind of data of supervised examples (prompt and response, chat, text): what a file holds that is neither
#: preference pairs nor rated responses (:func:`preference_kind`). A kind of data, not an objective: the objectives
#: that train on it say so in their descriptions (:attr:`~finetuner.objectives.specs.base.ObjectiveSpec.data_kind`).
SUPERVISED = "supervised"
#: The kinds of data a file is taken for (:func:`file_kind`); ``prompts`` is a file read for its prompts alone.
FILE_KINDS = (SUPERVISED, "pairs", "rated")


def file_kind(path: str) -> str:
    """What a data file holds, from its first row: :data:`SUPERVISED`, ``pairs`` or ``rated`` (see
    :func:`preference_kind`); a file with no readable row is :data:`SUPERVISED` (its reader then says what is wrong)."""
    for raw in read_rows(path, "train", []):
        return preference_kind(raw.data) or SUPERVISED
    return SUPERVISED


#: The names users know each layout by (``finetuner plan``'s data line, the web UI's Data tab):
#: the SFT formats, then the preference layouts (:mod:`finetuner.data.preference`).
FORMAT_LABELS = {
    "alpaca": "alpaca (instruction/output)", "chat": "chat (messages)", "completion": "prompt/completion",
    "text": "plain text", "sharegpt_ranking": "ShareGPT ranking", "trl": "TRL preference",
    "columns": "prompt/chosen/rejected", "kto_messages": "KTO messages", "kto_completion": "KTO prompt/completion",
    "prompts": "the prompt side of each row",
}


def format_label(fmt: str, columns: dict[str, str] | None = None) -> str:
    """The layout as users know it: the file's own prompt/response columns when they were found by
    name or named (``question/answer``, never "alpaca" for a Q/A file), else :data:`FORMAT_LABELS`."""
    cols = columns or {}
    if fmt in ("alpaca", "completion") and "prompt" in cols and "response" in cols:
        return f"{cols['prompt']}/{cols['response']}"
    return FORMAT_LABELS.get(fmt, fmt)


#: The objectives each kind of data fits, as the errors name them (the objectives' descriptions say which).
OBJECTIVES_OF_KIND = {kind: in_words(offered_for_kind(kind)) for kind in FILE_KINDS}
#: The objective a kind of data is trained with when none is asked for (``objective: auto`` in
#: ``finetuner plan`` and the web UI's Plan tab): the first whose description takes it.
AUTO_OBJECTIVE = {kind: first_for_kind(kind) for kind in FILE_KINDS}
#: What one row of each kind of data is called (``finetuner plan``'s data line, the profile's errors).
KIND_UNITS = {SUPERVISED: "examples", "pairs": "pairs", "rated": "rated responses", "prompts": "prompts"}
KIND_WORDS = {
    "pairs": "preference pairs (a chosen and a rejected response)",
    "rated": "rated responses (a response with a true/false label, KTO's unpaired data)",
    SUPERVISED: "supervised examples",
    "prompts": f"prompts (objective {first_for_kind('prompts')}: the prompt side of each row)",
}


class WrongObjective(UserError):
    """A data file whose rows are ``kind`` of data (``pairs``, ``rated``, :data:`SUPERVISED`) given where
    ``objective`` needs another kind; ``place`` is the file and row."""

    def __init__(self, message: str, *, hint: str | None, place: str, kind: str, objective: str,
                 settings: dict[str, str] | None = None):
        super().__init__(message, hint=hint, settings=settings)
        self.place, self.kind, self.objective = place, kind, objective


def wrong_objective(place: str, kind: str, objective: str, what: str = "") -> WrongObjective:
    """The error for a file whose rows are ``kind`` of data given to a recipe whose objective needs another."""
    return WrongObjective(
        f"{place}: this file holds {KIND_WORDS[kind]}{what}: it fits objective {OBJECTIVES_OF_KIND[kind]}, not '{objective}'.",
        settings={"objective": AUTO_OBJECTIVE[kind]}, hint=f"Or give data for '{objective}'.",
        place=place, kind=kind, objective=objective,
    )


def detect_format(row: Any) -> str | None:
    """The format a row is in, from its keys, or ``None`` if none fits (see :func:`detect_layout`)."""
    layout = detect_layout(row)
    return layout.format if layout else None


def _columns_text(row: Any) -> str:
    return ", ".join(map(str, row)) if isinstance(row, dict) else f"none: the row is a {type(row).__name__}"


def _column_settings(roles: list[str]) -> dict[str, str]:
    """The ``data.columns`` settings that name the columns of ``roles`` (shown as each command takes them)."""
    return {f"data.columns.{r}": "COLUMN" for r in roles}


def layout_for(raw: RawRow, fmt: str = "auto", columns: dict[str, str] | None = None) -> Layout:
    """How the rows of ``raw``'s file become examples, decided from its first row ``raw``.

    With neither ``fmt`` nor ``columns``: :func:`detect_layout`. Otherwise the format is ``fmt`` or
    the one ``columns`` implies; a role not named is read from the format's usual column and, when
    the file has none, from a common name (:data:`COMMON_PAIRS`). A :class:`UserError` names the
    file, the row, the column and the file's columns when a named column or a needed one is missing.
    """
    row = raw.data
    if not columns and fmt == "auto":
        kind = preference_kind(row)
        if kind is not None:
            raise wrong_objective(raw.place, kind, first_for_kind(SUPERVISED))
        found = detect_layout(row)
        if found is None:
            raise UserError(
                f"{raw.place}: cannot tell the data format from the columns ({_columns_text(row)}).",
                settings=_column_settings(["prompt", "response"]),
                hint=ROLES_LINE + " Found without settings: "
                "instruction/input/output, messages or conversations (chat), text, and the pairs "
                + ", ".join(f"{p}/{r}" for p, r, _ in COMMON_PAIRS[1:]) + " in any case.",
            )
        return found
    f = fmt if fmt != "auto" else check_columns(columns or {})
    named = dict(columns or {})
    if not isinstance(row, dict):
        return Layout(f, named)  # normalize() reports the row
    for role, col in named.items():
        if col not in row:
            raise UserError(
                f"{raw.place}: data.columns.{role} names the column '{col}', which the file does not have "
                f"(its columns: {_columns_text(row)}).",
                settings=_column_settings([role]), hint=f"Name the column that holds {ROLES[role]}.",
            )
    usual = FORMAT_COLUMNS[f]
    found = detect_layout(row)
    for role, col in (found.columns if found else {}).items():  # roles whose usual column is absent
        if role in usual and role not in named and usual[role] not in row and col not in named.values():
            named[role] = col
    missing = [
        r for r in REQUIRED_ROLES[f]
        if r not in named and not (usual[r] in row if f != "chat" else ("messages" in row or "conversations" in row))
    ]
    if missing:
        where = ", ".join(f"the {r} from '{usual[r]}'" + (" or 'conversations'" if r == "messages" else "") for r in missing)
        raise UserError(
            f"{raw.place}: no column for {' and '.join(missing)}: format '{f}' reads {where}, and the file's columns "
            f"are {_columns_text(row)}.",
            settings=_column_settings(missing), hint=ROLES_LINE
            + (f" Or set data.format: auto, which reads the file as {found.describe()}." if found and found.format != f else ""),
        )
    return Layout(f, named)


def _text(row: dict, key: str, *, required: bool = True) -> str:
    v = row.get(key)
    if v is None:
        if required:
            raise RowError(f"missing '{key}'")
        return ""
    if not isinstance(v, str):
        raise RowError(f"'{key}' must be text, got {type(v).__name__}")
    return valid_text(v, f"'{key}'")


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
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        raise RowError("no assistant reply to train on")
    return messages


def columns_for(fmt: str, columns: dict[str, str] | None = None) -> dict[str, str]:
    """Role -> column for ``fmt``: the named ``columns``, then the format's usual names for the other
    roles (a column already named for one role is not read again for another)."""
    cols = dict(columns or {})
    for role, name in FORMAT_COLUMNS[fmt].items():
        if role not in cols and name not in cols.values():
            cols[role] = name
    return cols


def _sharegpt_turns(turns: Any) -> bool:
    first = turns[0] if isinstance(turns, list) and turns else None
    return isinstance(first, dict) and ("from" in first or "value" in first) and "role" not in first


def normalize(row: Any, fmt: str, system_prompt: str | None = None, columns: dict[str, str] | None = None) -> dict[str, Any]:
    """Turn one raw row into ``{"messages": [...]}``, ``{"text": ...}`` or ``{"prompt", "completion"}``;
    ``columns`` (role -> column) names the row's keys for the format's roles (:func:`columns_for`)."""
    if fmt not in FORMAT_COLUMNS:
        raise RowError(f"unknown format {fmt!r}")
    if not isinstance(row, dict):
        raise RowError(f"expected an object with named fields, got {type(row).__name__}")
    c = columns_for(fmt, columns)
    if fmt == "text":
        text = _text(row, c["text"])
        if not text.strip():
            raise RowError(f"'{c['text']}' is empty")
        return {"text": text}
    if fmt == "completion":
        prompt, completion = _text(row, c["prompt"]), _text(row, c["response"])
        if not completion.strip():
            raise RowError(f"'{c['response']}' is empty")
        return {"prompt": prompt, "completion": completion}
    system = (row.get(c["system"]) if "system" in c else None) or system_prompt
    if fmt == "alpaca":
        instruction, output = _text(row, c["prompt"]), _text(row, c["response"])
        extra = _text(row, c["input"], required=False) if "input" in c else ""
        if not output.strip():
            raise RowError(f"'{c['response']}' is empty: nothing to train on")
        if not (instruction.strip() or extra.strip()):
            raise RowError(f"'{c['prompt']}' and '{c['input']}' are both empty" if "input" in c else f"'{c['prompt']}' is empty")
        messages: list[dict[str, str]] = []
        if system:
            messages.append({"role": "system", "content": valid_text(str(system), f"'{c.get('system', 'system')}'")})
        history = row.get("history") or []
        if not isinstance(history, list):
            raise RowError(f"'history' must be a list of [prompt, reply] pairs, got {type(history).__name__}")
        for j, pair in enumerate(history):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise RowError(f"'history' item {j + 1} must be a [prompt, reply] pair of texts")
            for x in pair:
                valid_text(x, f"'history' item {j + 1}")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        user = f"{instruction}\n\n{extra}" if instruction.strip() and extra.strip() else (instruction or extra)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return attach_pictures(_check_turns(messages), row, [])
    # chat
    openai = ("role", "content", {r: r for r in CHAT_ROLES})
    sharegpt = ("from", "value", SHAREGPT_ROLES)
    if columns and "messages" in columns:
        if c["messages"] not in row:
            raise RowError(f"missing '{c['messages']}'")
        turns = row[c["messages"]]
        role_key, content_key, roles = sharegpt if _sharegpt_turns(turns) else openai
    elif "messages" in row:
        turns, (role_key, content_key, roles) = row["messages"], openai
    elif "conversations" in row:
        turns, (role_key, content_key, roles) = row["conversations"], sharegpt
    else:
        raise RowError("missing 'messages' (or ShareGPT 'conversations')")
    if not isinstance(turns, list) or not turns:
        raise RowError("the conversation must be a non-empty list of turns")
    messages, pictures = [], []
    schemas = tools.read_tools(row.get("tools"))  # OpenAI's list, or LLaMA-Factory's JSON string
    names = tools.tool_names(schemas)
    for i, t in enumerate(turns, start=1):
        if not isinstance(t, dict):
            raise RowError(f"turn {i} must be an object with '{role_key}' and '{content_key}'")
        role, content = t.get(role_key), t.get(content_key)
        if not isinstance(role, str) or role not in roles:
            raise RowError(f"turn {i}: unknown {role_key} {role!r} (expected one of {', '.join(sorted(roles))})")
        if isinstance(content, list):  # OpenAI-style parts: text and pictures
            content, found = content_parts(content, f"turn {i}")
            pictures += found
        if content is None and t.get("tool_calls"):  # OpenAI's call message: "content": null
            content = ""
        if not isinstance(content, str):
            raise RowError(f"turn {i}: '{content_key}' must be text")
        messages.append({"role": roles[role], "content": valid_text(content, f"turn {i}: '{content_key}'")})
        messages[-1].update(tools.turn_extras(role, t, messages[-1]["content"], names, f"turn {i}"))
        reasoning = t.get("reasoning_content")  # a thinking template renders it (finetuner.data.thinking)
        if roles[role] == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            messages[-1]["reasoning_content"] = valid_text(reasoning, f"turn {i}: 'reasoning_content'")
    tools.link_results(messages)
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": valid_text(str(system), "'system'")})
    out = attach_pictures(_check_turns(messages), row, pictures)
    return {**out, "tools": schemas} if schemas else out


# --------------------------------------------------------------------------- examples of a file
class FileExamples:
    """The examples of one data file, as the trainer and the planner both read them.

    Iterating reads the rows (:func:`read_rows`), decides the :class:`Layout` from the first row
    (:func:`layout_for`: a :class:`UserError` if it cannot) and yields each row normalised
    (:func:`normalize`) with ``_where`` naming its place. A row that cannot be used is not yielded:
    it is added to :attr:`bad` as a :class:`RowError` naming its file and line or row, and the caller
    stops on it or skips it (``data.on_bad_row``). :attr:`rows` counts the rows read (lines that are
    not valid JSON are not rows: they are only in :attr:`bad`).
    """

    def __init__(self, path: str, fmt: str = "auto", columns: dict[str, str] | None = None,
                 system_prompt: str | None = None, split: str = "train"):
        self.path, self.fmt, self.columns, self.system_prompt, self.split = path, fmt, columns, system_prompt, split
        self.layout: Layout | None = None
        self.rows = 0
        self.bad: list[RowError] = []
        #: the pictures of the examples yielded so far
        self.pictures = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for raw in read_rows(self.path, self.split, self.bad):
            self.rows += 1
            if self.layout is None:
                self.layout = layout_for(raw, self.fmt, self.columns)
            try:
                ex = normalize(raw.data, self.layout.format, self.system_prompt, self.layout.columns)
            except RowError as e:
                self.bad.append(RowError(f"{raw.place}: {e} (format {self.layout.describe_quoted()})."))
                continue
            if ex.get("images"):
                try:
                    ex["images"] = [picture_path(self.path, p) for p in ex["images"]]
                except RowError as e:
                    self.bad.append(type(e)(f"{raw.place}: {e}."))  # a PictureRefused stays one
                    continue
            ex["_where"] = raw.place
            self.pictures += len(ex.get("images") or [])
            yield ex


def refused_picture(data) -> PictureRefused | None:
    """The first picture outside the current scope (:mod:`finetuner.data.scope`) that a recipe's data section
    (``data.path``, ``data.val_path``; local files, each row read as training reads it) names, with its row; None
    when there is none. What the web UI checks before it starts or resumes a run: the run itself refuses them too
    (it inherits the scope), but only once it has started."""
    named = [*(data.path if isinstance(data.path, list) else [data.path]), data.val_path]
    for path in (str(p) for p in named if p):
        local = scope.data_file(path)
        if not exists(local, "file"):
            continue  # a hub data set, or a file missing: training says so
        src = FileExamples(local, data.format, data.columns, data.system_prompt, data.split)
        try:
            for _ex in src:
                pass
        except UserError:
            pass  # not rows of examples (preference data, prompts: no pictures), or unreadable: training says so
        refused = next((b for b in src.bad if isinstance(b, PictureRefused)), None)
        if refused is not None:
            return refused
    return None

"""Bad input as a user meets it: property-based (hypothesis) fuzzing of recipes, data files, the
CLI's arguments and the web UI's endpoints.

Whatever the input, finetuner either works or says what is wrong: a
:class:`~finetuner.errors.UserError` (CLI: exit status 2, no traceback; UI: a readable message)
that names the file and the place (row/line, or the recipe's dotted key). The user's files are
never changed and nothing is written next to them. Deterministic (``derandomize=True``).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, currently_in_test_context, example, given, settings
from hypothesis import event as _event
from hypothesis import strategies as st

from finetuner.data.pipeline import IGNORE_INDEX, prepare_data
from finetuner.data.formats import CHAT_ROLES, SHAREGPT_ROLES
from finetuner.errors import UserError
from finetuner.config.recipe import Recipe
from finetuner.config.sections import DataSection
from tests.conftest import alpaca_rows, cli_in_process, run_cli, ui_client, write_recipe, HANG_GUARD_S


def fuzz(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# --------------------------------------------------------------------------- text of every kind
SPECIAL = [
    "", " ", "\t\n ", "\u3000\u2003", "\x00", "nul\x00in the middle", "\u202eevil RTL override", "שלום עולם",
    "مرحبا بالعالم", "👩‍👩‍👧‍👦🏳️‍🌈", "e\u0301\u0308\u20dd", "\ufeffBOM", "line\u2028separator", "next\x85line",
    "para\u2029graph", "cr\ronly", "crlf\r\n", "\\", '"quoted, with comma"', "{{ jinja }}", "{% raw %}",
    "<|im_start|>user", "<|im_end|>", "\U0010fffd private", "\x1c\x1d\x1e", "tern " * 400,
]
ANY_CHAR = st.characters(codec="utf-8")  # every category but surrogates (they cannot be encoded as UTF-8)
WITH_SURROGATES = st.characters(exclude_categories=())  # JSON can carry them as \ud800 escapes


def texts(chars=ANY_CHAR, max_size: int = 30):
    piece = st.one_of(st.text(chars, max_size=max_size), st.sampled_from(SPECIAL))
    return st.one_of(piece, st.lists(piece, min_size=2, max_size=4).map("".join))


NONBLANK = texts().map(lambda s: s if s.strip() else s + "·")
JUNK_VALUES = st.one_of(
    st.integers(), st.floats(), st.booleans(), st.lists(st.integers(), min_size=1, max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), min_size=1, max_size=2),
)


def event(text: str) -> None:
    """Count an outcome in hypothesis' statistics (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        _event(text)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def untouched(*files: Path):
    """The files' bytes and their folders' listings are the same afterwards."""
    before = {f: sha(f) for f in files}
    listings = {f.parent: sorted(os.listdir(f.parent)) for f in files}
    yield
    for f, h in before.items():
        assert sha(f) == h, f"{f} was modified"
    for d, names in listings.items():
        assert sorted(os.listdir(d)) == names, f"files were created in {d}"


#: Messages about a whole file (no row or line to name).
FILE_LEVEL = (
    "no usable rows", "expected a JSON array", "unsupported file type", "not a readable Parquet file",
    "any token to train on", "is a folder", "nested too deeply",
)


def assert_names_file_and_place(msg: str, path: Path) -> None:
    assert str(path) in msg, f"the message does not name the file {path}:\n{msg}"
    assert re.search(r"\b(line|row) \d+", msg) or any(s in msg for s in FILE_LEVEL), f"no place in:\n{msg}"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tok_no_template(tiny_model_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    t.chat_template = None
    return t


def fresh_dir(tmp_path: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=tmp_path))


# =========================================================================== data files
def _chat(system, pairs, trailing_user, sharegpt=False):
    role, content = ("from", "value") if sharegpt else ("role", "content")
    names = {"system": "system", "user": "human", "assistant": "gpt"} if sharegpt else {r: r for r in CHAT_ROLES}
    turns = [{role: names["system"], content: system}] if system is not None else []
    for q, a in pairs:
        turns += [{role: names["user"], content: q}, {role: names["assistant"], content: a}]
    if trailing_user is not None:
        turns.append({role: names["user"], content: trailing_user})
    return {"conversations" if sharegpt else "messages": turns}


def good_rows(fmt: str):
    if fmt == "alpaca":
        return st.fixed_dictionaries(
            {"instruction": NONBLANK, "output": NONBLANK},
            optional={"input": texts(), "system": NONBLANK, "history": st.lists(st.lists(NONBLANK, min_size=2, max_size=2), max_size=2)},
        )
    if fmt in ("chat", "sharegpt"):
        return st.builds(_chat, st.none() | NONBLANK, st.lists(st.tuples(NONBLANK, NONBLANK), min_size=1, max_size=3),
                         st.none() | NONBLANK, st.just(fmt == "sharegpt"))
    if fmt == "text":
        return st.fixed_dictionaries({"text": NONBLANK})
    return st.fixed_dictionaries({"prompt": texts(), "completion": NONBLANK})


BLANK = st.sampled_from(["", " ", "\n\t", "\u3000", "\u2003\u2028"])
SURROGATE = st.sampled_from(["\ud800", "a\udfffb", "\udc80 lone low"])


@st.composite
def bad_row(draw, fmt: str, row: dict) -> object:
    """``row`` made definitely unusable, in a way a user's file might be."""
    row = json.loads(json.dumps(row))
    kinds = ["not_object", "surrogate"]
    kinds += {
        "alpaca": ["drop_output", "wrong_type", "blank_output", "blank_prompt", "bad_history"],
        "text": ["drop_text", "wrong_type", "blank_text"],
        "completion": ["drop_completion", "wrong_type", "blank_completion"],
    }.get(fmt, ["same_role_twice", "unknown_role", "content_not_text", "system_not_first", "no_assistant",
                "turns_not_a_list", "turn_not_object"])
    kind = draw(st.sampled_from(kinds))
    if kind == "not_object":
        return draw(st.one_of(texts(), JUNK_VALUES, st.none(), st.lists(texts(), max_size=2)))
    if fmt == "alpaca":
        if kind == "drop_output":
            del row["output"]
        elif kind == "wrong_type":
            row[draw(st.sampled_from(["instruction", "output"]))] = draw(JUNK_VALUES)
        elif kind == "blank_output":
            row["output"] = draw(BLANK)
        elif kind == "blank_prompt":
            row["instruction"], row["input"] = draw(BLANK), draw(BLANK)
        elif kind == "bad_history":
            row["history"] = draw(st.sampled_from([5, 1.5, True, "abc", {"a": 1}, [["a"]], [[1, 2]], [["a", "b", "c"]], [None]]))
        else:
            row["output"] += draw(SURROGATE)
        return row
    if fmt in ("text", "completion"):
        key = "text" if fmt == "text" else "completion"
        if kind.startswith("drop"):
            del row[key]
        elif kind == "wrong_type":
            row[draw(st.sampled_from(["text"] if fmt == "text" else ["prompt", "completion"]))] = draw(JUNK_VALUES)
        elif kind.startswith("blank"):
            row[key] = draw(BLANK)
        else:
            row[key] = draw(SURROGATE) + row[key]
        return row
    sharegpt = "conversations" in row
    key, role, content = ("conversations", "from", "value") if sharegpt else ("messages", "role", "content")
    user, assistant = ("human", "gpt") if sharegpt else ("user", "assistant")
    turns = row[key]
    first = 1 if turns[0][role] == "system" else 0  # turns[first] is a user turn, turns[first + 1] its reply
    if kind == "same_role_twice":
        r = draw(st.sampled_from([user, assistant]))
        turns.insert(first + 1, {role: r, content: "again"})
        turns.insert(first + 1, {role: r, content: "twice"})
    elif kind == "unknown_role":
        known = SHAREGPT_ROLES if sharegpt else CHAT_ROLES
        turns[draw(st.integers(first, len(turns) - 1))][role] = draw(
            st.one_of(texts().filter(lambda s: s not in known), JUNK_VALUES, st.none(), st.lists(st.just("user"), min_size=1, max_size=1))
        )
    elif kind == "content_not_text":
        turns[draw(st.integers(0, len(turns) - 1))][content] = draw(st.one_of(JUNK_VALUES, st.none()))
    elif kind == "system_not_first":
        turns.insert(first + 1, {role: "system", content: "late"})
    elif kind == "no_assistant":
        row[key] = [{role: user, content: "only a question"}]
    elif kind == "turns_not_a_list":
        row[key] = draw(st.one_of(texts(), JUNK_VALUES.filter(lambda v: not isinstance(v, list)), st.just([])))
    elif kind == "turn_not_object":
        turns[draw(st.integers(0, len(turns) - 1))] = draw(st.one_of(texts(), JUNK_VALUES))
    else:
        turns[first + 1][content] = "reply " + draw(SURROGATE)
    return row


@st.composite
def data_case(draw):
    fmt = draw(st.sampled_from(["alpaca", "chat", "sharegpt", "text", "completion"]))
    rows = draw(st.lists(good_rows(fmt), min_size=1, max_size=5))
    problem = draw(st.sampled_from(["none", "bad_row", "bad_row", "broken_line"]))
    at = draw(st.integers(0, len(rows)))  # 0-based index of the problem row or line
    bad = draw(bad_row("chat" if fmt == "sharegpt" else fmt, rows[min(at, len(rows) - 1)])) if problem == "bad_row" else None
    container = draw(st.sampled_from([".jsonl", ".json", "jsonl-in-.json"] if problem != "broken_line" else [".jsonl", "jsonl-in-.json"]))
    return dict(fmt=fmt, rows=rows, problem=problem, at=at, bad=bad, container=container,
                ensure_ascii=draw(st.booleans()), crlf=draw(st.booleans()), wrapped=draw(st.booleans()),
                on_bad_row=draw(st.sampled_from(["error", "skip"])), max_seq_len=draw(st.sampled_from([16, 64, 512])))


def _dump(obj, ensure_ascii: bool) -> str:
    text = json.dumps(obj, ensure_ascii=ensure_ascii)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate is written as its \\u escape, as json.dumps(ensure_ascii) does
        text = json.dumps(obj)
    return text


def write_data_case(d: Path, case: dict) -> tuple[Path, str | None]:
    """The file, and the place its problem row/line must be reported at (None: no problem)."""
    rows = list(case["rows"])
    broken = '{"instruction": "cut off here'
    if case["problem"] == "bad_row":
        rows.insert(case["at"], case["bad"])
    if case["container"] == ".json":
        path = d / "data.json"
        body = _dump({"data": rows} if case["wrapped"] else rows, case["ensure_ascii"])
        place = f"row {case['at'] + 1}"
    else:
        path = d / ("data.jsonl" if case["container"] == ".jsonl" else "data.json")
        lines = [_dump(r, case["ensure_ascii"]) for r in rows]
        if case["problem"] == "broken_line":
            lines.insert(case["at"], broken)
        body = ("\r\n" if case["crlf"] else "\n").join(lines) + "\n"
        place = f"line {case['at'] + 1}"
    path.write_bytes(body.encode("utf-8"))
    return path, (place if case["problem"] != "none" else None)


def check_prepared(data, max_seq_len: int) -> None:
    assert len(data.train) > 0
    for ids, labels in zip(data.train["input_ids"], data.train["labels"]):
        assert len(ids) == len(labels) and 0 < len(ids) <= max_seq_len
        assert any(t != IGNORE_INDEX for t in labels)


@fuzz(200)
@given(case=data_case())
def test_data_rows_fail_with_file_and_place(tmp_path, tok, case):
    """JSON / JSONL rows of every format, with one bad row or one broken line (or none)."""
    path, place = write_data_case(fresh_dir(tmp_path), case)
    cfg = DataSection(path=str(path), on_bad_row=case["on_bad_row"], max_seq_len=case["max_seq_len"], cache=False)
    with untouched(path):
        try:
            data = prepare_data(cfg, tok, seed=0)
        except UserError as e:
            msg = str(e)
            assert_names_file_and_place(msg, path)
            # a broken first line of JSON Lines in a .json file reads as one broken JSON document (a
            # bad row there is valid JSON: the file reads as JSON Lines and the row is skipped or named)
            first_of_json = case["container"] == "jsonl-in-.json" and case["at"] == 0 and case["problem"] == "broken_line"
            if place is not None and (case["on_bad_row"] == "error" or "cannot tell the data format" in msg or first_of_json):
                assert f"{path}, {place}" in msg or f"{path}: {place}" in msg, f"expected {place}:\n{msg}"
            elif place is None or case["on_bad_row"] == "skip":
                # the file is fine but nothing is left to train on (all cut by max_seq_len)
                assert "any token to train on" in msg or "no usable rows" in msg, msg
            return
    assert place is None or case["on_bad_row"] == "skip", f"the bad row at {place} was not reported"
    check_prepared(data, case["max_seq_len"])
    if place is not None:
        assert data.stats.skipped == 1 and f"{path}, {place}:" in data.stats.skipped_reasons[0], data.stats.skipped_reasons


@st.composite
def flat_case(draw):
    fmt = draw(st.sampled_from(["alpaca", "text", "completion"]))
    rows = draw(st.lists(good_rows(fmt), min_size=1, max_size=5))
    rows = [{k: v for k, v in r.items() if isinstance(v, str)} for r in rows]  # CSV and Parquet cells: text
    at = draw(st.none() | st.integers(0, len(rows) - 1))
    key = {"alpaca": "output", "text": "text", "completion": "completion"}[fmt]
    if at is not None:
        rows[at] = dict(rows[at], **{key: draw(BLANK)})
    return fmt, rows, at, draw(st.sampled_from([".csv", ".parquet"]))


@fuzz(80)
@given(case=flat_case())
def test_csv_and_parquet_rows(tmp_path, tok, case):
    """CSV (quoting, line breaks of every kind inside cells) and Parquet; a blank reply names its line/row."""
    fmt, rows, at, suffix = case
    path = fresh_dir(tmp_path) / f"data{suffix}"
    place = None
    if suffix == ".csv":
        fields = list(dict.fromkeys(k for r in rows for k in r))
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=fields)
        w.writeheader()
        for i, r in enumerate(rows):
            w.writerow(r)
            if i == at:  # csv counts physical lines (\n, \r, \r\n) up to the end of the record
                place = f"line {len(io.StringIO(buf.getvalue(), newline='').readlines())}"
        path.write_bytes(buf.getvalue().encode("utf-8"))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        place = None if at is None else f"row {at + 1}"
    with untouched(path):
        try:
            data = prepare_data(DataSection(path=str(path), max_seq_len=512, cache=False), tok, seed=0)
        except UserError as e:
            assert_names_file_and_place(str(e), path)
            if place is not None:
                assert f"{path}, {place}:" in str(e), f"expected {place}:\n{e}"
            return
    assert place is None, f"the blank reply at {place} was not reported"
    assert data.stats.rows == len(rows)
    if suffix == ".csv" and fmt != "alpaca":  # cells come back exactly as written (no row split at \x85 or \u2028)
        from finetuner.data.formats import read_rows

        assert [r.data for r in read_rows(str(path))] == [{k: r.get(k, "") for k in r} for r in rows]
    check_prepared(data, 512)


ENCODINGS = ["latin-1", "utf-16", "utf-16-le", "utf-8-sig", "cp1252"]


@st.composite
def junk_file(draw):
    suffix = draw(st.sampled_from([".json", ".jsonl", ".csv", ".parquet", ".txt", ""]))
    kind = draw(st.sampled_from(["bytes", "encoded", "empty", "json_fragment"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=200))
    elif kind == "encoded":
        text = draw(st.sampled_from([
            '{"instruction": "Café ümlaut", "output": "naïve"}\n',
            '[{"text": "ÀÉÎ õ ß"}]',
            "prompt,completion\nqué,sí\n",
        ]) | texts(max_size=20))
        body = text.encode(draw(st.sampled_from(ENCODINGS)), errors="replace")
    elif kind == "empty":
        body = draw(st.sampled_from([b"", b"\n", b"\xef\xbb\xbf", b"[]", b"{}", b"null", b'""', b"\n\n\n"]))
    else:
        frag = draw(st.recursive(st.none() | st.booleans() | st.floats() | texts(WITH_SURROGATES, max_size=5),
                                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
                                     ["text", "messages", "instruction", "output", "prompt", "completion", "x"]), c, max_size=3),
                                 max_leaves=8))
        body = json.dumps(frag).encode("utf-8")
    return suffix, body, draw(st.sampled_from(["error", "skip"]))


def records_in(path: Path, text: str) -> int:
    """How many records (rows, or lines of JSON Lines) the file holds, read without finetuner."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows
    if suffix == ".csv":
        return len(list(csv.DictReader(io.StringIO(text, newline=""))))
    lines = [line for line in text.split("\n") if line.strip()]
    if suffix == ".jsonl":
        return len(lines)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # JSON Lines saved as .json
        return len(lines)
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        return len(next(iter(data.values())))  # {"data": [rows]}
    return len(data) if isinstance(data, list) else 1


@fuzz(200)
@given(case=junk_file())
@example(case=(".jsonl", '{"instruction": "Café ümlaut", "output": "naïve"}\n'.encode("latin-1"), "skip"))
@example(case=(".json", '[{"text": "ÀÉÎ õ ß"}]'.encode("cp1252"), "error"))
@example(case=(".jsonl", b'{"text": "a"}\n\x00junk\n{"text": "b"}\n', "skip"))
@example(case=(".jsonl", b'{"text": "a"}\n\x00junk\n{"text": "b"}\n', "error"))
@example(case=(".json", b'[{"text": "a"}, 5, {"x": 1}, {"text": "b"}]', "skip"))
@example(case=(".csv", b"text\r\na\r\nb,c\r\n", "skip"))
def test_junk_data_files(tmp_path, tok, case):
    """Binary junk, other encodings, empty files, JSON of the wrong shape: a UserError naming the file
    (and the row or line), or, with ``data.on_bad_row: skip``, every unusable row said to be skipped
    with its place. A file is read only when it is UTF-8 text, and then every record in it is
    accounted for: trained on, held out, counted as cut to nothing, or reported as skipped."""
    suffix, body, on_bad_row = case
    path = fresh_dir(tmp_path) / f"junk{suffix}"
    path.write_bytes(body)
    with untouched(path):
        try:
            data = prepare_data(DataSection(path=str(path), max_seq_len=64, on_bad_row=on_bad_row, cache=False), tok, seed=0)
        except UserError as e:
            assert_names_file_and_place(str(e), path)
            event("junk: refused")
            return
    event(f"junk: read ({on_bad_row})")
    assert suffix in (".json", ".jsonl", ".csv", ".parquet"), f"a {suffix or 'suffix-less'} file was read as data"
    text = ""
    if suffix != ".parquet":
        try:
            text = body.decode("utf-8-sig")
        except UnicodeDecodeError:
            pytest.fail(f"bytes that are not UTF-8 were read as data: {body!r}")
    s = data.stats
    check_prepared(data, 64)
    assert len(s.skipped_reasons) == s.skipped, s.skipped_reasons
    if on_bad_row == "error":
        assert s.skipped == 0, s.skipped_reasons
    for reason in s.skipped_reasons:  # each skipped row is named with its place
        assert re.match(rf"{re.escape(str(path))}, (line|row) \d+: ", reason), reason
    assert s.train_examples + s.val_examples + s.dropped_empty + s.skipped == records_in(path, text), (body, s)


@pytest.mark.parametrize(
    "name, body, expect",
    [
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("deep.jsonl", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "line 1"),
        ("empty.jsonl", b"", "no usable rows"),
        ("empty.json", b"", "line 1"),
        ("empty.csv", b"", "no usable rows"),
        ("header_only.csv", b"instruction,output\r\n", "no usable rows"),
        ("empty.parquet", b"", "not a readable Parquet file"),
        ("utf16.jsonl", '{"text": "hello"}\n'.encode("utf-16"), "line 1: not UTF-8"),
        ("latin1.json", '[{"text": "ok"},\n {"text": "café"}]'.encode("latin-1"), "line 2: not UTF-8"),
        ("nul.jsonl", b'{"text": "a"}\n\x00\x00\x00\n', "line 2: invalid JSON"),
        ("middle.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": \n{"text": "d"}\n', "line 3: invalid JSON"),
        ("u2028.jsonl", '{"text": "raw\u2028separator and\x85NEL are valid JSON"}\n'.encode(), None),
        ("surrogate.json", b'[{"text": "ok"}, {"text": "lone \\ud800 half"}]', "row 2: 'text' contains"),
        ("pair.json", b'[{"text": "emoji \\ud83d\\ude00 as an escaped pair"}]', None),
        ("history.json", json.dumps([{"instruction": "q", "output": "a", "history": 5}]).encode(), "row 1: 'history'"),
        ("role.jsonl", json.dumps({"messages": [{"role": ["user"], "content": "a"}]}).encode(), "line 1: turn 1: unknown role"),
        ("blank_lines.csv", b"text\r\n\r\n", "no usable rows"),
        ("one_row.json", json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}).encode(), None),
        ("cells.csv", 'prompt,completion\r\nsplit\u2028here,and\x85here\r\n'.encode(), None),
    ],
)
def test_edge_files(tmp_path, tok, name, body, expect):
    path = tmp_path / name
    path.write_bytes(body)
    with untouched(path):
        if expect is None:
            check_prepared(prepare_data(DataSection(path=str(path), max_seq_len=64, cache=False), tok, seed=0), 64)
            return
        with pytest.raises(UserError) as e:
            prepare_data(DataSection(path=str(path), max_seq_len=64, cache=False), tok, seed=0)
    assert str(path) in str(e.value) and expect in str(e.value), str(e.value)


def test_missing_chat_template_uses_the_fallback(tmp_path, tok_no_template):
    """A tokenizer without a chat template: the built-in fallback renders chat and alpaca rows."""
    from finetuner.data.pipeline import FALLBACK_CHAT_TEMPLATE

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [
        _chat("Be brief. 👋", [("hi there", "hello hiker"), ("مرحبا", "שלום")], None),
        _chat(None, [("what to pack", "water and a map")], "trailing question"),
    ]), encoding="utf-8")
    with untouched(path):
        data = prepare_data(DataSection(path=str(path), max_seq_len=256, cache=False), tok_no_template, seed=0)
    assert data.chat_template == FALLBACK_CHAT_TEMPLATE
    check_prepared(data, 256)
    trained = tok_no_template.decode([t for t, l in zip(data.train["input_ids"][0], data.train["labels"][0]) if l != IGNORE_INDEX])
    assert "hello hiker" in trained and "hi there" not in trained


def test_a_held_out_part_that_leaves_nothing_to_train_on_is_refused(tmp_path, tok):
    """data.val_size holding out every row is one line naming the key, for examples, pairs and prompts alike
    (finetuner.data.split.held_out_checked)."""
    from finetuner.data.preference import prepare_preference_data
    from finetuner.data.prompts import prepare_prompts

    sft, pairs, prompts = tmp_path / "sft.json", tmp_path / "pairs.jsonl", tmp_path / "prompts.jsonl"
    sft.write_text(json.dumps(alpaca_rows(4)), encoding="utf-8")
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) + "\n" for i in range(4)),
                     encoding="utf-8")
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(4)), encoding="utf-8")
    calls = [(lambda c: prepare_data(c, tok, seed=0), sft, "examples"),
             (lambda c: prepare_preference_data(c, "dpo", tok, seed=0), pairs, "examples"),
             (lambda c: prepare_prompts(c, tok, seed=0, max_new_tokens=8), prompts, "prompts")]
    for prepare, path, unit in calls:
        with pytest.raises(UserError) as e:
            prepare(DataSection(path=str(path), val_size=4, cache=False))
        assert str(e.value).startswith(f"data.val_size: 4.0 leaves no training {unit} (4 {unit} in all)."), str(e.value)
        assert prepare(DataSection(path=str(path), val_size=3, cache=False)).val is not None


def test_examples_longer_than_max_seq_len_are_cut_and_counted(tmp_path, tok):
    path = tmp_path / "long.json"
    rows = alpaca_rows(4) + [{"instruction": "a long one", "output": "tern " * 500}]
    path.write_text(json.dumps(rows), encoding="utf-8")
    with untouched(path):
        data = prepare_data(DataSection(path=str(path), max_seq_len=32, cache=False), tok, seed=0)
    assert data.stats.truncated >= 1
    check_prepared(data, 32)
    # a prompt longer than max_seq_len leaves nothing to train on: the file is named
    path2 = tmp_path / "long_prompt.json"
    path2.write_text(json.dumps([{"instruction": "tern " * 500, "output": "ok"}]), encoding="utf-8")
    with untouched(path2), pytest.raises(UserError, match="any token to train on") as e:
        prepare_data(DataSection(path=str(path2), max_seq_len=16, cache=False), tok, seed=0)
    assert str(path2) in str(e.value)


# =========================================================================== recipes
SECTIONS = {
    "model": ["name", "revision", "dtype", "trust_remote_code", "allow_pickle", "attn_implementation", "max_memory"],
    "lora": ["r", "alpha", "dropout", "target_modules", "bias"],
    "quantization": ["bits", "quant_type", "double_quant", "compute_dtype"],
    "data": ["path", "format", "split", "max_seq_len", "train_on_prompt", "packing", "val_size", "val_path",
             "on_bad_row", "chat_template", "system_prompt", "max_examples", "num_proc", "cache"],
    "training": ["epochs", "max_steps", "lr", "scheduler", "warmup_steps", "warmup_ratio", "micro_batch_size",
                 "gradient_accumulation", "effective_batch", "optimizer", "weight_decay", "max_grad_norm",
                 "gradient_checkpointing", "offload_activations", "loss_chunk_size", "precision", "kernels",
                 "compile", "seed", "eval_every"],
    "checkpointing": ["save_every", "keep_last"],
    "logging": ["every", "report_to", "tensorboard"],
    "samples": ["prompts", "max_new_tokens"],
    "distributed": ["strategy", "num_processes", "offload", "fsdp_offload", "cpu_adam", "nodes", "node_rank", "master_addr",
                    "master_port"],
}
TOP = ["name", "method", "output_dir", "device"]
KEYS = [f"{s}.{k}" for s, ks in SECTIONS.items() for k in ks] + TOP
#: Keys that checks across fields report (a value elsewhere can make them wrong), each with the keys
#: whose values the check reads (finetuner/config/recipe.py: Recipe._check, _check_distributed).
CROSS_FIELD = {
    "training.effective_batch": ("training.effective_batch", "training.micro_batch_size", "training.gradient_accumulation"),
    "quantization": ("quantization", "method"),
    "training.warmup_steps": ("training.warmup_steps", "training.warmup_ratio"),
    "training.optimizer": ("training.optimizer", "distributed.strategy", "distributed.offload"),
    "distributed.node_rank": ("distributed.node_rank", "distributed.nodes"),
    "distributed.offload": ("distributed.offload", "distributed.strategy"),
    "distributed.strategy": ("distributed.strategy", "method"),
    "distributed.fsdp_offload": ("distributed.fsdp_offload", "distributed.strategy"),
    "quantization.bits": ("quantization.bits", "quantization", "method", "distributed.strategy"),
    "model.max_memory": ("model.max_memory", "distributed.num_processes", "distributed.nodes"),
}
YAML_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), texts(max_size=12), texts(WITH_SURROGATES, max_size=12),
    st.sampled_from(["auto", "lora", "qlora", "full", "bf16", "cpu", "cuda", "zero3", "4", "1e-4", "~", "yes", "0x10"]),
    st.lists(st.integers() | texts(max_size=5), max_size=3), st.dictionaries(texts(max_size=5), st.integers() | texts(max_size=5), max_size=2),
)


def base_recipe(tiny_model_dir: Path, data: Path) -> dict:
    return {
        "name": "fuzz",
        "model": {"name": str(tiny_model_dir)},
        "method": "lora",
        "data": {"path": data.name, "max_seq_len": 64},  # relative to the recipe's folder
        "training": {"max_steps": 2, "micro_batch_size": 1, "gradient_accumulation": 2},
    }


@st.composite
def recipe_mutation(draw):
    """(kind, key, value): ``key`` is a dotted key path (``(section, name)`` for an unknown key)."""
    kind = draw(st.sampled_from(["set", "set", "delete", "unknown", "section"]))
    if kind in ("set", "delete"):
        return kind, draw(st.sampled_from(KEYS)), draw(YAML_VALUES)
    if kind == "unknown":
        section = draw(st.sampled_from([None, *SECTIONS]))
        name = draw(st.one_of(texts(max_size=10), st.sampled_from(["lr", "rank", "modle", "epoch", "learning_rate"])))
        return kind, (section, name), draw(YAML_VALUES)
    return kind, draw(st.sampled_from(list(SECTIONS))), draw(YAML_VALUES.filter(lambda v: not isinstance(v, dict)))


def _apply(raw: dict, kind: str, key, value) -> str:
    """Apply a mutation to a raw recipe; returns the dotted key path it changed, as messages write
    it (a blank name quoted: ``samples.' '``)."""
    if kind == "unknown":
        section, name = key
        (raw if section is None else raw.setdefault(section, {}))[name] = value
        shown = name if name.strip() else repr(name)
        return shown if section is None else f"{section}.{shown}"
    node, leaf = raw, key
    if "." in key:
        section, leaf = key.split(".", 1)
        node = raw.setdefault(section, {})
    if kind == "delete":
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return key


def names_key(msg: str, key: str) -> bool:
    """``msg`` (the recipe's path taken out: it can hold any short key) has a line about ``key``: the
    whole dotted key path (or a key inside it) begins the line, ``  - training.lr: ...`` or
    ``<recipe>: data.path: ...``. A check across fields may report its own key instead, when
    ``key`` is one of the keys it reads."""
    def begins_a_line(k: str) -> bool:
        return re.search(rf"^(  - |<recipe>: ){re.escape(k)}[.:]", msg, re.M) is not None

    def related(a: str, b: str) -> bool:  # the same key, or one inside the other (a section and its keys)
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    return begins_a_line(key) or any(begins_a_line(k) and any(related(key, d) for d in reads) for k, reads in CROSS_FIELD.items())


@fuzz(300)
@given(mutation=recipe_mutation(), allow_unicode=st.booleans())
@example(mutation=("unknown", (None, ""), None), allow_unicode=True)
@example(mutation=("unknown", (None, "rank"), 8), allow_unicode=True)
@example(mutation=("unknown", ("samples", " "), 1), allow_unicode=True)
@example(mutation=("set", "quantization.bits", 4), allow_unicode=True)
def test_recipe_mutations_name_the_key(tmp_path, tiny_model_dir, mutation, allow_unicode):
    """Wrong types, missing keys, unknown keys, whole sections replaced: the error names file and key."""
    kind, key, value = mutation
    d = fresh_dir(tmp_path)
    data = d / "data.json"
    data.write_text(json.dumps(alpaca_rows(4)), encoding="utf-8")
    raw = base_recipe(tiny_model_dir, data)
    key = _apply(raw, kind, key, value)
    path = d / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=allow_unicode), encoding="utf-8")
    with untouched(path, data):
        try:
            r = Recipe.from_yaml(path)
        except UserError as e:
            msg = str(e)
            assert msg.startswith(f"{path}: "), msg
            assert names_key(msg.replace(str(path), "<recipe>"), key), f"{kind} {key}={value!r}: the key is not named:\n{msg}"
            return
    assert isinstance(r, Recipe)
    if not key.startswith("data.path"):  # a data.path that is not a local file is taken as a hub id
        assert r.data.path == str(data.resolve())


@fuzz(150)
@given(body=st.one_of(
    st.binary(max_size=120),
    texts(max_size=60).map(lambda s: s.encode("utf-8")),
    st.tuples(texts(max_size=30), st.sampled_from(ENCODINGS)).map(lambda t: ("model: {name: " + t[0] + "}").encode(t[1], errors="replace")),
    st.sampled_from([b"", b"\n", b"---\n", b"- a\n- b\n", b"42", b"model: [\n", b"model:\n  name: x\n bad: indent\n",
                     b"a: *undefined_alias\n", b"!!python/object:os.system {}\n", b"{? [a, b]: c}\n",
                     b"a: " + b"[" * 5000 + b"]" * 5000, b"\xff\xfem\x00o\x00d\x00", b"\x00\x01\x02"]),
))
def test_recipe_files_of_junk(tmp_path, body):
    """Binary junk, other encodings, YAML that is not a recipe, YAML bombs: a UserError naming the file."""
    path = fresh_dir(tmp_path) / "recipe.yaml"
    path.write_bytes(body)
    with untouched(path), pytest.raises(UserError) as e:
        Recipe.from_yaml(path)
    assert str(path) in str(e.value), str(e.value)


@fuzz(150)
@given(item=st.one_of(
    texts(max_size=30),
    st.tuples(st.sampled_from(KEYS + ["", ".", "..", "training..lr", "model.name.x", " data . path"]), texts(max_size=15)).map("=".join),
    st.tuples(st.sampled_from(KEYS), YAML_VALUES).map(lambda t: f"{t[0]}={json.dumps(t[1], allow_nan=True)}"),
))
def test_set_overrides(tmp_path, tiny_model_dir, item):
    """``--set key=value`` with anything in it: the override or the key it sets is named."""
    d = fresh_dir(tmp_path)
    data = d / "data.json"
    data.write_text(json.dumps(alpaca_rows(4)), encoding="utf-8")
    path = write_recipe(d / "recipe.yaml", base_recipe(tiny_model_dir, data))
    with untouched(path, data):
        try:
            Recipe.from_yaml(path, [item])
        except UserError as e:
            msg = str(e)
            # the key path as apply_override splits it, and the sections on the way
            parts = [k if k.strip() else repr(k) for k in item.partition("=")[0].strip().split(".") if k]
            sections = [".".join(parts[:i]) for i in range(1, len(parts))]
            body = msg.replace(str(path), "<recipe>")
            named = (f"--set {item!r}" in msg or (parts and names_key(body, ".".join(parts)))
                     or any(re.search(rf"^  - {re.escape(k)}: ", body, re.M) for k in sections))
            assert named, f"{item!r}:\n{msg}"


def test_paths_with_an_unknown_user_home(tmp_path, tiny_model_dir):
    """``~nosuchuser/...`` cannot be expanded: a missing file, not a RuntimeError."""
    with pytest.raises(UserError, match="not found"):
        Recipe.from_yaml("~nosuchuser_ft/recipe.yaml")
    raw = base_recipe(tiny_model_dir, tmp_path / "x.json")
    raw["data"]["path"] = "~nosuchuser_ft/data.jsonl"
    with pytest.raises(UserError, match="data.path: '~nosuchuser_ft/data.jsonl' does not exist"):
        Recipe.from_dict(raw, base_dir=tmp_path)


# =========================================================================== the CLI, in-process
DANGEROUS = {"run", "chat", "merge", "export", "eval", "ui"}
CARDS = ["rtx4090", "a100-80gb", "24GB", "0GB", "-8GB", "1e400GB", "nan", "inf", "cpu", "auto", "", "rtx 4090", "GEFORCE_RTX_3060"]
MODELS = ["llama-2-7b", "Llama-2-13B", "mistral-7b", "org/name", "a/b/c", "./nope", "~nosuchuser_ft/m", "", ".", "..", "/"]
NUMS = st.one_of(st.integers(1, 4096).map(str), st.integers(-10, 10**6).map(str),
                 st.sampled_from(["0", "-1", "1e3", "nan", "inf", "", "12abc", "２０４８"]), texts(max_size=6))
FRACTIONS = st.one_of(st.floats(-1, 2).map(str), st.sampled_from(["0", "0.05", "0.99", "1", "nan", "-inf", "x"]))


@st.composite
def plan_argv(draw):
    methods = st.sampled_from(["auto", "lora", "qlora", "qlora4", "qlora8", "full", "any", "LoRA", "qlora16"])
    if draw(st.booleans()):  # values argparse takes, so that the planner itself sees odd combinations
        model = draw(st.sampled_from(["llama-2-7b", "Llama-2-13B", "mistral-7b", "{tiny}"]))
        gpu = draw(st.sampled_from(["rtx4090", "24GB", "a100-80gb", "t4", "0.5GB", "100000GB"]))
        nums, fractions = st.integers(1, 100_000).map(str), st.floats(0, 0.999).map(str)
    else:
        model = draw(st.one_of(st.sampled_from(MODELS), texts(max_size=15)))
        gpu = draw(st.one_of(st.sampled_from(CARDS), texts(max_size=10)))
        nums, fractions, methods = NUMS, FRACTIONS, methods | texts(max_size=8)
    argv = ["plan", "--model", model, "--gpu", gpu]
    gpus = st.integers(1, 16).map(str) if nums is not NUMS else NUMS
    for flag, values in (("--seq-len", nums), ("--effective-batch", nums), ("--gpus", gpus), ("--margin", fractions),
                         ("--method", methods)):
        if draw(st.booleans()):
            argv += [flag, draw(values)]
    if draw(st.booleans()):
        argv += ["--name", draw(st.sampled_from(["my-run", "a b", "../x", ""]) | texts(max_size=8))]
    if draw(st.booleans()):
        argv.append("--json")
    return argv


GOOD_OVERRIDES = [
    "training.lr=1e-4", "data.max_seq_len=4096", "training.micro_batch_size=auto", "training.gradient_accumulation=auto",
    "method=qlora", "method=full", "method=auto", "distributed.num_processes=2", "distributed.strategy=zero3",
    "training.gradient_checkpointing=true", "training.optimizer=auto", "model.name=llama-2-13b", "lora.r=1024",
]


@st.composite
def other_argv(draw):
    kind = draw(st.sampled_from(["estimate", "estimate", "gpus", "random"]))
    if kind == "estimate" and draw(st.booleans()):  # the recipe, a card and overrides that are all valid
        argv = ["estimate", "{recipe}", "--gpu", draw(st.sampled_from(["auto", "rtx4090", "24GB", "t4", "a100-80gb"]))]
        for item in draw(st.lists(st.sampled_from(GOOD_OVERRIDES), max_size=3)):
            argv += ["--set", item]
        return argv + draw(st.sampled_from([[], ["--json"]]))
    if kind == "estimate":
        argv = ["estimate", draw(st.one_of(st.just("{recipe}"), st.sampled_from(["/nonexistent/r.yaml", ".", "", "~nosuchuser_ft/r.yaml", "-"]),
                                           texts(max_size=20)))]
        argv += ["--gpu", draw(st.sampled_from(CARDS) | texts(max_size=8))]
        if draw(st.booleans()):
            argv += ["--set", draw(st.tuples(st.sampled_from(KEYS), texts(max_size=8)).map("=".join) | texts(max_size=15))]
        if draw(st.booleans()):
            argv.append("--json")
        return argv
    if kind == "gpus":
        return ["gpus", "--no-detect"] + draw(st.lists(st.sampled_from(["--json", "--bogus", "extra"]), max_size=2))
    head = draw(st.sampled_from(["plan", "estimate", "gpus", "--version", "--help", "nosuchcommand", "--bogus", "-x"]) | texts(max_size=8))
    return [head] + draw(st.lists(st.sampled_from(["--model", "--gpu", "-h", "--json", "--set", "=", "--"]) | texts(max_size=8), max_size=4))


def _call_main(argv: list[str], capsys) -> tuple[int, str, str]:
    from finetuner.cli.main import main

    capsys.readouterr()
    try:
        rc = main(argv)
        assert isinstance(rc, int)
    except SystemExit as e:  # argparse: usage errors (2), --help / --version (0)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, f"{argv!r}:\n{err}"
    event(f"{argv[0] if argv[0] in ('plan', 'estimate', 'gpus') else 'other'}: exit {rc}")
    return rc, out, err


@fuzz(150)
@given(argv=plan_argv().filter(lambda a: not DANGEROUS & set(a)))
@example(argv=["plan", "--model", "~nosuchuser_ft/m", "--gpu", "rtx4090"])
@example(argv=["plan", "--model", "m" * 5000, "--gpu", "rtx4090"])
@example(argv=["plan", "--model", "{tiny}/config.json", "--gpu", "rtx4090", "--data", "d" * 5000 + ".jsonl"])
@example(argv=["plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--margin", "nan"])
@example(argv=["plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--margin", "1.5"])
@example(argv=["plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--margin", "-1"])
@example(argv=["plan", "--model", "llama-2-7b", "--gpu", "1e400GB"])
@example(argv=["plan", "--model", "llama-2-7b", "--gpu", "0.0001GB", "--seq-len", "1000000", "--effective-batch", "3", "--gpus", "2"])
@example(argv=["plan", "--model", "{tiny}", "--gpu", "cpu", "--method", "qlora16"])
def test_cli_plan_arguments(capsys, tiny_model_dir, argv):
    argv = [a.replace("{tiny}", str(tiny_model_dir)) for a in argv]
    rc, out, err = _call_main(argv, capsys)
    assert rc in (0, 1, 2), (argv, rc, err)
    if rc == 2:
        assert err.strip(), f"{argv!r}: exit 2 without a message"
    if rc == 0:
        assert "--json" in argv and json.loads(out)["fits"] or "Plan:" in out, (argv, out)


@fuzz(150)
@given(argv=other_argv().filter(lambda a: not DANGEROUS & set(a)))
@example(argv=["estimate", "~nosuchuser_ft/r.yaml"])
@example(argv=["estimate", "r" * 5000 + ".yaml"])
@example(argv=["estimate", "{recipe}", "--gpu", "0GB"])
@example(argv=["estimate", "{recipe}", "--gpu", "rtx4090", "--set", "training.micro_batch_size=auto", "--json"])
@example(argv=["estimate", "{recipe}", "--set", "model.name.x=1"])
def test_cli_other_arguments(tmp_path, capsys, tiny_model_dir, argv):
    d = tmp_path / "estimate"
    if not d.exists():
        d.mkdir()
        (d / "data.json").write_text(json.dumps(alpaca_rows(4)), encoding="utf-8")
        write_recipe(d / "recipe.yaml", base_recipe(tiny_model_dir, d / "data.json"))
    recipe = d / "recipe.yaml"
    argv = [a.replace("{recipe}", str(recipe)) for a in argv]
    with untouched(recipe, d / "data.json"):
        rc, out, err = _call_main(argv, capsys)
    if rc == 0:
        assert out.strip() or not argv[0].startswith("-") or argv[0] in ("--version", "--help", "-h"), argv
    elif rc == 1:  # estimate: does not fit, said on stdout
        assert argv[0] == "estimate" and "--json" in argv and not json.loads(out)["fits"] or "Does not fit" in out, (argv, out, err)
    else:
        assert err.strip(), f"{argv!r}: exit {rc} without a message"
        if rc == 2 and argv[0] == "estimate" and "usage:" not in err and argv[1] != str(recipe):
            assert argv[1].strip() in err or "not found" in err, err


@pytest.mark.parametrize("argv", [
    ["merge", "/nonexistent/run", "-o", "{tmp}/merged"],
    ["merge", "{tmp}/file.txt", "-o", "{tmp}/merged"],
    ["chat", "/nonexistent/run", "--prompt", "hi"],
    ["chat", "./nope/nope", "--compare", "--no-adapter"],
    ["chat", "~nosuchuser_ft/run", "--prompt", "hi"],
    ["merge", "r" * 5000, "-o", "{tmp}/merged"],
    ["eval", "/nonexistent/run", "--data", "/nonexistent/d.jsonl"],
    ["eval", "{tmp}/file.txt"],
])
def test_cli_after_training_commands_fail_fast(tmp_path, capsys, monkeypatch, argv):
    """merge / chat / eval on paths that do not exist: exit 2 before loading a tokenizer or model, nothing written."""
    import finetuner.infer.chat
    import finetuner.infer.evaluate
    import finetuner.export.merge

    def never(*_a, **_k):
        raise AssertionError("a model or tokenizer was loaded for a path that does not exist")

    for module in (finetuner.infer.chat, finetuner.infer.evaluate, finetuner.export.merge):
        for name in ("load_model", "load_tokenizer"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, never)
    (tmp_path / "file.txt").write_text("not a run")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc, _out, err = _call_main(argv, capsys)
    assert rc == 2 and "error: " in err and "Traceback" not in err, err
    assert not (tmp_path / "merged").exists()


# =========================================================================== the CLI, as a user runs it
def _cli_case(tmp_path: Path, tiny_model_dir: Path, case: str) -> tuple[Path, Path, list[str], list[str]]:
    user = tmp_path / "user"
    user.mkdir()
    data = user / "data.jsonl"
    rows = [json.dumps({"instruction": f"q {i} ¿ü? 👋", "output": "Tern here."}, ensure_ascii=False) for i in range(6)]
    recipe = base_recipe(tiny_model_dir, data)
    recipe["output_dir"] = str(tmp_path / "runs" / "r")
    recipe["logging"] = {"tensorboard": False}
    expect: list[str] = []
    sets: list[str] = []
    if case == "misspelt_set":  # names from other tools and wrong values, given with --set
        sets = ["method=qlroa", "training.micro_batch_size=[4]", "training.learning_rate=1e-4", "lora.rank=8",
                "data.cutoff_len=512"]
        expect = ["  - method: invalid value 'qlroa'. Did you mean 'qlora'? Valid choices: lora, qlora, full, auto.\n",
                  "  - training.micro_batch_size: must be a whole number ≥ 1 (or auto); got [4].\n",
                  "  - training.learning_rate: unknown key. Did you mean 'lr'?",
                  "  - lora.rank: unknown key. Did you mean 'r'?",
                  "  - data.cutoff_len: unknown key. Did you mean 'max_seq_len'?"]
    elif case == "not_a_model":  # a folder of downloads, not a model
        folder = user / "downloads"
        folder.mkdir()
        (folder / "README.md").write_text("weights come later")
        recipe["model"]["name"] = str(folder)
        expect = [f"model.name: {folder}: no config.json in this folder, so it is not a model folder (it holds: README.md).",
                  "save_pretrained"]
    elif case == "no_tokenizer":  # config.json and weights, but no tokenizer files
        folder = user / "model"
        folder.mkdir()
        for f in tiny_model_dir.iterdir():
            if f.name in ("config.json", "model.safetensors"):
                (folder / f.name).write_bytes(f.read_bytes())
        recipe["model"]["name"] = str(folder)
        expect = [f"model.name: {folder} has a config.json but no tokenizer files"]
    elif case == "recipe":
        recipe["training"]["lr"] = "fast"
        recipe["lora"] = {"rr": 8}
        expect = ["{recipe}: the recipe is not valid", "training.lr", "lora.rr", "Did you mean 'r'?"]
    elif case == "broken_line":
        rows.insert(2, '{"instruction": "q", "output": ')
        expect = [f"{data}, line 3: invalid JSON"]
    elif case == "bad_row":
        rows.insert(4, json.dumps({"instruction": "q", "output": "", "history": 5}))
        expect = [f"{data}, line 5:"]
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    path = write_recipe(user / "recipe.yaml", recipe)
    if case == "junk":
        path.write_bytes(b"model: x\n\xff\xfe\x00garbage")
        expect = [f"{path}: line 2: not a UTF-8 text file", "byte 9"]
    return path, data, [e.replace("{recipe}", str(path)) for e in expect], sets


#: what a user must not have to read: library internals instead of what is wrong
LEAKS = ("Traceback", "constrained-int", "literal[", "sentencepiece", "Input should be")


@pytest.mark.parametrize("case", ["recipe", "junk", "broken_line", "bad_row", "misspelt_set", "not_a_model", "no_tokenizer"])
def test_cli_run_on_bad_input(tmp_path, tiny_model_dir, case):
    recipe, data, expect, sets = _cli_case(tmp_path, tiny_model_dir, case)
    with untouched(recipe, data):
        p = cli_in_process("run", str(recipe), *[a for s in sets for a in ("--set", s)], timeout=HANG_GUARD_S)
    assert p.returncode == 2, p.stderr
    assert not [w for w in LEAKS if w in p.stderr + p.stdout], p.stderr
    assert p.stderr.startswith("error: ")
    for e in expect:
        assert e in p.stderr, f"{e!r} not in:\n{p.stderr}"
    assert not (tmp_path / "runs" / "r" / "adapter").exists()


def test_plan_and_run_say_the_same_of_a_folder_that_is_not_a_model(tmp_path, tiny_model_dir):
    recipe, _data, _expect, _sets = _cli_case(tmp_path, tiny_model_dir, "not_a_model")
    folder = tmp_path / "user" / "downloads"
    plan = run_cli("plan", "--model", str(folder), "--gpu", "24GB")
    run = cli_in_process("run", str(recipe), timeout=HANG_GUARD_S)
    assert plan.returncode == run.returncode == 2
    said = f"{folder}: no config.json in this folder"
    assert said in plan.stderr and said in run.stderr, (plan.stderr, run.stderr)


# =========================================================================== the web UI
@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    with ui_client(tmp_path_factory.mktemp("ui_fuzz")) as c:
        yield c


def _ui_call(client, *args, api_name: str):
    """The endpoint's outputs, or its error message; an error must read as a finetuner message."""
    from gradio_client.exceptions import AppError

    try:
        out = client.predict(*args, api_name=api_name)
        event(f"{api_name}: ok")
        return out, None
    except AppError as e:
        msg = str(e.message)
        event(f"{api_name}: message")
        assert e.title != "Unexpected error", f"{api_name}{args!r}: {msg}"
        assert "Traceback" not in msg and not re.match(r"^\w+(Error|Exception)\b", msg), f"{api_name}{args!r}: {msg}"
        assert msg.strip()
        return None, msg


def _ui_alive(client) -> None:
    summary, _preview, _hist, _pairs = client.predict("data/demo_model", "data/alpaca_sample.json", 256, api_name="/analyse_data")
    assert "alpaca" in summary


UI_TEXT = texts(max_size=20) | texts(WITH_SURROGATES, max_size=10)


@fuzz(40)
@given(data=st.data())
def test_ui_endpoints_with_anything_typed_in(ui, tmp_path, data):
    d = tmp_path / "uidata"
    if not d.exists():
        d.mkdir()
        (d / "ok.json").write_text(json.dumps(alpaca_rows(4)), encoding="utf-8")
    which = data.draw(st.sampled_from(["analyse_file", "analyse_model", "plan", "estimate"]))
    if which == "analyse_file":
        args = ("data/demo_model", data.draw(UI_TEXT | st.sampled_from([".", "data", "/", "../etc/passwd", str(d)])),
                data.draw(st.sampled_from([256, 0, -5, 10**9]) | st.floats(1, 5000)))
        out, err = _ui_call(ui, *args, api_name="/analyse_data")
    elif which == "analyse_model":
        args = (data.draw(UI_TEXT | st.sampled_from(MODELS)), str(d / "ok.json"), 64)
        out, err = _ui_call(ui, *args, api_name="/analyse_data")
        assert out is not None, err  # the data are fine: only the token preview may be missing
    elif which == "plan" and data.draw(st.booleans()):  # valid choices, odd numbers
        args = (data.draw(st.sampled_from(["data/demo_model", "llama-2-7b"])), data.draw(st.sampled_from(["cpu", "rtx4090", "8GB"])),
                data.draw(st.sampled_from(["", "data/alpaca_sample.json", "data/chat_sample.jsonl"])),
                data.draw(st.sampled_from([None, 0, 16, 512, 10**6])), data.draw(st.sampled_from([None, 1, 16, 1000])),
                data.draw(st.sampled_from(["auto", "lora", "qlora", "full"])))
        _ui_call(ui, *args, api_name="/plan")
    elif which == "plan":
        args = (data.draw(UI_TEXT | st.sampled_from(MODELS)), data.draw(UI_TEXT | st.sampled_from(CARDS)),
                data.draw(st.sampled_from(["", "data/alpaca_sample.json"]) | UI_TEXT), data.draw(st.sampled_from([None, 0, 256, -3])),
                data.draw(st.sampled_from([None, 16, 0, -1])), data.draw(st.sampled_from(["auto", "lora", "full"]) | UI_TEXT),
                data.draw(st.sampled_from(["auto", "sft", "dpo", "kto", "grpo"]) | UI_TEXT),
                data.draw(st.sampled_from(["", "length_bounds", "recipes/rewards_demo.py:mentions_whistle", "x.py:"]) | UI_TEXT),
                data.draw(st.sampled_from([None, 0, 4, -1])), data.draw(st.sampled_from([None, 0, 64, 10**9])))
        _ui_call(ui, *args, api_name="/plan")
    else:
        raw = base_recipe(Path("data/demo_model"), Path("data/alpaca_sample.json"))
        raw["data"]["path"] = "data/alpaca_sample.json"
        if data.draw(st.booleans()):
            _apply(raw, *data.draw(recipe_mutation()))
        text = data.draw(st.sampled_from([yaml.safe_dump(raw, allow_unicode=True)]) | UI_TEXT)
        _ui_call(ui, text, data.draw(st.sampled_from(["cpu", "rtx4090", "24GB"]) | UI_TEXT), api_name="/estimate")
    _ui_alive(ui)


@pytest.mark.parametrize("api_name, args", [
    ("/analyse_data", ("~nosuchuser_ft/model", "data/alpaca_sample.json", 64)),
    ("/analyse_data", ("data/demo_model", "~nosuchuser_ft/data.jsonl", 64)),
    ("/analyse_data", ("data/demo_model", "data/alpaca_sample.json", -5)),
    ("/analyse_data", ("data/demo_model", "data", 256)),
    ("/analyse_data", ("data/demo_model", "\x00", 256)),
    ("/analyse_data", ("m" * 5000, "d" * 5000 + ".jsonl", 256)),
    ("/analyse_data", ("m" * 5000, "data/alpaca_sample.json", 256)),
    ("/plan", ("data/demo_model", "cpu", "data/alpaca_sample.json", 1, 16, "auto", "auto")),
    ("/plan", ("~nosuchuser_ft/m", "rtx4090", "", None, None, "auto", "dpo")),
    ("/plan", ("llama-2-7b", "-24GB", "", 2048, 0, "lora", "auto")),
    ("/plan", ("data/demo_model", "cpu", "data/alpaca_sample.json", 256, 16, "auto", "kto")),
    ("/plan", ("data/demo_model", "cpu", "data/preference_sample.jsonl", 256, 16, "auto", "rlhf")),
    ("/estimate", ("model: {name: data/demo_model}\ndata: {path: data/alpaca_sample.json, max_seq_len: 8}", "cpu")),
    ("/estimate", ("model: {name: data/demo_model}\ndata: {path: data/alpaca_sample.json}\n" + "x: " + "[" * 3000 + "]" * 3000, "cpu")),
    ("/estimate", ("- just\n- a list", "cpu")),
])
def test_ui_known_bad_inputs(ui, api_name, args):
    _ui_call(ui, *args, api_name=api_name)
    _ui_alive(ui)

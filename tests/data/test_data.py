"""The data pipeline: every format, auto-detection, the loss mask, packing, and bad rows."""

from __future__ import annotations

import csv
import json

import pytest

from finetuner.data.pipeline import IGNORE_INDEX, Collator, encode_example, load_examples, pack, prepare_data
from finetuner.data.formats import detect_format
from finetuner.errors import UserError
from finetuner.config.sections import DataSection
from tests.conftest import alpaca_rows


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def cfg(path, **kw) -> DataSection:
    return DataSection(path=str(path), **kw)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


CHAT = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello hiker"},
    {"role": "user", "content": "what to pack"},
    {"role": "assistant", "content": "water and a map"},
]}
SHAREGPT = {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello hiker"}]}


@pytest.mark.parametrize(
    "row, fmt",
    [
        ({"instruction": "a", "input": "", "output": "b"}, "alpaca"),
        (CHAT, "chat"),
        (SHAREGPT, "chat"),
        ({"text": "x"}, "text"),
        ({"prompt": "p", "completion": "c"}, "completion"),
        ({"foo": 1}, None),
    ],
)
def test_detect_format(row, fmt):
    assert detect_format(row) == fmt


def trained_text(tok, enc) -> str:
    return tok.decode([t for t, l in zip(enc["input_ids"], enc["labels"]) if l != IGNORE_INDEX])


def test_loss_mask_covers_only_assistant_replies(tok):
    enc = encode_example(CHAT, tok, tok.chat_template, 512, train_on_prompt=False)
    assert trained_text(tok, enc) == "hello hiker<|im_end|>\nwater and a map<|im_end|>\n"
    assert enc["labels"][0] == IGNORE_INDEX
    full = encode_example(CHAT, tok, tok.chat_template, 512, train_on_prompt=True)
    assert full["labels"] == full["input_ids"]


def test_completion_and_text_masks(tok):
    enc = encode_example({"prompt": "the sea ", "completion": "is cold"}, tok, tok.chat_template, 512, False)
    assert trained_text(tok, enc).strip().startswith("is cold") and trained_text(tok, enc).endswith("<|im_end|>")
    assert "the sea" not in trained_text(tok, enc)
    enc = encode_example({"text": "a bird"}, tok, tok.chat_template, 512, False)
    assert enc["labels"] == enc["input_ids"] and enc["input_ids"][-1] == tok.eos_token_id


def test_truncation(tok):
    enc = encode_example(CHAT, tok, tok.chat_template, 10, False)
    assert len(enc["input_ids"]) == 10 and enc["truncated"]


def test_every_file_format_loads(tmp_path, tok):
    files = {
        "a.json": ("alpaca", lambda p: p.write_text(json.dumps(alpaca_rows(5)))),
        "c.jsonl": ("chat", lambda p: write_jsonl(p, [CHAT] * 5)),
        "s.jsonl": ("chat", lambda p: write_jsonl(p, [SHAREGPT] * 5)),
        "t.jsonl": ("text", lambda p: write_jsonl(p, [{"text": "a bird on a cliff"}] * 5)),
        "lines.json": ("text", lambda p: write_jsonl(p, [{"text": "jsonl saved as json"}] * 5)),
    }
    for name, (fmt, write) in files.items():
        p = tmp_path / name
        write(p)
        data = prepare_data(cfg(p), tok, seed=0)
        assert data.stats.format[str(p)] == fmt and len(data.train) == 5, name
    p = tmp_path / "c.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        w.writerows([["q, with comma", "a \"quoted\"\nline"]] * 4)
    assert prepare_data(cfg(p), tok, 0).stats.format[str(p)] == "completion"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "completion": "a"}] * 3), tmp_path / "c.parquet")
    assert len(prepare_data(cfg(tmp_path / "c.parquet"), tok, 0).train) == 3


def test_several_files_and_validation_split(tmp_path, tok):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(alpaca_rows(20)))
    c = write_jsonl(tmp_path / "c.jsonl", [CHAT] * 10)
    data = prepare_data(DataSection(path=[str(a), str(c)], val_size=0.2), tok, seed=0)
    assert (len(data.train), len(data.val)) == (24, 6)
    data = prepare_data(DataSection(path=str(a), val_size=5), tok, seed=0)
    assert (len(data.train), len(data.val)) == (15, 5)
    with pytest.raises(UserError, match="data.val_size"):
        prepare_data(DataSection(path=str(a), val_size=20), tok, seed=0)


def test_broken_jsonl_line_names_the_line(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(CHAT) + "\n" + '{"messages": [oops\n' + json.dumps(CHAT) + "\n")
    with pytest.raises(UserError, match=r"d.jsonl, line 2: invalid JSON"):
        prepare_data(cfg(p), tok, 0)
    data = prepare_data(cfg(p, on_bad_row="skip"), tok, 0)
    assert len(data.train) == 2 and data.stats.skipped == 1


@pytest.mark.parametrize(
    "row, message",
    [
        ({"instruction": "q", "input": "", "output": ""}, "row 2: 'output' is empty"),
        ({"instruction": "q", "input": "", "output": 5}, "row 2: 'output' must be text"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}, "row 2: messages 1 and 2 are both 'user'"),
        ({"messages": [{"role": "user", "content": "a"}]}, "row 2: no assistant reply"),
        ({"messages": [{"role": "wizard", "content": "a"}]}, "row 2: turn 1: unknown role 'wizard'"),
        ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": None}]}, "row 2: turn 2: 'value' must be text"),
        ("just a string", "row 2: expected an object"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, tok, row, message):
    good = {"messages": CHAT["messages"]} if isinstance(row, dict) and ("messages" in row or "conversations" in row) else alpaca_rows(1)[0]
    fmt = "chat" if good is not alpaca_rows(1)[0] and "messages" in good else "alpaca"
    p = tmp_path / "d.json"
    p.write_text(json.dumps([good, row, good]))
    with pytest.raises(UserError, match=message) as e:
        prepare_data(cfg(p, format=fmt if isinstance(row, str) else "auto"), tok, 0)
    assert str(p) in str(e.value)
    data = prepare_data(cfg(p, on_bad_row="skip", format=fmt if isinstance(row, str) else "auto"), tok, 0)
    assert data.stats.skipped == 1 and len(data.train) == 2


def test_unreadable_files(tmp_path, tok):
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n\xff\xfe\xfa\n')
    with pytest.raises(UserError, match=r"bin.jsonl: line 2: not UTF-8"):
        prepare_data(cfg(bad), tok, 0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="no usable rows"):
        prepare_data(cfg(empty), tok, 0)
    unknown = write_jsonl(tmp_path / "u.jsonl", [{"title": "q", "body": "a"}])
    with pytest.raises(UserError, match=r"u.jsonl, line 1: cannot tell the data format from the columns \(title, body\)") as e:
        prepare_data(cfg(unknown), tok, 0)
    assert "--set data.columns.prompt=COLUMN --set data.columns.response=COLUMN" in e.value.hint
    assert "columns: {prompt: COLUMN, response: COLUMN}" in e.value.hint
    other = tmp_path / "x.txt"
    other.write_text("hello")
    with pytest.raises(UserError, match="unsupported file type '.txt'"):
        prepare_data(cfg(other), tok, 0)


def test_format_override_that_does_not_fit(tmp_path, tok):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    with pytest.raises(UserError, match="line 1: no column for prompt and response: format 'alpaca' reads the prompt from "
                       "'instruction', the response from 'output', and the file's columns are text") as e:
        prepare_data(cfg(p, format="alpaca"), tok, 0)
    assert "--set data.columns.prompt=COLUMN --set data.columns.response=COLUMN" in e.value.hint
    assert "data.format: auto, which reads the file as text" in e.value.hint
    # a later row without the format's keys is a bad row, named with its line
    p = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "q", "output": "a"}, {"text": "hello"}])
    with pytest.raises(UserError, match="line 2: missing 'instruction' \\(format 'alpaca'\\)"):
        prepare_data(cfg(p, format="alpaca"), tok, 0)


def test_examples_cut_to_nothing_are_dropped(tmp_path, tok):
    long_prompt = {"instruction": " ".join(["bird"] * 400), "input": "", "output": "ok"}
    p = tmp_path / "d.json"
    p.write_text(json.dumps([long_prompt] + alpaca_rows(3)))
    data = prepare_data(cfg(p, max_seq_len=128), tok, 0)
    assert data.stats.dropped_empty == 1 and len(data.train) == 3


def test_packing_keeps_examples_apart(tmp_path, tok):
    p = tmp_path / "a.json"
    p.write_text(json.dumps(alpaca_rows(30)))
    plain = prepare_data(cfg(p, max_seq_len=256), tok, 0)
    packed = prepare_data(cfg(p, max_seq_len=256, packing=True), tok, 0)
    assert len(packed.train) < len(plain.train)
    total = sum(len(x) for x in plain.train["input_ids"])
    assert sum(len(x) for x in packed.train["input_ids"]) == total
    assert sum(plain.stats.trained_tokens for _ in [0]) == sum(sum(1 for t in r if t != IGNORE_INDEX) for r in packed.train["labels"])
    for row in packed.train:
        assert len(row["input_ids"]) <= 256
        starts = [i for i, pos in enumerate(row["position_ids"]) if pos == 0]
        assert starts[0] == 0
        for s in starts:  # the first token of an example is never a target of the previous one
            assert row["labels"][s] == IGNORE_INDEX
    assert max(list(r).count(0) for r in packed.train["position_ids"]) >= 2
    batch = Collator(tok.pad_token_id)([packed.train[0], packed.train[1]])
    assert "attention_mask" not in batch and batch["position_ids"].shape == batch["input_ids"].shape


def test_packed_attention_does_not_cross_examples(tiny_model_dir, tok):
    """Logits of an example are the same alone and packed behind another one."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval().double()  # float64: no reduction noise to allow for
    a = tok("the sea is cold")["input_ids"]
    b = tok("a tern on the cliff")["input_ids"]
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([b]), use_cache=False).logits[0]
        packed = model(input_ids=torch.tensor([a + b]), position_ids=torch.tensor([list(range(len(a))) + list(range(len(b)))]), use_cache=False).logits[0]
    assert torch.allclose(alone, packed[len(a):], rtol=1e-9, atol=1e-12)


def test_max_examples_and_system_prompt(tmp_path, tok):
    p = tmp_path / "a.json"
    p.write_text(json.dumps(alpaca_rows(10)))
    stats = __import__("finetuner.data.pipeline", fromlist=["DataStats"]).DataStats()
    ex = load_examples(str(p), cfg(p, max_examples=4, system_prompt="You are Tern."), stats)
    assert len(ex) == 4 and ex[0]["messages"][0] == {"role": "system", "content": "You are Tern."}


@pytest.mark.parametrize(
    "name, fmt, rows",
    [("alpaca_en_demo.json", "alpaca", 999), ("glaive_toolcall_en_demo.json", "chat", 300), ("c4_demo.jsonl", "text", 300)],
)
def test_peer_data_files_are_read_as_they_are(tok, peer_data, name, fmt, rows):
    path = peer_data / name
    stats = __import__("finetuner.data.pipeline", fromlist=["DataStats"]).DataStats()
    examples = load_examples(str(path), cfg(path), stats)
    assert stats.format[str(path)] == fmt and stats.rows == rows
    assert len(examples) + stats.skipped == rows
    data = prepare_data(cfg(path, max_seq_len=256, max_examples=50), tok, 0)
    assert len(data.train) > 0


@pytest.mark.parametrize(
    "name, fmt, rows",
    [
        ("alpaca_sample.json", "alpaca", 300),
        ("chat_sample.jsonl", "chat", 300),
        ("sharegpt_sample.jsonl", "chat", 100),
        ("text_sample.jsonl", "text", 200),
        ("completion_sample.csv", "completion", 200),
        ("completion_sample.parquet", "completion", 200),
    ],
)
def test_shipped_sample_data(tok, name, fmt, rows):
    from tests.conftest import REPO

    path = REPO / "data" / name
    data = prepare_data(cfg(path, max_seq_len=256), tok, 0)
    assert data.stats.format[str(path)] == fmt and data.stats.rows == rows and data.stats.skipped == 0

"""The planned sequence follows the data's lengths, not one outlier row (issue 55, item 4): the cap at the 99th
percentile, the rows it cuts, and what keeping them costs, as ``finetuner plan --data FILE`` says them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.data.stats import profile_data
from finetuner.planning.length_cap import CAP_PERCENTILE, OUTLIER_RATIO, round_up
from finetuner.planning.planner import plan
from finetuner.units import duration_text

from tests.conftest import cli_in_process

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_model"  # 1,024 positions


def _write(path: Path, long_words: int, rows: int = 200) -> Path:
    """``rows`` short question-and-answer rows and one whose answer is ``long_words`` words."""
    lines = [{"instruction": f"What colour is box {i}?", "output": f"Box {i} is {'red' if i % 2 else 'blue'}."}
             for i in range(rows)]
    lines.append({"instruction": "Tell me everything about the boxes.", "output": " ".join(["box"] * long_words)})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def _plan(*args: str) -> dict:
    r = cli_in_process("plan", "--model", str(DEMO), "--gpu", "cpu", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def outlier_file(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("cap") / "boxes.jsonl", long_words=300)


def test_one_long_row_among_short_ones_is_capped_at_the_99th_percentile_with_its_cost(outlier_file):
    prof = profile_data(str(outlier_file), str(DEMO))
    at, longest = prof.percentile(CAP_PERCENTILE), prof.max_tokens
    assert longest > OUTLIER_RATIO * at and longest < 1024  # the file is what the test says it is
    p = _plan("--data", str(outlier_file))
    seq, uncapped = round_up(at), round_up(longest)
    assert p["recipe"]["data"]["max_seq_len"] == seq < uncapped
    cap = p["data"]["length_cap"]
    assert (cap["seq"], cap["uncapped"], cap["cut"], cap["rows"]) == (seq, uncapped, 1, 201)
    text = "\n".join(p["reasons"])
    assert f"sequence {seq}: the 99th percentile of the examples' lengths ({at} tokens)" in text
    assert f"1 of 201 examples are longer and are truncated to {seq} tokens" in text
    # what keeping the long row costs is the plan the user gets at that length (`--seq-len`)
    kept, capped = (plan(str(DEMO), "cpu", data=str(outlier_file), seq_len=n) for n in (uncapped, None))
    assert kept.recipe.data.max_seq_len == uncapped and capped.seq_len == seq
    keeping = next(r for r in p["reasons"] if r.startswith("keeping the 1 longer examples whole"))
    assert f"--seq-len {uncapped}" in keeping
    assert f"peak {kept.peak_bytes / 2**30:.1f} GiB (this plan {capped.peak_bytes / 2**30:.1f})" in keeping
    assert f"the whole run ~{duration_text(kept.wall_s)} (this plan ~{duration_text(capped.wall_s)}" in keeping
    assert kept.wall_s > capped.wall_s
    # and the console says the same
    r = cli_in_process("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(outlier_file))
    assert r.returncode == 0 and "1 of 201 examples are longer and are truncated" in r.stdout, r.stdout + r.stderr


def test_no_outlier_and_a_small_file_keep_the_longest_row(tmp_path):
    # the longest within twice the 99th percentile: no cap
    even = _plan("--data", str(_write(tmp_path / "even.jsonl", long_words=8)))
    assert even["data"].get("length_cap") is None
    assert even["recipe"]["data"]["max_seq_len"] == round_up(even["data"]["max_tokens"])
    # under 100 rows the 99th percentile is the longest row: one row is more than 1 % of them
    small = _plan("--data", str(_write(tmp_path / "small.jsonl", long_words=300, rows=60)))
    assert small["data"].get("length_cap") is None
    assert small["recipe"]["data"]["max_seq_len"] == round_up(small["data"]["max_tokens"])
    # a sequence the user asks for is kept
    asked = _plan("--data", str(_write(tmp_path / "asked.jsonl", long_words=300)), "--seq-len", "512")
    assert asked["recipe"]["data"]["max_seq_len"] == 512 and asked["data"].get("length_cap") is None


def test_the_glaive_demo_file_is_capped_not_planned_at_8192(peer_data):
    glaive = peer_data / "glaive_toolcall_en_demo.json"
    r = cli_in_process("plan", "--model", "smollm2-135m-instruct", "--gpu", "cpu", "--data", str(glaive), "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    # the rows' tools in finetuner's fallback format (SmolLM2's template renders none: finetuner.data.tools)
    assert p["data"]["max_tokens"] == 11632
    assert p["recipe"]["data"]["max_seq_len"] == 1664  # its 99th percentile, 1,601 tokens, rounded up
    assert any("3 of 300 examples are longer and are truncated to 1664" in x for x in p["reasons"])
    assert any(x.startswith("keeping the 3 longer examples whole: --seq-len 8192") for x in p["reasons"])

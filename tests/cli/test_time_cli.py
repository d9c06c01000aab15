"""`finetuner estimate` and `finetuner plan` say the whole run's time by part and its cost in the given currency."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO, cli_in_process

DEMO = REPO / "recipes" / "demo_cpu.yaml"
PARTS = ("the whole run ~", "load ", "3 evaluations of 20 rows", "3 checkpoints", "4 sample answers")


def flat(text: str) -> str:
    """The output with rich's line breaks undone."""
    return re.sub(r"\s*\n\s*", " ", text)


def test_estimate_says_the_parts_and_the_cost_in_the_currency():
    out = cli_in_process("estimate", str(DEMO), "--gpu", "cpu", "--price-per-hour", "0.7", "--currency", "USD")
    assert out.returncode == 0, out.stderr
    text = flat(out.stdout)
    assert "150 optimizer steps: ~" in text and all(p in text for p in PARTS), text
    assert re.search(r"~[0-9.]+ USD at 0\.7 USD an hour", text), text
    plain = flat(cli_in_process("estimate", str(DEMO), "--gpu", "cpu", "--price-per-hour", "0.7").stdout)
    assert re.search(r"~[0-9.]+ at 0\.7 an hour", plain) and "USD" not in plain  # the price's own units
    d = json.loads(cli_in_process("estimate", str(DEMO), "--gpu", "cpu", "--json", "--price-per-hour", "0.7",
                                  "--currency", "EUR").stdout)["time"]
    assert d["currency"] == "EUR" and d["cost"] == d["wall_s"] / 3600 * 0.7
    assert set(d["wait"]["parts_s"]) == {"download", "load", "replay", "steps", "evaluations", "checkpoints", "probe",
                                         "tool_calls", "samples"}
    assert d["wait"]["parts_s"]["tool_calls"] == 0  # the demo data makes no tool calls
    assert d["steps_s"] == d["step_s"] * 150 and d["wall_s"] > d["steps_s"]


def test_plan_says_the_parts_and_the_cost_in_the_currency(tmp_path):
    out = cli_in_process("plan", "--model", str(REPO / "data" / "demo_model"), "--gpu", "cpu", "--data",
                         str(REPO / "data" / "alpaca_sample.json"), "--price-per-hour", "2", "--currency", "€", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = flat(out.stdout)
    assert "optimizer steps: ~" in text and "the whole run ~" in text and "checkpoints" in text, text
    assert re.search(r"~[0-9.]+ € at 2 € an hour", text), text


def test_a_plan_with_replay_says_the_replays_time_in_its_text_and_json(tmp_path):
    """A small file whose rows carry a system prompt: the plan sets data.replay, and its time says the base's
    answers to the replay prompts (how many, how long) in the text and as the JSON's ``replay`` part."""
    rows = [{"messages": [{"role": "system", "content": "You are the ferry desk."},
                          {"role": "user", "content": f"When does ferry {i} leave?"},
                          {"role": "assistant", "content": f"Ferry {i} leaves at {i % 12 + 1} pm."}]} for i in range(40)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    args = ("plan", "--model", str(REPO / "data" / "demo_model"), "--gpu", "cpu", "--data", str(data))
    d = json.loads(cli_in_process(*args, "--json", cwd=tmp_path).stdout)
    n = d["predicted_wait"]["counts"]["replay_answers"]
    assert d["recipe"]["data"]["replay"] == 0.25 and n == 9  # ceil(0.25 x 36 training rows)
    assert d["predicted_wait"]["counts"]["replay_tokens"] == 9 * 96 and d["predicted_wait"]["parts_s"]["replay"] > 0
    # the whole wait holds it: its sum of the 8 parts, each rounded to 1 ms, the whole to 10 ms
    assert d["predicted_wait"]["wall_s"] == pytest.approx(sum(d["predicted_wait"]["parts_s"].values()), abs=8 * 0.0005 + 0.005)
    text = flat(cli_in_process(*args, cwd=tmp_path).stdout)
    assert re.search(r"load [^,]+, replay: the base answers 9 prompts [0-9.]+ (s|min)", text), text
    assert "replay answers at their longest (96 tokens)" in text


def test_a_bad_currency_is_one_line():
    for args in (("--price-per-hour", "1", "--currency", "12"), ("--currency", "USD")):
        out = cli_in_process("estimate", str(DEMO), "--gpu", "cpu", *args)
        assert out.returncode != 0 and "--currency" in out.stderr, out.stderr

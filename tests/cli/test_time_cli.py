"""`finetuner estimate` and `finetuner plan` say the whole run's time by part and its cost in the given currency."""

from __future__ import annotations

import json
import re

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
    assert set(d["wait"]["parts_s"]) == {"download", "load", "replay", "steps", "evaluations", "checkpoints", "probe", "samples"}
    assert d["steps_s"] == d["step_s"] * 150 and d["wall_s"] > d["steps_s"]


def test_plan_says_the_parts_and_the_cost_in_the_currency(tmp_path):
    out = cli_in_process("plan", "--model", str(REPO / "data" / "demo_model"), "--gpu", "cpu", "--data",
                         str(REPO / "data" / "alpaca_sample.json"), "--price-per-hour", "2", "--currency", "€", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = flat(out.stdout)
    assert "optimizer steps: ~" in text and "the whole run ~" in text and "checkpoints" in text, text
    assert re.search(r"~[0-9.]+ € at 2 € an hour", text), text


def test_a_bad_currency_is_one_line():
    for args in (("--price-per-hour", "1", "--currency", "12"), ("--currency", "USD")):
        out = cli_in_process("estimate", str(DEMO), "--gpu", "cpu", *args)
        assert out.returncode != 0 and "--currency" in out.stderr, out.stderr

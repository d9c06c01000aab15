"""A run on tool-calling data scores its held-out calls at its end (finetuner.training.samples.held_out_tool_calls):
the base and the fine-tune asked each call of the rows its split held out, kept in metrics.json, said in the run's
summary and timed in its predicted wait; `finetuner eval RUN` finds the same held-out calls and scores them alike."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, cli_in_process, write_recipe
from tests.weather_calls import CITIES, weather_row

DEMO = REPO / "data" / "demo_model"


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool-run")
    data = tmp / "calls.jsonl"
    data.write_text("".join(json.dumps(weather_row(i, c)) + "\n" for i, c in enumerate(CITIES)), encoding="utf-8")
    recipe = {
        "name": "calls", "model": {"name": str(DEMO)}, "method": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 1024, "val_size": 3},
        "training": {"max_steps": 2, "lr": 1e-3, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0,
                     "eval_every": 2, "seed": 5, "general_probe": 0},
        "samples": {"prompts": []}, "logging": {"tensorboard": False}, "output_dir": str(tmp / "calls"), "device": "cpu",
    }
    out = cli_in_process("run", str(write_recipe(tmp / "calls.yaml", recipe)))
    assert out.returncode == 0, out.stderr
    return tmp / "calls", out


def test_the_run_scores_its_held_out_calls_base_and_fine_tune_and_times_them(tool_run):
    run, out = tool_run
    metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    scores = metrics["tool_calls"]
    assert scores["requests"] == 3  # the 3 held-out rows make one call each
    for who in ("base", "fine_tuned"):
        assert set(scores[who]) == {"right", "right_function", "valid_json"}
        assert all(round(v * 3, 9) in (0, 1, 2, 3) for v in scores[who].values())  # shares of 3 requests
    # timed: predicted at the start (3 requests asked twice), measured at the end
    events = [json.loads(line) for line in (run / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    start = next(e for e in events if e["event"] == "start")
    predicted = start["predicted_speed"]["wait"]
    assert predicted["counts"]["tool_calls_answers"] == 6 and predicted["parts_s"]["tool_calls"] > 0
    assert metrics["time"]["predicted"]["tool_calls"] == predicted["parts_s"]["tool_calls"]
    assert metrics["time"]["measured"]["tool_calls"] > 0
    assert [e for e in events if e["event"] == "phase" and e["phase"] == "tool_calls" and e["state"] == "end"]
    # said in the summary: the base's and the fine-tune's counts of 3
    text = " ".join(out.stdout.split())
    assert "held-out tool calls" in text and "of 3 (base → fine-tune)" in text


def test_eval_of_the_run_finds_the_same_held_out_calls_and_scores_them_alike(tool_run):
    """`finetuner eval RUN` (no --data) draws the same split from the run's data as the run did: the same 3 calls,
    and greedy answers of the same weights give the same shares as the run's own end."""
    run, _ = tool_run
    kept = json.loads((run / "metrics.json").read_text(encoding="utf-8"))["tool_calls"]
    p = cli_in_process("eval", str(run), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["tool_call_requests"] == 3
    assert out["base"]["tool_calls"] == kept["base"] and out["fine_tuned"]["tool_calls"] == kept["fine_tuned"]


def test_the_plan_times_the_held_out_calls_it_will_ask(tool_run, tmp_path):
    """The plan of the same data holds out 2 of its 12 rows (data.val_size's default for so few), each one call:
    the whole run's time names them, asked of the base and the fine-tune."""
    run, _ = tool_run
    p = cli_in_process("plan", "--model", str(DEMO), "--data", str(run.parent / "calls.jsonl"), "--gpu", "cpu", "--json",
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    wait = json.loads(p.stdout)["predicted_wait"]
    assert wait["counts"]["tool_calls_answers"] == 4 and wait["parts_s"]["tool_calls"] > 0
    text = " ".join(cli_in_process("plan", "--model", str(DEMO), "--data", str(run.parent / "calls.jsonl"), "--gpu", "cpu",
                                   cwd=tmp_path).stdout.split())
    assert "held-out tool calls: 2 requests asked twice" in text

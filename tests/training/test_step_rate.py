"""The run's ETA follows the steps it has timed, and a run much slower than planned says so once
(finetuner/training/step_rate.py): a real run of the demo model planned with a calibration that says the
machine is 1,000 times faster than it is, and the rule's arithmetic on its own."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import finetuner
from finetuner.runs.events import read_events
from finetuner.runs.jobs import run_status
from finetuner.training.step_rate import SLOW_FACTOR, WARMUP_STEPS, StepRate

REPO = Path(__file__).resolve().parents[2]
SPEED = REPO / "tests" / "planning" / "speed_cpu.json"
STEPS = 9


def scaled_calibration(path: Path, times: float) -> Path:
    """tests/planning/speed_cpu.json with every rate ``times`` higher (and the cost of an operation ``times``
    lower): a calibration of a machine ``times`` faster than the one it was made on."""
    d = json.loads(SPEED.read_text())
    d["matmul_flops"] = {dt: [[w, r * times] for w, r in rows] for dt, rows in d["matmul_flops"].items()}
    d["attention_flops"] = {k: [[s, r * times] for s, r in rows] for k, rows in d["attention_flops"].items()}
    d["cross_entropy_elements_per_s"] = [[v, r * times] for v, r in d["cross_entropy_elements_per_s"]]
    for k in ("bandwidth_bytes_per_s", "dequant_weights_per_s", "dropout_elements_per_s"):
        d[k] *= times
    d["op_overhead_s"] /= times
    path.write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def fast_planned_run(tmp_path_factory):
    """The demo recipe, 9 steps logged each, planned with a calibration 1,000 times too fast: its events and
    the warnings it logged."""
    tmp = tmp_path_factory.mktemp("slow")
    mp = pytest.MonkeyPatch()
    mp.setenv("FINETUNER_SPEED_FILE", str(scaled_calibration(tmp / "speed_fast.json", 1000.0)))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("finetuner.training.trainer")
    logger.addHandler(handler)
    try:
        result = finetuner.train(REPO / "recipes" / "demo_cpu.yaml", output_dir=tmp / "run", overrides=[
            f"training.max_steps={STEPS}", "logging.every=1", "training.micro_batch_size=2",
            "samples.prompts=[]"])  # its evaluations and checkpoints every 50 steps: none before the end
    finally:
        logger.removeHandler(handler)
        mp.undo()
    return result.run_dir, list(read_events(result.run_dir / "events.jsonl")), [r.getMessage() for r in records]


def test_a_run_slower_than_planned_says_so_once_with_both_rates(fast_planned_run):
    run_dir, events, warnings = fast_planned_run
    planned = next(e for e in events if e["event"] == "start")["predicted_speed"]["step_s"]
    slow = [e for e in events if e["event"] == "slow_steps"]
    assert len(slow) == 1, slow
    ev = slow[0]
    assert ev["step"] >= 2 * WARMUP_STEPS  # the warm-up steps, then as many timed
    assert ev["planned_step_s"] == planned
    assert ev["measured_step_s"] > SLOW_FACTOR * planned
    assert ev["factor"] == pytest.approx(ev["measured_step_s"] / planned, abs=0.005 + 1e-5 / planned)
    assert f"{ev['measured_step_s']:.3g} s each" in ev["message"] and f"{planned:.3g} s planned" in ev["message"]
    assert warnings.count(ev["message"]) == 1  # the warning line, once
    assert ev["message"] in run_status(run_dir).notes  # what the web UI shows of the run


def test_the_eta_is_planned_for_the_first_steps_then_follows_the_measured_ones(fast_planned_run):
    _, events, _ = fast_planned_run
    planned = next(e for e in events if e["event"] == "start")["predicted_speed"]["step_s"]
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for k in range(1, WARMUP_STEPS + 1):
        assert steps[k]["eta_from"] == "planned"
        assert steps[k]["eta_s"] == round(planned * (STEPS - k), 1)
    mark = steps[WARMUP_STEPS]["elapsed_s"]
    for k in range(WARMUP_STEPS + 1, STEPS + 1):
        assert steps[k]["eta_from"] == "measured"
        per_step = (steps[k]["elapsed_s"] - mark) / (k - WARMUP_STEPS)
        # elapsed_s is rounded to 1e-3 s (two of them: 1e-3 over the steps since the mark), eta_s to 0.1 s
        tol = 0.05 + 1e-3 / (k - WARMUP_STEPS) * (STEPS - k) + 1e-9
        assert steps[k]["eta_s"] == pytest.approx(per_step * (STEPS - k), abs=tol)
        assert per_step > SLOW_FACTOR * planned  # the measured rate, not the plan's
    assert steps[STEPS]["eta_s"] == 0


def test_the_rule_in_numbers():
    """Planned 1 s a step: steps of 1.9 s say nothing (under 2x); of 2.5 s say it once, after three timed."""
    rate = StepRate(planned_step_s=1.0, max_steps=20, started_at=100.0)
    now = 100.0
    for step in range(1, 10):
        now += 1.9
        rate.record(step, 1.9, now)
        assert rate.slow_message() is None
    assert rate.eta(9, now) == (pytest.approx(1.9 * 11), "measured")
    rate = StepRate(planned_step_s=1.0, max_steps=20, started_at=0.0, first_step=10)  # resumed at step 10
    said, now = [], 0.0
    for step in range(11, 20):
        now += 2.5
        rate.record(step, 2.5, now)
        said.append(rate.slow_message())
        if step <= 10 + WARMUP_STEPS:
            assert rate.eta(step, now) == (1.0 * (20 - step), "planned")
    assert [i for i, s in enumerate(said) if s] == [2 * WARMUP_STEPS - 1]  # the third step timed after the warm-up
    assert said[2 * WARMUP_STEPS - 1][1] == pytest.approx(2.5)
    assert StepRate(None, 20, started_at=0.0).eta(2, 10.0) == (5.0 * 18, "measured")  # no plan: measured at once


def test_the_console_bar_shows_the_runs_eta_not_its_own_guess():
    """The rich bar's ETA is the step event's (planned for the first steps, said so; then the measured); the start
    event's note of a machine busier than at calibration is printed."""
    import io

    from rich.console import Console

    from finetuner.cli.progress import ProgressPrinter

    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=200, color_system=None)
    start = {"event": "start", "name": "n", "device": "cpu", "method": "lora", "trainable_params": 1, "total_params": 2,
             "max_steps": 10, "run_dir": "r", "predicted_speed": {"tokens_per_s": 100.0, "step_s": 2.0, "total_s": 20.0,
                                                                 "source": "s", "load_note": "the machine is busier now: x"}}
    step = {"event": "step", "max_steps": 10, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 50.0}
    with ProgressPrinter(con) as printer:
        printer(start)
        assert printer.progress.tasks[0].fields["eta"] == "0:00:20 (planned)"  # 10 steps x 2 s, before the first
        printer({**step, "step": 1, "eta_s": 18.0, "eta_from": "planned"})
        assert printer.progress.tasks[0].fields["eta"] == "0:00:18 (planned)"
        printer({**step, "step": 4, "eta_s": 65.4, "eta_from": "measured"})
        assert printer.progress.tasks[0].fields["eta"] == "0:01:05"
    assert "ETA 0:01:05" in out.getvalue()
    assert "Note: the machine is busier now: x." in out.getvalue()  # the start event's load note
    plain = io.StringIO()
    printer = ProgressPrinter(Console(file=plain, width=200))  # off a terminal: a line a step
    printer({**step, "step": 1, "eta_s": 18.0, "eta_from": "planned"})
    printer({**step, "step": 4, "eta_s": 65.4, "eta_from": "measured"})
    first, fourth = plain.getvalue().splitlines()
    assert first.endswith("  ETA 0:00:18 (planned)") and fourth.endswith("  ETA 0:01:05")  # as the bar says it
    assert "planned" not in fourth

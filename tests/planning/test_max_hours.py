"""``finetuner plan --max-hours H`` plans within a time budget (issue 55, item 4): the least-reduced plan (fewer
epochs first, then the sequence at the data's 95th percentile; never another card) whose predicted whole run fits H,
or exit 1 with the shortest it can do. The budgets are set from the predicted times of the plans themselves, so
each assertion is arithmetic on the planner's own numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.planning.length_cap import round_up
from finetuner.planning.planner import plan
from finetuner.units import duration_text

from tests.conftest import cli_in_process
from tests.planning.test_length_cap import DEMO


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """200 short rows and 8 long ones (4 %): the 95th percentile is short, the sequence is set by the long rows
    (not an outlier cap: the 99th percentile is long too), and the planner takes several epochs."""
    rows = [{"instruction": f"What colour is box {i}?", "output": " ".join(["box"] * (120 if i % 25 == 0 else 5))}
            for i in range(200)]
    path = tmp_path_factory.mktemp("budget") / "boxes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _planned(data: Path, **changes):
    return plan(str(DEMO), "cpu", data=str(data), alternatives=False, **changes)


@pytest.fixture(scope="module")
def choices(data):
    """The job as asked, then each cheaper choice in the order the budget tries them, with its plan."""
    asked = _planned(data)
    epochs, seq = int(asked.recipe.training.epochs), round_up(asked.data["p95_tokens"])
    assert epochs > 1 and seq < asked.seq_len and not asked.recipe.data.packing  # the data is what the doc says
    fewer = [{"epochs": e} for e in range(epochs - 1, 0, -1)]
    order = [{}] + fewer + [{"seq_len": seq}] + [{"seq_len": seq, **c} for c in fewer]
    return [(c, _planned(data, **c) if c else asked) for c in order]


def _cli(data: Path, hours: float, *more: str):
    return cli_in_process("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "--max-hours", repr(hours), *more)


def _least_reduced(choices, limit_s: float):
    return next((c, p) for c, p in choices if p.fits and p.wall_s <= limit_s)


@pytest.mark.parametrize("budget", ["fewer epochs", "shorter sequence"])
def test_max_hours_plans_the_least_reduced_choice_whose_predicted_time_fits(data, choices, budget):
    asked = choices[0][1]
    at_full_seq = [p for c, p in choices if "seq_len" not in c]
    if budget == "fewer epochs":  # half way between the asked plan and one epoch at the asked sequence
        limit = (asked.wall_s + at_full_seq[-1].wall_s) / 2
    else:  # below every epoch count at the asked sequence, above one epoch at the 95th percentile's
        shortest = min(p.wall_s for _, p in choices)
        limit = (min(p.wall_s for p in at_full_seq) + shortest) / 2
        assert shortest < limit < min(p.wall_s for p in at_full_seq)
    changes, expected = _least_reduced(choices, limit)
    assert ("seq_len" in changes) == (budget == "shorter sequence") and changes
    r = _cli(data, limit / 3600, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["predicted_wall_s"] <= round(limit, 1) + 0.05 and got["gpu"]["name"] == asked.gpu.name
    assert got["recipe"]["training"]["epochs"] == changes.get("epochs", asked.recipe.training.epochs)
    assert got["recipe"]["data"]["max_seq_len"] == changes.get("seq_len", asked.seq_len)
    assert got["predicted_wall_s"] == round(expected.wall_s, 1)
    first = got["reasons"][0]
    assert first.startswith(f"reduced to fit --max-hours {limit / 3600:g}: ")
    assert f"the whole run ~{duration_text(expected.wall_s)} (as asked ~{duration_text(asked.wall_s)})" in first
    assert ("--seq-len" in first) == ("seq_len" in changes) and (f"--epochs {changes['epochs']}" in first) == ("epochs" in changes)


def test_max_hours_keeps_a_plan_that_fits_as_asked_and_refuses_a_budget_nothing_fits(data, choices, tmp_path):
    asked = choices[0][1]
    kept = plan(str(DEMO), "cpu", data=str(data), max_hours=2 * asked.wall_s / 3600)
    assert (kept.recipe.training.epochs, kept.seq_len, kept.wall_s) == (asked.recipe.training.epochs, asked.seq_len, asked.wall_s)
    assert kept.reasons[0] == f"fits --max-hours {2 * asked.wall_s / 3600:g} as asked: the whole run ~{duration_text(asked.wall_s)}"
    shortest = min(p.wall_s for _, p in choices)
    out = tmp_path / "r.yaml"
    r = _cli(data, shortest / 2 / 3600, "-o", str(out))
    assert r.returncode == 1 and not out.exists()  # plan's "nothing fits" status; no recipe over the budget
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Over budget: nothing fits --max-hours {shortest / 2 / 3600:g} on cpu: ")
    assert "--seq-len" in lines[0] and "--epochs 1 " in lines[0] and f"~{duration_text(shortest)}" in lines[0]
    said = float(lines[0].split("give --max-hours ")[1].split()[0])
    assert shortest / 3600 <= said <= 1.1 * shortest / 3600  # the budget that holds the shortest, rounded up


@pytest.mark.parametrize("hours", ["0", "-1", "nan"])
def test_max_hours_must_be_a_positive_number(data, hours):
    r = cli_in_process("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "--max-hours", hours)
    assert r.returncode == 2 and f"--max-hours {hours}: the time budget must be" in r.stderr and "Traceback" not in r.stderr

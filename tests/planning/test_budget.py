"""A long plan says so up front with its cheaper choices, each with the time its own plan predicts (issue 55,
item 4): the threshold is lowered here so that the demo model's plan of a few seconds counts as long."""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetuner.planning import budget
from finetuner.planning.planner import plan
from finetuner.units import duration_text

from tests.conftest import cli_in_process
from tests.planning.test_length_cap import DEMO, _write


def test_a_long_plan_warns_up_front_with_the_cheaper_choices_and_their_times(tmp_path, monkeypatch):
    data = _write(tmp_path / "boxes.jsonl", long_words=300)
    quiet = json.loads(cli_in_process("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "--json").stdout)
    assert quiet["warnings"] == [] and quiet["predicted_wall_s"] < budget.LONG_RUN_S  # seconds: nothing said
    monkeypatch.setattr(budget, "LONG_RUN_S", 5)
    out = tmp_path / "r.yaml"
    r = cli_in_process("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "-o", str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    warning = next(i for i, line in enumerate(lines) if line.startswith("Warning: the whole run is predicted to take"))
    assert warning < next(i for i, line in enumerate(lines) if line.startswith("Plan:"))  # up front
    text = " ".join(r.stdout.split())
    epochs = plan(str(DEMO), "cpu", data=str(data), alternatives=False).recipe.training.epochs
    fewer = int(re.search(r"--epochs (\d+) \(not (\d+)\)", text).group(1))
    assert 1 <= fewer < epochs
    assert f"--epochs {fewer} (not {epochs:g}): ~{duration_text(plan(str(DEMO), 'cpu', data=str(data), epochs=fewer).wall_s)}" in text
    card, said = re.search(r"--gpu (\S+): ~(.+?) \(speed: ", text).groups()
    assert card in budget.CARDS and said == duration_text(plan(str(DEMO), card, data=str(data)).wall_s)
    assert "# Warning: the whole run is predicted to take" in out.read_text()

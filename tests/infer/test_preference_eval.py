"""A preference run that starts from a finished SFT run, as users run DPO: the demo's SFT run, then
DPO on the demo's pairs; `finetuner eval` compares the DPO model with the SFT model it started from
on the held-out pairs, and the preference accuracy rises clearly."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import cli_in_process

REPO = Path(__file__).resolve().parents[2]


def test_dpo_from_the_sft_demo_raises_the_held_out_preference_accuracy(tmp_path, demo_run):
    sft = demo_run  # the demo's SFT run as ./scripts/demo.sh leaves it (shared by the session; only read here)
    dpo = cli_in_process("run", str(REPO / "recipes" / "demo_dpo_cpu.yaml"), "--set", f"preference.start_from={sft}",
                  "--set", "training.max_steps=20", "--set", "training.eval_every=20", "--output", str(tmp_path / "dpo"),
                  cwd=tmp_path)
    assert dpo.returncode == 0, dpo.stderr
    assert "held-out rewards" in dpo.stdout and "perplexity" not in dpo.stdout  # a DPO loss has no perplexity
    ev = cli_in_process("eval", str(tmp_path / "dpo"), "--json", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    r = json.loads(ev.stdout)
    assert r["compared_with"] == f"start: {sft}" and r["examples"] == 40
    before, after = r["base"]["accuracy"], r["fine_tuned"]["accuracy"]
    assert after >= before + 0.3, (before, after)
    table = cli_in_process("eval", str(tmp_path / "dpo"), "--no-write", cwd=tmp_path)
    assert "SFT start" in table.stdout and str(sft) in table.stdout
    assert table.stdout.startswith("40 held-out pairs from the run's validation split"), table.stdout

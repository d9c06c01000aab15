"""The plan's numbers are the run's: the optimizer steps ``finetuner plan`` predicts are the steps
the trainer takes (the same held-out split and ``ceil(rows / effective batch)`` an epoch, from
:mod:`finetuner.planning.sizing`), for SFT and DPO on the shipped data; and the web UI plans the
same sequence length as the CLI for the same file (its Data tab's default is 0 = from the data)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetuner.config.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_model"


def plan_cli(tmp_path: Path, data: str, *extra: str) -> tuple[dict, Recipe]:
    out = tmp_path / "plan.yaml"
    p = subprocess.run([sys.executable, "-m", "finetuner", "plan", "--model", str(DEMO), "--gpu", "cpu", "--data",
                        str(REPO / "data" / data), "-o", str(out), "--json", *extra],
                       cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), Recipe.from_yaml(out)


# alpaca_sample: 300 rows, 6 held out, 294 at 16 a step = 18.4 steps an epoch; preference_sample:
# 400 pairs, 8 held out, 392 at 16 = 24.5: the plan counted 18 and 24 (floor), the trainer 19 and 25
# packed (text_sample at 128 tokens, one example a step): the plan packs the data's lengths as the trainer
# does (its split, its seeded greedy packing); it used to estimate mean x rows / sequence: 116 steps, run 132
@pytest.mark.parametrize("data, objective, extra", [("alpaca_sample.json", "sft", ()), ("preference_sample.jsonl", "dpo", ()),
                                                    ("text_sample.jsonl", "sft", ("--seq-len", "128", "--effective-batch", "1"))],
                         ids=["sft", "dpo", "sft-packed"])
def test_the_plans_optimizer_steps_are_the_runs(tmp_path, data, objective, extra):
    from finetuner.planning.resolve import resolve_for_run
    from finetuner.training.trainer import Trainer

    planned, recipe = plan_cli(tmp_path, data, *extra)
    assert recipe.objective == objective
    assert recipe.data.packing is bool(extra)
    recipe, _ = resolve_for_run(recipe.model_copy(update={"output_dir": str(tmp_path / "run")}), True)
    trainer = Trainer(recipe, tmp_path / "run")
    try:
        trainer.setup()  # tokenizes, splits and schedules exactly as `finetuner run` does
        assert trainer.max_steps == planned["optimizer_steps"], (trainer.max_steps, planned["reasons"])
        assert trainer.schedule.steps_per_epoch * int(recipe.training.epochs) == planned["optimizer_steps"]
        said = next(r for r in planned["reasons"] if "optimizer steps" in r and "epoch" in r)
        assert f"{trainer.max_steps} optimizer steps" in said
        held_out = next(r for r in planned["reasons"] if r.startswith("held out"))
        assert f"held out: {trainer.data.stats.val_examples} examples" in held_out  # examples, before any packing
        # one speed prediction in every front: the plan, `finetuner estimate` and the run's start event
        from finetuner.planning.predict import estimate_time

        est = estimate_time(recipe, "cpu")
        assert est["optimizer_steps"] == trainer.max_steps == planned["optimizer_steps"]
        run = trainer.predicted_speed
        assert run["source"] == est["source"] == planned["speed_source"]
        for key, run_key, plan_key in (("tokens_per_s", "tokens_per_s", "predicted_tokens_per_s"),
                                       ("step_s", "step_s", "predicted_step_s"), ("steps_s", "total_s", "predicted_steps_s"),
                                       ("wall_s", "wall_s", "predicted_wall_s")):
            # the plan rounds the times and tokens/s to 0.1 and step_s to 1e-4 s, the run wall_s to 0.01
            tol = {"tokens_per_s": 0.051, "step_s": 5.1e-5, "steps_s": 0.051, "wall_s": 0.061}[key]
            assert est[key] == pytest.approx(run[run_key], abs=tol) == pytest.approx(planned[plan_key], abs=tol), key
        assert planned["predicted_steps_s"] == pytest.approx(planned["predicted_step_s"] * planned["optimizer_steps"],
                                                             abs=0.051 + 5e-5 * planned["optimizer_steps"])
        # the whole wait, one prediction: its counts are the run's own
        assert est["wait"]["counts"] == run["wait"]["counts"] == planned["predicted_wait"]["counts"]
        assert est["wait"]["counts"]["held_out_rows"] == trainer.data.stats.val_examples
    finally:
        trainer.cleanup()


def test_the_ui_plans_the_sequence_the_cli_plans(tmp_path):
    """The Plan tab, with the Data tab's sequence length as the page starts (0: from the data),
    writes the max_seq_len the CLI writes for the same file; the Data tab measures against it."""
    import gradio as gr
    import yaml

    from ui.handlers import Handlers
    from ui.layout import build_blocks

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    blocks = build_blocks(h)
    seq_field = next(c for c in blocks.blocks.values() if isinstance(c, gr.Number) and c.label == "Sequence length")
    assert "0 = from the data" in seq_field.info
    _, cli = plan_cli(tmp_path, "alpaca_sample.json")
    out = h.on_plan(str(DEMO), "cpu", str(REPO / "data" / "alpaca_sample.json"), seq_field.value, None, "auto", "auto")
    ui_recipe = yaml.safe_load(out[4])
    assert ui_recipe["data"]["max_seq_len"] == cli.data.max_seq_len == 128
    summary = h.on_data(str(DEMO), str(REPO / "data" / "alpaca_sample.json"), seq_field.value)[0]
    assert f"every example fits in {cli.data.max_seq_len} tokens" in summary

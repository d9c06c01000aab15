"""Issue 38: a small file does not over-train silently. With evaluations along the run, the adapter a run leaves is
the one of its lowest held-out loss (``training.keep_best``), the last one beside it as ``adapter-last/``, and the
summary says so; ``training.early_stopping_patience`` stops a run whose held-out loss stopped falling."""

from __future__ import annotations

import json

import pytest

#: a style the training rows repeat and held-out rows that do not have it: at a constant rate of 1.0 the held-out
#: loss is lowest after the first evaluation and higher at every later one (measured on 2 CPU cores: 5.887 at step 2,
#: then 5.973, 5.937, 5.916, 5.902, 5.893; the gaps, 0.005 and more, are far above float noise)
TRAIN = [{"instruction": f"What should I bring on hike {i}?", "input": "", "output": "the sun the sun the sun the sun"}
         for i in range(24)]
HELD_OUT = [{"instruction": f"What about day {i}?", "input": "", "output": "a map, water and warm boots for the trail"}
            for i in range(6)]


def _recipe(tiny_model_dir, tmp_path, **training):
    from finetuner.config.recipe import Recipe

    (tmp_path / "d.json").write_text(json.dumps(TRAIN), encoding="utf-8")
    (tmp_path / "v.json").write_text(json.dumps(HELD_OUT), encoding="utf-8")
    return Recipe.from_dict({
        "name": "t", "model": {"name": str(tiny_model_dir)}, "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(tmp_path / "d.json"), "max_seq_len": 64, "val_path": str(tmp_path / "v.json")},
        "training": {"max_steps": 12, "lr": 1.0, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0, "scheduler": "constant", "scheduler": "constant",
                     "eval_every": 2, **training},
        "logging": {"tensorboard": False}, "output_dir": str(tmp_path / "run")})


def _held_out(run_dir):
    return [json.loads(x)["eval_loss"] for x in (run_dir / "events.jsonl").read_text().splitlines()
            if json.loads(x)["event"] == "eval"]


def test_the_run_keeps_the_adapter_of_its_lowest_held_out_loss_and_the_last_one_beside_it(tiny_model_dir, tmp_path):
    import finetuner

    result = finetuner.train(_recipe(tiny_model_dir, tmp_path))
    m, losses = result.metrics, _held_out(result.run_dir)
    best = min(losses)
    assert m["best_eval_loss"] == best and m["eval_loss"] == best and m["eval_loss_last"] == losses[-1] > best
    assert m["adapter_step"] == m["best_step"] == 2 * (losses.index(best) + 1) < m["steps"] == 12
    assert m["held_out_note"] == (f"held-out loss rose from {best:.4f} at step {m['best_step']} to {losses[-1]:.4f} at step 12: "
                                  f"the adapter is step {m['best_step']}'s (the last is adapter-last/)")
    assert json.loads((result.run_dir / "metrics.json").read_text())["adapter_step"] == m["best_step"]
    # each folder holds what it says: their held-out losses, measured again by `finetuner eval`
    kept = finetuner.evaluate_run(result.run_dir / "adapter", write=False).fine_tuned.loss
    last = finetuner.evaluate_run(result.run_dir / "adapter-last", write=False).fine_tuned.loss
    assert kept == pytest.approx(best, rel=1e-5) and last == pytest.approx(losses[-1], rel=1e-5)


def test_keep_best_off_leaves_the_last_adapter_and_says_the_loss_rose(tiny_model_dir, tmp_path):
    import finetuner

    result = finetuner.train(_recipe(tiny_model_dir, tmp_path, keep_best=False))
    m, losses = result.metrics, _held_out(result.run_dir)
    assert m["eval_loss"] == losses[-1] and "adapter_step" not in m and not (result.run_dir / "adapter-last").exists()
    assert m["held_out_note"].endswith("the adapter is the last step's")


def test_early_stopping_stops_after_the_evaluations_without_a_lower_held_out_loss(tiny_model_dir, tmp_path):
    import finetuner

    result = finetuner.train(_recipe(tiny_model_dir, tmp_path, early_stopping_patience=2))
    m, losses = result.metrics, _held_out(result.run_dir)
    # best at step 2, no lower loss at steps 4 and 6: stopped there, evaluated again at the end
    assert m["stopped_early"] is True and m["steps"] == m["best_step"] + 2 * 2 < 12
    assert m["adapter_step"] == m["best_step"] and len(losses) == 3 + 1


def test_the_python_api_and_the_uis_job_state_say_which_adapter_the_run_kept(tiny_model_dir, tmp_path):
    import finetuner
    from finetuner.runs.jobs import run_status

    result = finetuner.train(_recipe(tiny_model_dir, tmp_path))
    note = result.metrics["held_out_note"]
    assert ("held-out", note) in finetuner.Run(result.run_dir)._rows()
    assert note in run_status(result.run_dir, runs_dir=tmp_path).notes

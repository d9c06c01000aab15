"""One prediction (finetuner/planning/predict.py): the plan's chosen recipe, `finetuner estimate`, the Python API
and the trainer's start event say the same memory, step and wait, and the model is resolved once for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import finetuner
from finetuner.config.hardware import get_gpu
from finetuner.config.recipe import Recipe
from finetuner.planning.planner import plan
from finetuner.planning.predict import estimate_recipe, estimate_time, predict
from tests.conftest import cli_in_process

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model, gpu", [("llama-3.1-8b", "rtx4090"), ("qwen3-30b-a3b", "rtx4090"), ("gemma-3-12b", "rtx4090")])
def test_the_plans_choice_is_predicted_as_the_plan_predicted_it(model, gpu):
    p = plan(model, gpu)
    again = predict(p.recipe, p.gpu, shape=p.shape, label_fraction=1.0)
    assert again.planned is None  # the plan's recipe has nothing left to resolve
    assert again.memory.total_bytes == p.estimate.total_bytes and again.memory.components == p.estimate.components
    assert again.step.step_s == pytest.approx(p.step.step_s, rel=1e-12)
    assert again.step.tokens_per_s == pytest.approx(p.tokens_per_s, rel=1e-12)


def test_estimate_the_api_and_predict_are_one_figure(tmp_path):
    recipe = REPO / "recipes" / "7b_4090.yaml"
    p = predict(recipe, "rtx4090")
    assert finetuner.estimate(str(recipe), "rtx4090").total_bytes == estimate_recipe(recipe, "rtx4090").total_bytes \
        == p.memory.total_bytes
    t = estimate_time(recipe, "rtx4090")
    assert t["step_s"] == p.step.step_s and t["optimizer_steps"] == p.optimizer_steps
    out = cli_in_process("estimate", str(recipe), "--gpu", "rtx4090", "--json", cwd=tmp_path)
    shown = json.loads(out.stdout)
    assert shown["total_bytes"] == p.memory.total_bytes and shown["time"]["step_s"] == pytest.approx(p.step.step_s)


def test_the_model_is_resolved_once_for_a_prediction(monkeypatch):
    """A recipe with auto values: the planner resolves them and the prediction is made with the same model,
    read once (a hub id's config would be fetched once)."""
    import finetuner.model.shapes as shapes

    calls = []
    real = shapes.load_config
    monkeypatch.setattr(shapes, "load_config", lambda *a, **k: calls.append(a) or real(*a, **k))
    recipe = Recipe.from_yaml(REPO / "recipes" / "7b_4090.yaml")
    recipe = Recipe.from_dict({**recipe.to_dict(), "training": {**recipe.to_dict()["training"], "micro_batch_size": "auto"}})
    assert recipe.auto_keys()
    p = predict(recipe, get_gpu("rtx4090"))
    assert p.planned is not None and not p.recipe.auto_keys()
    p.time()
    assert len(calls) == 1, calls


def test_the_runs_start_event_is_the_prediction(tiny_model_dir, tmp_path):
    """The trainer's start event: the memory and speed of predict() for the same recipe on the same device."""
    from finetuner.runs.events import read_events
    from tests.conftest import alpaca_rows

    data = tmp_path / "d.json"
    data.write_text(json.dumps(alpaca_rows(12)), encoding="utf-8")
    raw = {"name": "p", "model": {"name": str(tiny_model_dir)}, "device": "cpu", "output_dir": str(tmp_path / "run"),
           "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "data": {"path": str(data), "max_seq_len": 64, "val_size": 0},
           "training": {"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation": 1, "lr": 1e-3}}
    result = finetuner.train(Recipe.from_dict(raw))
    start = next(e for e in read_events(result.run_dir / "events.jsonl") if e["event"] == "start")
    p = predict(Recipe.from_yaml(result.run_dir / "recipe.yaml"), "cpu", steps=2)
    assert start["predicted"]["total_bytes"] == p.memory.total_bytes
    assert start["predicted_speed"]["step_s"] == pytest.approx(p.step.step_s, rel=1e-4)

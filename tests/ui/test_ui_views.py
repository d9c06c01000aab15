"""What the web UI shows, without a browser: the loss and memory charts' specifications, the plan's
headline against the recipe in the editor, and one memory figure for one plan."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ui import views

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


def _layer(spec: dict, mark: str) -> dict:
    return next(layer for layer in spec["layer"] if layer["mark"]["type"] == mark)


# --------------------------------------------------------------------------- the loss chart
def test_loss_chart_has_numeric_axes_and_shows_the_first_points():
    st = SimpleNamespace(losses=[(2, 6.55), (4, 5.8)], evals=[(4, 5.56)], max_steps=30)
    spec = views.loss_chart(st)
    enc = spec["encoding"]
    assert (enc["x"]["type"], enc["y"]["type"]) == ("quantitative", "quantitative")
    assert enc["y"]["scale"]["zero"] is False and enc["x"]["scale"]["domain"] == [0, 30]  # the whole run ahead
    assert enc["x"]["axis"]["values"] == [0, 5, 10, 15, 20, 25, 30]  # whole steps only
    rows = spec["data"]["values"]
    assert all(isinstance(r["step"], int) and isinstance(r["loss"], float) for r in rows)
    assert [(r["step"], r["series"]) for r in rows] == [(2, "train"), (4, "train"), (4, "eval")]
    assert enc["color"]["scale"] == {"domain": ["train", "eval"], "range": ["#6366f1", "#f97316"]}
    # a line through the points, and a dot on each (the single eval point has no line to be on)
    assert _layer(spec, "line") and _layer(spec, "point")["transform"] == [{"filter": "datum.dot"}]
    assert all(r["dot"] for r in rows)
    assert spec["title"]["text"] == "Loss — train and eval"


def test_loss_chart_before_the_first_step_and_for_long_runs():
    empty = views.loss_chart(SimpleNamespace(losses=[], evals=[], max_steps=None))
    assert empty["data"]["values"] == [] and empty["encoding"]["x"]["type"] == "quantitative"
    assert empty["title"]["text"] == "Loss — waiting for the first step"
    assert empty["encoding"]["color"]["scale"]["domain"] == ["train"]  # no eval in the legend before there is one
    long = SimpleNamespace(losses=[(i, 1.0 / i) for i in range(1, 201)], evals=[(100, 0.4), (200, 0.3)], max_steps=200)
    rows = views.loss_chart(long)["data"]["values"]
    assert not any(r["dot"] for r in rows if r["series"] == "train")  # a dense line: no dots
    assert all(r["dot"] for r in rows if r["series"] == "eval")


# --------------------------------------------------------------------------- the memory chart
def test_memory_chart_on_cpu_is_drawn_to_the_scale_of_the_peak():
    from finetuner.config.hardware import cpu_profile
    from finetuner.planning.planner import estimate_recipe

    cpu = cpu_profile()
    est = estimate_recipe(str(REPO / "recipes" / "demo_cpu.yaml"), cpu)
    assert est.budget_bytes > views.OFF_SCALE * est.total_bytes  # the situation: RAM dwarfs the recipe
    spec = views.memory_chart(est, cpu)
    end = spec["encoding"]["x"]["scale"]["domain"][1]
    assert end == pytest.approx(1.05 * est.total_bytes / GiB)
    rows = {r["what"]: r for r in spec["data"]["values"]}
    budget = rows["card budget"]
    assert budget["off"] and budget["inside"] and budget["bar"] == end and "off the scale" in budget["label"]
    assert budget["label"].startswith(views.gib(est.budget_bytes, 2)[:4])  # its real value is written on it
    assert not rows["predicted peak"]["off"] and rows["predicted peak"]["bar"] > 0.7 * end
    biggest = max((r for r in rows.values() if r["kind"] == "component"), key=lambda r: r["GiB"])
    assert biggest["bar"] > 0.3 * end  # components are readable, not flattened by the budget
    assert "larger" in " ".join(spec["title"]["subtitle"])
    assert spec["encoding"]["y"]["axis"]["labelLimit"] == 0  # component names are never cut


def test_memory_chart_on_a_gpu_shows_the_budget_to_scale():
    from finetuner.config.hardware import get_gpu
    from finetuner.planning.planner import estimate_recipe

    gpu = get_gpu("rtx4090")
    est = estimate_recipe(str(REPO / "recipes" / "7b_4090.yaml"), gpu)
    spec = views.memory_chart(est, gpu)
    rows = spec["data"]["values"]
    assert not any(r["off"] for r in rows) and "subtitle" not in spec["title"]
    assert spec["encoding"]["x"]["scale"]["domain"][1] == pytest.approx(1.05 * est.budget_bytes / GiB)
    inside = {r["what"] for r in rows if r["inside"]}  # long bars carry their value, short ones after them
    assert {"predicted peak", "card budget"} <= inside and "gradients" not in inside
    assert [r["what"] for r in rows[-2:]] == ["predicted peak", "card budget"]


# --------------------------------------------------------------------------- the plan's headline and figure
@pytest.fixture(scope="module")
def planned_7b():
    from finetuner.config.hardware import get_gpu
    from finetuner.planning.planner import plan

    return plan("qwen2.5-7b", get_gpu("rtx4090"), seq_len=256, data=str(REPO / "data" / "alpaca_sample.json"),
                effective_batch=16)


def test_the_page_estimates_a_plan_as_the_planner_did(planned_7b):
    """One figure for one plan: the estimate under "Fits" is the planner's (the data's trained
    share of tokens counted), not estimate_recipe's every-token upper bound."""
    from finetuner.planning.planner import estimate_recipe
    from ui.estimate import label_fraction, recipe_estimate

    p = planned_7b
    assert label_fraction(p.recipe) < 1.0
    shown = recipe_estimate(p.recipe, p.gpu)
    assert shown.total_bytes == p.estimate.total_bytes
    assert f"predicted peak **{views.gib(p.estimate.total_bytes, 1)}**" in views.estimate_md(shown, p.gpu)
    assert f"predicted peak {p.estimate.total_bytes / GiB:.1f} GiB" in p.reasons[0]  # the planner's "Why"
    assert estimate_recipe(p.recipe, p.gpu).total_bytes > shown.total_bytes  # the figure the page showed before


def test_the_headline_follows_the_recipe_in_the_editor(planned_7b):
    p = planned_7b
    kept = views.planned(p)
    t = p.recipe.training
    plan_text = views.plan_md(p)
    assert plan_text.startswith(f"### LORA · micro-batch {t.micro_batch_size} × {t.gradient_accumulation}")
    assert "**Why**" in plan_text and views.recipe_md(p.recipe, kept) == plan_text
    edited = p.recipe.model_copy(update={"training": t.model_copy(update={"micro_batch_size": 1, "gradient_accumulation": 16})})
    text = views.recipe_md(edited, kept)
    assert text.startswith("### LORA · micro-batch 1 × 16")
    assert "Changed from the plan" in text and f"micro-batch {t.micro_batch_size} × {t.gradient_accumulation}" in text
    other = p.recipe.model_copy(update={"model": p.recipe.model.model_copy(update={"name": "llama-2-7b"})})
    assert "A recipe of your own" in views.recipe_md(other, kept) and "Why" not in views.recipe_md(other, kept)
    assert "A recipe of your own" in views.recipe_md(p.recipe, None)


def test_train_tab_names_its_memory_figure():
    st = SimpleNamespace(measured_what="torch.cuda.max_memory_allocated", device="cuda",
                         predicted_bytes=20 * GiB, measured_peak_bytes=21 * GiB)
    text = views.memory_md(st)
    assert "predicted peak 20.00 GiB allocated" in text and "Plan tab's peak" in text

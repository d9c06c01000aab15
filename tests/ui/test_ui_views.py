"""What the web UI shows, without a browser: the loss, reward and memory charts' specifications, the
plan's headline against the recipe in the editor, one memory figure for one plan, and preference
pairs side by side."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ui import run_views, views

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


def _layer(spec: dict, mark: str) -> dict:
    return next(layer for layer in spec["layer"] if layer["mark"]["type"] == mark)


# --------------------------------------------------------------------------- the loss chart
def test_loss_chart_has_numeric_axes_and_shows_the_first_points():
    st = SimpleNamespace(losses=[(2, 6.55), (4, 5.8)], evals=[(4, 5.56)], max_steps=30)
    spec = run_views.loss_chart(st)
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
    empty = run_views.loss_chart(SimpleNamespace(losses=[], evals=[], max_steps=None))
    assert empty["data"]["values"] == [] and empty["encoding"]["x"]["type"] == "quantitative"
    assert empty["title"]["text"] == "Loss — waiting for the first step"
    assert empty["encoding"]["color"]["scale"]["domain"] == ["train"]  # no eval in the legend before there is one
    long = SimpleNamespace(losses=[(i, 1.0 / i) for i in range(1, 201)], evals=[(100, 0.4), (200, 0.3)], max_steps=200)
    rows = run_views.loss_chart(long)["data"]["values"]
    assert not any(r["dot"] for r in rows if r["series"] == "train")  # a dense line: no dots
    assert all(r["dot"] for r in rows if r["series"] == "eval")


# --------------------------------------------------------------------------- the memory chart
def test_memory_chart_on_cpu_is_drawn_to_the_scale_of_the_peak():
    from finetuner.config.hardware import cpu_profile
    from finetuner.planning.predict import estimate_recipe

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
    from finetuner.planning.predict import estimate_recipe

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
    from finetuner.planning.predict import estimate_recipe
    from ui.estimate import label_fraction, recipe_estimate

    p = planned_7b
    assert label_fraction(p.recipe) < 1.0
    shown = recipe_estimate(p.recipe, p.gpu)
    assert shown.total_bytes == p.estimate.total_bytes
    assert f"predicted peak **{views.gib(p.estimate.total_bytes, 1)}**" in views.estimate_md(shown, p.gpu)
    assert f"predicted peak {p.estimate.total_bytes / GiB:.1f} GiB" in p.reasons[0]  # the planner's "Why"
    assert estimate_recipe(p.recipe, p.gpu).total_bytes == shown.total_bytes  # `finetuner estimate` measures it too
    assert estimate_recipe(p.recipe, p.gpu, label_fraction=1.0).total_bytes > shown.total_bytes  # every token: the upper bound


def test_the_headline_follows_the_recipe_in_the_editor(planned_7b):
    p = planned_7b
    kept = views.planned(p)
    t = p.recipe.training
    plan_text = views.plan_md(p)
    assert plan_text.startswith(f"### LORA · micro-batch {t.micro_batch_size} × {t.gradient_accumulation}")
    assert f"**Time:** ~{p.tokens_per_s:,.0f} tokens/s, " in plan_text and "per optimizer step" in plan_text
    assert "**Why**" in plan_text and views.recipe_md(p.recipe, kept) == plan_text
    edited = p.recipe.model_copy(update={"training": t.model_copy(update={"micro_batch_size": 1, "gradient_accumulation": 16})})
    text = views.recipe_md(edited, kept)
    assert text.startswith("### LORA · micro-batch 1 × 16")
    assert "Changed from the plan" in text and f"micro-batch {t.micro_batch_size} × {t.gradient_accumulation}" in text
    other = p.recipe.model_copy(update={"model": p.recipe.model.model_copy(update={"name": "llama-2-7b"})})
    assert "A recipe of your own" in views.recipe_md(other, kept) and "Why" not in views.recipe_md(other, kept)
    assert "A recipe of your own" in views.recipe_md(p.recipe, None)


def test_the_ui_says_the_time_as_estimate_says_it_without_the_parts():
    """One formatter (time_text.time_text): the UI's line is `finetuner estimate`'s opening, then the whole run's time."""
    from finetuner.config.recipe import Recipe
    from finetuner.planning.time_text import estimate_text
    from finetuner.units import duration_text
    from finetuner.planning.predict import estimate_time

    for name in ("demo_cpu.yaml", "demo_grpo_cpu.yaml"):
        t = estimate_time(Recipe.from_yaml(REPO / "recipes" / name), "cpu")
        ui, cli = views.time_text(t), estimate_text(t)
        opening = cli.split(", the whole run")[0]
        if t["upper_bound"]:  # GRPO: the CLI says why "at most" inside its first clause
            opening = opening.replace(" (completions at their longest; the rollout's generation included)", "")
        assert ui.startswith(opening), (ui, cli)
        bound = "at most " if t["upper_bound"] else ""
        assert ui.endswith(f"; the whole run {bound}~{duration_text(t['wall_s'])} (load, replay, evaluations, "
                           "checkpoints, probe and samples included)"), ui


def test_train_tab_names_its_memory_figure():
    st = SimpleNamespace(measured_what="torch.cuda.max_memory_allocated", device="cuda",
                         predicted_bytes=20 * GiB, measured_peak_bytes=21 * GiB)
    text = run_views.memory_md(st)
    assert "predicted peak 20.00 GiB allocated" in text and "Plan tab's peak" in text


# --------------------------------------------------------------------------- preference data and runs
def _write(path: Path, rows: list) -> str:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _cells(html_text: str) -> list[list[str]]:
    """The table's rows as the text of their cells (tags dropped)."""
    import re

    body = html_text.split("<tbody>", 1)[1]
    return [[re.sub(r"<[^>]+>", "|", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", body)]


def test_pairs_are_shown_side_by_side_as_training_reads_them():
    import json

    from finetuner.data.preview import preview_preferences

    path = REPO / "data" / "preference_sample.jsonl"
    text = views.pairs_html(preview_preferences(str(path), n=3))
    assert "<th>prompt</th><th>chosen ✓</th><th>rejected ✕</th>" in text and "layout sharegpt_ranking" in text
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[:3]]
    cells = _cells(text)
    assert len(cells) == 3
    for (prompt, chosen, rejected), row, line in zip(cells, rows, (1, 2, 3)):
        assert prompt == f"{row['conversations'][0]['value']}|line {line}|"
        assert (chosen, rejected) == (row["chosen"]["value"], row["rejected"]["value"])


def test_rated_rows_conversations_markup_and_long_texts(tmp_path):
    from finetuner.data.preview import preview_preferences

    long = "Tern here! " + "Bring water. " * 80
    path = _write(tmp_path / "rated.jsonl", [
        {"messages": [{"role": "system", "content": "Be Tern."}, {"role": "user", "content": "<b>What</b> & why?"},
                      {"role": "assistant", "content": long}], "label": True},
        {"prompt": "Where is the hide?", "completion": "No idea.", "label": False},
    ])
    text = views.pairs_html(preview_preferences(path))
    assert "<th>prompt</th><th>response</th><th>label</th>" in text and "<b>What</b>" not in text  # the data is text, not markup
    (p1, r1, l1), (p2, r2, l2) = _cells(text)
    assert p1 == "||system| Be Tern.|||user| &lt;b&gt;What&lt;/b&gt; &amp; why?||line 1|"
    assert (l1, l2) == ("✓ desirable", "✕ undesirable") and r2 == "No idea." and p2 == "Where is the hide?|line 2|"
    shown = r1.split("…|")[0]  # cut between words, the rest counted
    assert r1.startswith("Tern here! Bring water.") and shown.endswith("Bring water.") and len(shown) < views.CELL_CHARS
    assert r1.endswith(f"…| ({len(long) - len(shown):,} more characters)|")


def test_the_data_summary_says_what_a_preference_file_fits(tmp_path):
    from finetuner.data.stats import profile_data

    pairs = profile_data(str(REPO / "data" / "preference_sample.jsonl"), str(REPO / "data" / "demo_model"), 40)
    text = views.preference_summary_md(pairs, 40)
    assert "preference pairs (a chosen and a rejected response) · layout `ShareGPT ranking` · **400** pairs" in text
    assert "**Fits objective dpo, orpo or simpo** (the plan's objective *auto* takes **dpo**)" in text
    assert f"{pairs.truncated(40)} example(s) are longer than the sequence length 40" in text and pairs.truncated(40) > 0
    assert "every example fits in 256 tokens" in views.preference_summary_md(pairs, 256)
    rated = profile_data(_write(tmp_path / "r.jsonl", [{"prompt": "Q", "completion": "A", "label": True},
                                                      {"prompt": "Q", "completion": "A", "label": "yes"}]), None, 256)
    text = views.preference_summary_md(rated, 256)
    assert "**1** rated responses" in text and "**Fits objective kto** (the plan's objective *auto* takes **kto**)" in text
    assert "**1 row(s) cannot be used**, the first: " in text and "r.jsonl, line 2: &#x27;label&#x27; must be true" in text


def _dpo_status(steps: int = 3, evals: bool = True) -> SimpleNamespace:
    rewards = {"reward_accuracy": [(s, 0.25 * s) for s in range(1, steps + 1)],
               "reward_margin": [(s, 0.01 * s) for s in range(1, steps + 1)]}
    if evals:
        rewards |= {"eval_reward_accuracy": [(2, 0.6)], "eval_reward_margin": [(2, 0.02)]}
    return SimpleNamespace(losses=[(s, 0.69 - 0.01 * s) for s in range(1, steps + 1)], evals=[(2, 0.68)] if evals else [],
                           rewards=rewards, objective="dpo", max_steps=8)


def test_the_reward_chart_draws_accuracy_and_margin_on_their_own_axes():
    spec = run_views.reward_chart(_dpo_status())
    rows = spec["data"]["values"]
    assert [(r["step"], r["value"], r["series"]) for r in rows if r["metric"] == "accuracy"] == [
        (1, 0.25, "accuracy"), (2, 0.5, "accuracy"), (3, 0.75, "accuracy"), (2, 0.6, "eval accuracy")]
    assert [(r["step"], r["series"]) for r in rows if r["metric"] == "margin"] == [
        (1, "margin"), (2, "margin"), (3, "margin"), (2, "eval margin")]
    accuracy, margin = spec["layer"]
    assert accuracy["transform"] == [{"filter": "datum.metric === 'accuracy'"}]
    assert accuracy["encoding"]["y"]["scale"]["domain"] == [0, 1] and accuracy["encoding"]["y"]["axis"]["format"] == ".0%"
    assert margin["encoding"]["y"]["axis"]["orient"] == "right" and spec["resolve"] == {"scale": {"y": "independent"}}
    assert margin["layer"][0]["mark"]["strokeDash"] and "strokeDash" not in accuracy["layer"][0]["mark"]
    colour = accuracy["encoding"]["color"]["scale"]
    assert colour["domain"] == ["accuracy", "eval accuracy", "margin", "eval margin"] and len(set(colour["range"])) == 4
    assert spec["encoding"]["x"]["scale"]["domain"] == [0, 8] and spec["title"]["text"] == "Reward accuracy — 75% at step 3"


def test_the_reward_chart_before_the_first_step():
    spec = run_views.reward_chart(SimpleNamespace(losses=[], evals=[], rewards={}, objective="orpo", max_steps=None))
    assert spec["data"]["values"] == [] and spec["title"]["text"] == "Reward accuracy — waiting for the first step"
    assert len(spec["layer"]) == 1 and spec["layer"][0]["encoding"]["color"]["scale"]["domain"] == ["accuracy"]


def test_the_status_line_shows_the_latest_reward_accuracy():
    from finetuner.runs.jobs import RunStatus

    dpo = RunStatus("runs/d", "d", "running", step=3, **vars(_dpo_status()))
    text = run_views.status_html(dpo)
    assert "reward accuracy <b>75%</b>" in text and "eval reward accuracy <b>60%</b>" in text
    sft = RunStatus("runs/s", "s", "running", step=3, max_steps=8, losses=[(3, 2.0)], objective="sft")
    assert "reward" not in run_views.status_html(sft)
    assert run_views.is_preference(_dpo_status()) and not run_views.is_preference(sft) and not run_views.is_preference(None)
    neftune = RunStatus("runs/n", "n", "running", step=3, max_steps=8, losses=[(3, 2.0)], objective="neftune")
    assert not run_views.is_preference(neftune) and "reward" not in run_views.status_html(neftune)  # SFT with noise: no rewards


def test_the_headline_names_a_preference_objective():
    from finetuner.config.recipe import Recipe

    base = {"model": {"name": str(REPO / "data" / "demo_model")}, "data": {"path": str(REPO / "data" / "preference_sample.jsonl")}}
    assert views.recipe_headline(Recipe.from_dict(dict(base, objective="dpo"))).startswith("DPO · LORA · micro-batch")
    assert views.recipe_headline(Recipe.from_dict(base)).startswith("LORA · micro-batch")


def test_a_grpo_run_shows_its_reward_curves_and_its_latest_sampled_completions(tmp_path):
    """The Train tab of a GRPO run: the mean total reward of each step, the held-out reward as dots,
    each reward function dashed, and the last step's sampled completions with their rewards."""
    from finetuner.runs import jobs
    from finetuner.runs.events import EventWriter

    run = tmp_path / "runs" / "g"
    run.mkdir(parents=True)
    w = EventWriter(run / "events.jsonl", strict=False)
    w.emit("start", objective="grpo", max_steps=4, device="cpu", method="lora")
    for step in (1, 2, 3):
        w.emit("step", step=step, loss=0.0, reward=0.2 * step, reward_std=0.1,
               rewards={"whistle": {"mean": 0.1 * step, "std": 0.0}, "length_bounds": {"mean": 0.2 * step, "std": 0.0}},
               completions=[{"prompt": f"Q{step}|", "completion": f"A whistle {step}", "reward": 0.5 * step,
                             "rewards": {"whistle": 1.0, "length_bounds": None}}])
    w.emit("eval", step=2, eval_loss=None, eval_reward=0.45, eval_rewards={"whistle": 0.25, "length_bounds": 0.4})
    st = jobs.run_status(run, tmp_path / "runs")
    assert st.objective == "grpo" and run_views.is_preference(st)  # the reward column is shown
    assert st.group_rewards["reward"] == [(1, 0.2), (2, 0.4), (3, 0.6000000000000001)]
    assert st.group_rewards["eval_reward"] == [(2, 0.45)] and st.group_rewards["eval_reward:whistle"] == [(2, 0.25)]
    spec = run_views.reward_chart(st)
    got = {(r["series"], r["step"]) for r in spec["data"]["values"]}
    assert {("reward (total)", 3), ("held-out reward", 2), ("whistle", 1), ("length_bounds", 3)} <= got
    dashed = {r["series"] for r in spec["data"]["values"] if r["dashed"]}
    assert dashed == {"whistle", "length_bounds"}
    assert spec["title"]["text"] == "Mean reward — 0.600 at step 3"
    md = run_views.samples_md(st)
    assert md.startswith("**Sampled completions at step 3**")
    assert "| Q3\\| | A whistle 3 | 1.500 | 1.000 | – |" in md  # the prompt's | escaped; a function that did not score: –
    assert "| whistle | length_bounds |" in md.splitlines()[2]

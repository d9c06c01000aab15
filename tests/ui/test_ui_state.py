"""What the page keeps: the recipe in the editor comes back after a reload (renamed when a run took
its name meanwhile), and a plan that does not fit leaves the closest recipe in the editor, so that
"Start even if it does not fit" has something to start."""

from __future__ import annotations

from pathlib import Path

from finetuner.config.recipe import Recipe, readable_yaml
from ui.handlers import START_ANYWAY, Handlers
from ui.layout import REMEMBER_JS
from ui.recipe_text import FIELD_COUNT, fields_of, recipe_from_text

REPO = Path(__file__).resolve().parents[2]
SAMPLE = str(REPO / "data" / "alpaca_sample.json")
DEMO = {"model": {"name": str(REPO / "data" / "demo_model")}, "data": {"path": SAMPLE}}
#: on_restore's outputs: model, card, data, run, runs table, chat run, export run, then the editor and its fields
EDITOR = 7


def test_a_reload_gives_the_editor_its_recipe_back(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    text = "# planned for you\n" + readable_yaml(Recipe.from_dict(dict(DEMO, name="mine", training={"max_steps": 3})))
    assert "recipe" in REMEMBER_JS  # what the browser stores of the page
    out = h.on_restore({"recipe": text})
    assert out[EDITOR] == text
    assert out[EDITOR + 1] == "lora" and 3 in out[EDITOR + 1:]  # the advanced fields follow the recipe
    other = str(REPO / "data" / "chat_sample.jsonl")  # refused for another reason: Start has the recipe (and starts nothing)
    *_, message, _mine = h.on_start(out[EDITOR], "cpu", other, False)
    assert "Not started: the recipe trains on" in message and "There is no recipe" not in message
    (h.runs / "mine").mkdir(parents=True)  # a run took the name meanwhile: renamed, as a plan is
    (h.runs / "mine" / "recipe.yaml").write_text(text, encoding="utf-8")
    again = h.on_restore({"recipe": text})[EDITOR]
    assert recipe_from_text(again).name == "mine-2" and again.startswith("# planned for you\n")
    assert h.on_restore({})[EDITOR] == h.on_restore({"recipe": ""})[EDITOR]  # nothing kept: the editor is left alone
    assert h.on_restore({"recipe": "model: ["})[EDITOR] == "model: ["  # the user's half-edited text is kept


def test_a_plan_that_does_not_fit_leaves_the_closest_recipe_to_start_anyway(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    out = h.on_plan("llama-2-7b", "1GB", SAMPLE, 0, 0, "auto", "auto")
    plan_md, text, planned = out[0], out[4], out[-1]
    assert len(out) == len(h.plan_if_empty(text, "llama-2-7b", "1GB", SAMPLE, 0, 0, "auto", "auto"))  # one output list
    assert plan_md.startswith("### ✕ Nothing fits 1GB") and "What would fit" in plan_md
    recipe = recipe_from_text(text)
    assert recipe.method == "qlora" and f"tick “{START_ANYWAY}”" in text
    assert h.on_recipe_text(text, planned) == plan_md  # the headline stays "nothing fits" for that recipe
    *_, refused, _mine = h.on_start(text, "1GB", SAMPLE, False)
    assert "Not started: " in refused and "predicted to need" in refused and START_ANYWAY in refused


def test_a_reload_answers_every_output_whatever_the_browser_kept(tmp_path):
    """Gradio refuses an answer with fewer values than the handler's outputs (the page then never loads): a reload
    with a recipe, with none and with a half-edited one answer alike, the editor and each advanced field."""
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    text = readable_yaml(Recipe.from_dict(dict(DEMO, name="mine")))
    assert FIELD_COUNT == len(fields_of(recipe_from_text(text)))
    sizes = {len(h.on_restore(saved)) for saved in ({}, {"recipe": text}, {"recipe": "model: ["}, {"recipe": ""})}
    assert sizes == {EDITOR + 1 + FIELD_COUNT}
    good = h.on_check_yaml(text, "cpu")
    assert len(good) == len(h.on_check_yaml("model: [", "cpu")) == 4 + FIELD_COUNT  # an error answers every output too
    assert len(h.on_load_recipe("no_such_recipe.yaml", "cpu")) == 5 + FIELD_COUNT
    assert len(h.on_plan("no_such_model_anywhere", "cpu", SAMPLE, 0, 0, "auto", "auto")) == 8 + FIELD_COUNT

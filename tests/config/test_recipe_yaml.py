"""The recipe as YAML: one reader for a file and for text (``Recipe.from_yaml``,
``Recipe.from_yaml_text``, the same messages), and one writer for people to read
(``readable_yaml``: ``finetuner plan -o`` and the web UI's editor), in one key order, with every
section kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetuner.config.recipe import KEY_ORDER, OPTIONAL_SECTIONS, Recipe, readable_dict, readable_yaml
from finetuner.errors import UserError
from finetuner.planning.planner import plan

REPO = Path(__file__).resolve().parents[2]


#: the shipped demo model and data: a recipe without building a model
DEMO = {"model": {"name": str(REPO / "data" / "demo_model")}, "data": {"path": str(REPO / "data" / "alpaca_sample.json")}}


def _same(a: Recipe, b: Recipe) -> None:
    assert a.model_dump() == b.model_dump()


def test_the_key_order_names_every_field_of_the_recipe_once():
    assert len(set(KEY_ORDER)) == len(KEY_ORDER)
    assert set(KEY_ORDER) == set(Recipe.model_fields)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_come_back_the_same_in_the_canonical_order(path):
    recipe = Recipe.from_yaml(path)
    text = readable_yaml(recipe)
    _same(Recipe.from_yaml_text(text, source="written"), recipe)
    keys = list(yaml.safe_load(text))
    assert keys == [k for k in KEY_ORDER if k in keys] and keys[:3] == ["name", "model", "method"]


def test_every_section_is_kept_in_order_distributed_included(tmp_path):
    raw = dict(DEMO, name="all-sections", output_dir=str(tmp_path / "out"), method="qlora", device="cpu",
               quantization={"bits": 8}, lora={"r": 8}, training={"lr": 1e-4},
               distributed={"strategy": "ddp", "num_processes": 2, "master_port": 29601},
               checkpointing={"save_every": 7}, logging={"every": 3, "tensorboard": False},
               samples={"prompts": ["Hi"]}, objective="dpo", preference={"beta": 0.2})
    recipe = Recipe.from_dict(raw)
    text = readable_yaml(recipe, header="# mine\n")
    assert text.startswith("# mine\nname: ")
    written = yaml.safe_load(text)
    # every section in order, but those of other objectives (grpo's, neftune's: a recipe of that objective's only)
    assert list(written) == [k for k in KEY_ORDER if k not in OPTIONAL_SECTIONS]
    assert written["distributed"] == {"num_processes": 2, "master_port": 29601}  # what differs from the defaults
    _same(Recipe.from_yaml_text(text, source="written"), recipe)


def test_only_what_differs_from_the_defaults_and_the_method_unless_kept():
    recipe = Recipe.from_dict(dict(DEMO, method="lora"))
    written = readable_dict(recipe)
    assert written["method"] == "lora"  # the default, written all the same
    assert "distributed" not in written and "gradient_checkpointing" not in written.get("training", {})
    kept = readable_dict(recipe, keep={"training": {"gradient_checkpointing": False}, "distributed": {"num_processes": 1}})
    assert kept["training"]["gradient_checkpointing"] is False and kept["distributed"] == {"num_processes": 1}
    assert list(kept) == [k for k in KEY_ORDER if k in kept]


def test_a_plan_over_several_gpus_writes_its_distributed_section_and_reads_back():
    p = plan("llama-2-13b", "rtx4090", seq_len=2048, gpus=2)
    text = p.to_yaml()
    assert text.startswith("# Planned by `finetuner plan`")
    written = yaml.safe_load(text)
    keys = list(written)
    assert keys.index("training") < keys.index("distributed") < keys.index("checkpointing")
    assert written["distributed"]["num_processes"] == 2 and written["distributed"]["strategy"] == p.recipe.distributed.strategy
    _same(Recipe.from_yaml_text(text, source="plan"), p.recipe)
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if not line.startswith("# "))
    assert all(not line.startswith("#") for line in lines[first:])  # the comments, then the recipe


@pytest.mark.parametrize("text, said", [
    ("model: [", "recipe: line 1, column 9: invalid YAML: expected the node content"),
    ("a: b: c", "recipe: line 1, column 5: invalid YAML: mapping values are not allowed here."),
    ("# nothing but a comment\n", "recipe: the recipe is empty."),
    ("- model\n- data\n", "recipe: a recipe must be a mapping of sections"),
    ("[" * 1000, "recipe: invalid YAML: lists or mappings nested too deeply."),
    ("model: {name: data/demo_model}\ndata: {path: data/alpaca_sample.json}\nbogus_key: 1\n",
     "recipe: the recipe is not valid:\n  - bogus_key: unknown key."),
])
def test_yaml_text_errors_name_the_source_and_the_place(text, said):
    with pytest.raises(UserError) as e:
        Recipe.from_yaml_text(text, source="recipe", base_dir=REPO)
    assert e.value.message.startswith(said), e.value.message


def test_a_file_and_its_text_give_the_same_message(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("model:\n  name: [data/demo_model\n", encoding="utf-8")
    with pytest.raises(UserError) as from_file:
        Recipe.from_yaml(f)
    with pytest.raises(UserError) as from_text:
        Recipe.from_yaml_text(f.read_text(encoding="utf-8"), source=str(f))
    assert from_file.value.message == from_text.value.message
    assert from_file.value.message.startswith(f"{f}: line 3, column 1: invalid YAML")


def test_relative_paths_in_text_resolve_against_base_dir():
    r = Recipe.from_yaml_text("model: {name: data/demo_model}\ndata: {path: data/alpaca_sample.json}\n", base_dir=REPO)
    assert r.model.name == str(REPO / "data" / "demo_model") and r.data.path == str(REPO / "data" / "alpaca_sample.json")

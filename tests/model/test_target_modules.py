"""lora.target_modules as a user writes it (a list, a comma-separated string, one name, a regular
expression): the recipe, the memory model and peft agree on which modules train."""

from __future__ import annotations

import json

import pytest

from finetuner.config.recipe import Recipe
from finetuner.model.shapes import lora_param_count, resolve_shape
from tests.conftest import cli_in_process, write_recipe, HANG_GUARD_S


@pytest.mark.parametrize("given", [
    "q_proj",
    "q_proj,v_proj",
    "q_proj, o_proj, down_proj",
    "[gate_proj, up_proj]",
    r".*\.(q_proj|v_proj)",
    r"model\.layers\.0\.self_attn\.(k_proj|o_proj)",  # one layer only
    "all-linear",
])
def test_peft_trains_the_modules_the_memory_model_counts(recipe_dict, tiny_model_dir, given):
    from finetuner.config.runtime import resolve_runtime
    from finetuner.model.loading import load_base_model, prepare_for_training

    recipe = Recipe.from_dict(recipe_dict, overrides=[f"lora.target_modules={given}"])
    model = prepare_for_training(load_base_model(recipe, resolve_runtime(recipe)), recipe)
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable > 0
    assert lora_param_count(resolve_shape(str(tiny_model_dir)), recipe.lora.r, recipe.lora.target_modules) == trainable


def test_a_regular_expression_that_matches_nothing_is_a_clear_error(tiny_model_dir):
    from finetuner.errors import UserError

    with pytest.raises(UserError, match=r"matches no module of .*model\.layers\.0\.self_attn\.q_proj"):
        lora_param_count(resolve_shape(str(tiny_model_dir)), 8, r".*\.qkv")


def test_run_with_a_comma_separated_string_from_the_command_line(recipe_dict, tmp_path):
    recipe_dict["training"]["max_steps"] = 1
    path = write_recipe(tmp_path / "r.yaml", recipe_dict)
    p = cli_in_process("run", str(path), "-q", "--set", "lora.target_modules=q_proj,v_proj", timeout=HANG_GUARD_S)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    assert sorted(json.loads((run / "adapter" / "adapter_config.json").read_text())["target_modules"]) == ["q_proj", "v_proj"]
    start = next(e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == "start")
    assert start["event"] == "start" and start["predicted"] is not None

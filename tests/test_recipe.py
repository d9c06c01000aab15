"""The recipe schema: defaults, overrides, path resolution, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetuner.errors import UserError
from finetuner.recipe import Recipe
from tests.conftest import REPO

BASE = {"model": {"name": "org/model"}, "data": {"path": "org/dataset"}}


def err(raw, overrides=None) -> str:
    with pytest.raises(UserError) as e:
        Recipe.from_dict(raw, overrides=overrides)
    return str(e.value)


def test_defaults():
    r = Recipe.from_dict(BASE)
    assert r.method == "lora" and r.quantization is None
    assert r.model.trust_remote_code is False
    assert r.lora.target_modules == "all-linear"
    assert r.training.optimizer == "adamw_torch"
    assert r.output_path() == (Path.cwd() / "runs" / "run").resolve()


def test_qlora_defaults_to_4bit_nf4_double_quant():
    r = Recipe.from_dict({**BASE, "method": "qlora"})
    assert (r.quantization.bits, r.quantization.quant_type, r.quantization.double_quant) == (4, "nf4", True)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({**BASE, "modle": {}}, "modle: unknown key. Did you mean 'model'?"),
        ({**BASE, "training": {"optimzer": "sgd"}}, "training.optimzer: unknown key. Did you mean 'optimizer'?"),
        ({**BASE, "training": {"optimizer": "adamw8bit"}}, "training.optimizer: invalid value 'adamw8bit'. Did you mean 'adamw_8bit'?"),
        ({**BASE, "training": {"lr": "fast"}}, "training.lr: Input should be a valid number"),
        ({**BASE, "training": {"micro_batch_size": 0}}, "training.micro_batch_size"),
        ({**BASE, "lora": {"r": -1}}, "lora.r"),
        ({**BASE, "method": "qlora", "quantization": None}, "quantization: method 'qlora' needs a quantized base"),
        ({**BASE, "method": "lora", "quantization": {"bits": 4}}, "use method 'qlora'"),
        ({**BASE, "method": "full", "quantization": {"bits": 8}}, "method 'full' cannot train quantized weights"),
        ({**BASE, "method": "qlora", "quantization": {"quant_type": "nf5"}}, "quantization.quant_type: invalid value 'nf5'. Did you mean 'nf4'?"),
        ({**BASE, "training": {"warmup_steps": 5, "warmup_ratio": 0.1}}, "training.warmup_steps: set warmup_steps or warmup_ratio, not both"),
        ({**BASE, "name": "../escape"}, "name: use letters"),
        ({"data": {"path": "x"}}, "model: required key is missing"),
        ({**BASE, "method": "dora"}, "method: invalid value 'dora'"),
    ],
)
def test_errors_name_the_key(raw, expected):
    assert expected in err(raw)


def test_overrides_parse_yaml_values_and_create_sections():
    r = Recipe.from_dict(BASE, overrides=["training.lr=1e-4", "lora.target_modules=[q_proj, v_proj]", "method=qlora", "samples.prompts=[hi]"])
    assert r.training.lr == 1e-4 and r.lora.target_modules == ["q_proj", "v_proj"]
    assert r.method == "qlora" and r.samples.prompts == ["hi"]


def test_override_errors():
    assert "expected key.path=value" in err(BASE, ["training.lr"])
    assert "training.lrr: unknown key. Did you mean 'lr'?" in err(BASE, ["training.lrr=1"])
    assert "'model.name' is not a section" in err(BASE, ["model.name.x=1"])


def test_yaml_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  name: x\n data: [\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"bad.yaml: line \d+"):
        Recipe.from_yaml(p)
    p.write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="empty"):
        Recipe.from_yaml(p)
    p.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(UserError, match="not a UTF-8"):
        Recipe.from_yaml(p)
    with pytest.raises(UserError, match="not found"):
        Recipe.from_yaml(tmp_path / "missing.yaml")


def test_relative_paths_resolve_against_the_recipe_folder(tmp_path, monkeypatch):
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "d.jsonl").write_text("{}\n")
    sub = tmp_path / "recipes"
    sub.mkdir()
    p = sub / "r.yaml"
    p.write_text(yaml.safe_dump({"model": {"name": "../models/m"}, "data": {"path": "../d.jsonl"}}))
    monkeypatch.chdir("/")
    r = Recipe.from_yaml(p)
    assert r.model.name == str((tmp_path / "models" / "m").resolve())
    assert r.data.path == str((tmp_path / "d.jsonl").resolve())


def test_missing_local_paths_are_errors(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"model": {"name": "./nope"}, "data": {"path": "x.jsonl"}}))
    with pytest.raises(UserError, match="model.name: no folder './nope'"):
        Recipe.from_yaml(p)
    p.write_text(yaml.safe_dump({"model": {"name": "org/m"}, "data": {"path": "missing.jsonl"}}))
    with pytest.raises(UserError, match="data.path: file not found: 'missing.jsonl'"):
        Recipe.from_yaml(p)


def test_resolved_recipe_round_trips(tmp_path):
    r = Recipe.from_dict({**BASE, "method": "qlora", "training": {"max_steps": 3}})
    r.save(tmp_path / "recipe.yaml")
    again = Recipe.from_yaml(tmp_path / "recipe.yaml")
    assert again == r


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_are_valid(path):
    r = Recipe.from_yaml(path)
    assert r.model.trust_remote_code is False


def test_base_weight_offload_to_cpu_is_refused_with_alternatives(recipe_dict):
    from finetuner.errors import UserError
    from finetuner.recipe import Recipe

    recipe_dict["model"]["max_memory"] = {"0": "20GiB", "cpu": "64GiB"}
    with pytest.raises(UserError) as e:
        Recipe.from_dict(recipe_dict)
    msg = e.value.message
    assert "model.max_memory" in msg and "qlora" in msg and "zero3" in msg
    recipe_dict["model"]["max_memory"] = {"0": "20GiB", "1": "24GiB"}
    assert Recipe.from_dict(recipe_dict).model.max_memory == {"0": "20GiB", "1": "24GiB"}


def test_gpu_split_on_a_machine_without_those_gpus_is_a_clear_error(recipe_dict, tmp_path):
    from tests.conftest import run_cli, write_recipe

    recipe_dict["model"]["max_memory"] = {"0": "20GiB", "1": "24GiB"}
    res = run_cli("run", str(write_recipe(tmp_path / "r.yaml", recipe_dict)), "-q")
    assert res.returncode == 2 and "model.max_memory" in res.stderr and "Traceback" not in res.stderr

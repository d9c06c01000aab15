"""The model read from itself (finetuner/model/inventory.py): built on meta, its layout agrees with the one
written by hand for the 7 families, and other families with the same kind of layers plan and train."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from finetuner.errors import UserError
from finetuner.model import inventory
from finetuner.model.shapes import SUPPORTED_MODEL_TYPES, derived_shape, lora_param_count, resolve_shape, shape_from_config
from finetuner.model.tiny import tiny_config
from tests.conftest import cli_in_process

#: what a derived shape adds to a hand-written one (where it came from, not what it is)
PROVENANCE = {"derived", "layer_norm_params", "source", "config", "name"}
#: families with no layout written by hand whose layers the memory model describes (a sample of the census)
NEW_FAMILIES = ["granite", "olmo2", "smollm3", "glm4", "gemma3_text", "arcee"]


@pytest.fixture(scope="module")
def tok():
    from finetuner.model.tiny_llama import train_bpe_tokenizer
    from tests.conftest import corpus

    return train_bpe_tokenizer(corpus(), vocab_size=400)


def _tiny(model_type: str, tok) -> dict:
    return tiny_config(model_type, len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
@pytest.mark.parametrize("size", ["default", "tiny"])
def test_the_layout_read_from_the_model_is_the_hand_written_one(model_type, size, tok):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = _tiny(model_type, tok) if size == "tiny" else CONFIG_MAPPING[model_type]().to_dict()  # 2B to 7B shapes
    written, read = shape_from_config(cfg), derived_shape(cfg)
    for f in fields(written):
        if f.name not in PROVENANCE:
            assert getattr(read, f.name) == getattr(written, f.name), f.name
    assert read.param_counts() == written.param_counts() and read.layer_linears() == written.layer_linears()
    assert read.derived and not written.derived


def test_every_preset_reads_as_it_is_written():
    from finetuner.model.shapes import _presets

    for name, cfg in _presets().items():
        inv = inventory.read_inventory(cfg)
        shape = resolve_shape(name)
        assert inv.uniform and inv.params["total"] == shape.num_params, name
        assert {k: inv.params[k] for k in ("embeddings", "attention", "mlp", "lm_head")} == \
            {k: shape.param_counts()[k] for k in ("embeddings", "attention", "mlp", "lm_head")}, name
        assert inv.tied == shape.tie_word_embeddings and inv.num_layers == shape.num_layers


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_a_new_family_is_counted_exactly_plans_and_trains_two_lora_steps(model_type, tok, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    import finetuner
    from finetuner.config.recipe import Recipe
    from tests.conftest import alpaca_rows

    cfg = _tiny(model_type, tok)
    shape = derived_shape(cfg, name=model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}))
    assert shape.num_params == sum(p.numel() for p in model.parameters())  # to the last one
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert lora_param_count(shape, 4) == lora.get_nb_trainable_parameters()[0]
    model = lora.unload()
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    tok.save_pretrained(folder)

    plan = cli_in_process("plan", "--model", str(folder), "--gpu", "rtx4090", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "layout read from the model transformers builds" in plan.stdout

    data = tmp_path / "a.json"
    data.write_text(json.dumps(alpaca_rows(8)), encoding="utf-8")
    recipe = {"name": "t", "model": {"name": str(folder)}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
              "data": {"path": str(data), "max_seq_len": 32, "val_size": 0},
              "training": {"max_steps": 2, "lr": 1e-3, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0},
              "logging": {"tensorboard": False}, "output_dir": str(tmp_path / "run")}
    result = finetuner.train(Recipe.from_dict(recipe))
    assert len(result.losses) == 2 and all(0 < x < 20 for x in result.losses)
    assert (result.run_dir / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("model_type,says", [
    ("jetmoe", "its attention's linear layers are self_attention.kv_proj"),  # a mixture of attention heads
    ("mamba", "its decoder layer's linear layers are mixer."),
    ("qwen3_5_text", "its attention's linear layers are linear_attn.out_proj"),  # a hybrid's linear-attention layers
])
def test_a_layout_the_memory_model_does_not_describe_is_refused_in_one_line(model_type, says, tok):
    with pytest.raises(UserError) as e:
        shape_from_config(_tiny(model_type, tok), name=model_type)
    assert says in e.value.message and "\n" not in e.value.message and f"model_type '{model_type}" in e.value.message


def test_the_inventory_is_built_once_per_config(tok, monkeypatch):
    cfg = _tiny("granite", tok)
    first = inventory.read_inventory(cfg)
    monkeypatch.setattr(inventory, "inventory_of", lambda cfg: pytest.fail("built again"))
    assert inventory.read_inventory(cfg) == first
    assert inventory._key(cfg) != inventory._key({**cfg, "num_hidden_layers": 3})


def test_an_mlp_without_a_gate_has_two_linears_and_its_own_activation_terms(tok):
    from finetuner.memory.model import Settings, layer_activation_terms, layer_transient_per_token

    plain, gated = derived_shape(_tiny("arcee", tok), name="arcee"), derived_shape(_tiny("llama", tok))
    assert (plain.hidden_size, plain.intermediate_size) == (gated.hidden_size, gated.intermediate_size)
    assert not plain.gated_mlp and [lin.name for lin in plain.layer_linears()][-2:] == ["mlp.up_proj", "mlp.down_proj"]
    s = Settings()
    terms, gated_terms = dict(layer_activation_terms(plain, s)), dict(layer_activation_terms(gated, s))
    assert terms["MLP: up (activation input)"] == terms["MLP: activation output"] == gated_terms["MLP: up"]
    assert not any("gate" in t for t in terms) and "MLP: gate (activation input)" in gated_terms
    # one fewer intermediate-width gradient alive in the MLP's backward: the gate's
    assert layer_transient_per_token(gated, s) - layer_transient_per_token(plain, s) == gated_terms["MLP: up"]


def test_a_model_type_transformers_does_not_know_is_refused_naming_the_model(tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "nonsense_xyz", "hidden_size": 8}), encoding="utf-8")
    out = cli_in_process("plan", "--model", str(folder), "--gpu", "rtx4090", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "odd (config.json): model_type 'nonsense_xyz': this transformers does not know it" in out.stderr

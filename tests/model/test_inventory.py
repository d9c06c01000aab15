"""The model read from itself (finetuner/model/inventory.py): built on meta, its layout says what each family
is known to hold, the inventories shipped for the presets are what the installed transformers builds, and
families with the same kind of layers plan and train."""

from __future__ import annotations

import json

import pytest

from finetuner.errors import UserError
from finetuner.model import reading
from finetuner.model.shapes import SUPPORTED_MODEL_TYPES, lora_param_count, resolve_shape, shape_from_config
from tests.conftest import cli_in_process

#: what each family's decoder layers hold by default, from the families' papers and model cards (a plain one: no
#: bias, separate q/k/v and gate/up, two norms a layer, no q/k norm, no soft-capping, untied, a gated MLP)
PLAIN = {"attention_bias": False, "qkv_bias_only": False, "mlp_bias": False, "fused_qkv": False, "fused_gate_up": False,
         "norms_per_layer": 2, "qk_norm": False, "final_logit_softcapping": None, "tie_word_embeddings": False,
         "gated_mlp": True}
FAMILY_FACTS = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias_only": True},  # Qwen2: biases on q, k, v only
    "qwen3": {"qk_norm": True},  # Qwen3: RMSNorm on q and k per head, no biases
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True, "norms_per_layer": 4, "final_logit_softcapping": 30.0},  # pre+post norms
    "phi3": {"fused_qkv": True, "fused_gate_up": True},  # Phi-3: qkv_proj and gate_up_proj
}
#: families with no layout written by hand whose layers the memory model describes (a sample of the census)
NEW_FAMILIES = ["granite", "olmo2", "smollm3", "glm4", "gemma3_text", "arcee"]


@pytest.fixture(scope="module")
def tok():
    from finetuner.model.tiny_llama import train_bpe_tokenizer
    from tests.conftest import corpus

    return train_bpe_tokenizer(corpus(), vocab_size=400)


def _tiny(model_type: str, tok) -> dict:
    from tests.conftest import tiny_with_ids

    return tiny_with_ids(model_type, tok)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_the_layout_read_from_the_model_is_what_the_family_holds(model_type):
    """The per-family differences once written by hand (biases, fused projections, norms, tying, soft-capping)
    come out of the model transformers builds at the family's default (2B-7B) size."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]().to_dict()
    shape = shape_from_config(cfg)
    assert {k: getattr(shape, k) for k in PLAIN} == {**PLAIN, **FAMILY_FACTS[model_type]}
    assert shape.num_heads * shape.head_dim == cfg.get("num_attention_heads") * (cfg.get("head_dim") or shape.head_dim)
    assert shape.num_layers == cfg["num_hidden_layers"] and shape.hidden_size == cfg["hidden_size"]


def test_the_shipped_inventories_are_what_transformers_builds():
    """finetuner/model/inventories.json (what `finetuner plan` on a preset answers from, no torch) equals every
    preset and the demo model read again now; after a new preset or pin: `python -m scripts.dev.read_models`."""
    from scripts.dev.read_models import read_all

    stored, now = reading.packaged(), read_all()
    assert {v["name"] for v in stored["models"].values()} == {v["name"] for v in now["models"].values()}, \
        "a preset was added or removed: run `python -m scripts.dev.read_models`"
    for key, entry in now["models"].items():
        assert stored["models"].get(key) == json.loads(json.dumps(entry)), f"{entry['name']}: run `python -m scripts.dev.read_models`"


def test_every_preset_is_answered_from_the_shipped_inventory(monkeypatch, tmp_path):
    """No preset is built again, whatever the cache holds (an empty one here): a config that transformers completed
    in place (Llama 3.1's rope_scaling) once keyed the shipped file wrongly, and the torch-free replay imported torch
    whenever no other test had cached that model first."""
    from finetuner.model.shapes import preset_names

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(reading, "read_model", lambda cfg: pytest.fail("built a preset's model again"))
    assert resolve_shape("qwen3-30b-a3b").experts.count == 128
    for name in preset_names():
        assert resolve_shape(name).num_params > 0, name


def test_every_preset_reads_as_it_is_written():
    from finetuner.model.shapes import _presets

    for name, cfg in _presets().items():
        inv = reading.read_inventory(cfg)
        shape = resolve_shape(name)
        # every layer alike, but where the family mixes layer kinds (Qwen3.5's and Qwen3-Next's linear attention,
        # Nemotron-H's and Granite 4's Mamba-2 layers) or attention kinds whose layers differ, the kinds read being
        # the config's layer types (Gemma 4's full-attention layers: a wider head, keys that are the values)
        types = (cfg.get("text_config") or cfg).get("layer_types") or ()
        by_type = sorted(tuple(i for i, t in enumerate(types) if t == kind) for kind in set(types))
        mixed = shape.linear_attention_layers > 0 or shape.mixer_layers > 0 or sorted(k.indices for k in inv.kinds) == by_type
        assert (inv.uniform or mixed) and inv.params["total"] == shape.num_params, name
        if inv.uniform:  # (a mixed family's kinds: tests/model/test_shapes.py, against the meta model)
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
    shape = shape_from_config(cfg, name=model_type)
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
    assert f"{model_type} itself not measured" in " ".join(plan.stdout.split())  # as rich wraps it at any width

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
])
def test_a_layout_the_memory_model_does_not_describe_is_refused_in_one_line(model_type, says, tok):
    with pytest.raises(UserError) as e:
        shape_from_config(_tiny(model_type, tok), name=model_type)
    assert says in e.value.message and "\n" not in e.value.message and f"model_type '{model_type}" in e.value.message


def test_the_inventory_is_built_once_per_config(tok, monkeypatch):
    cfg = _tiny("granite", tok)
    first = reading.read_inventory(cfg)
    monkeypatch.setattr(reading, "read_model", lambda cfg: pytest.fail("built again"))
    assert reading.read_inventory(cfg) == first
    assert reading._key(cfg) != reading._key({**cfg, "num_hidden_layers": 3})
    # other reading code (a layout that learned a family) reads it again: the key names the code's digest
    key = reading._key(cfg)
    monkeypatch.setattr(reading, "_CODE", ["another-reading"])
    assert reading._key(cfg) != key and reading.code_digest() == "another-reading"
    monkeypatch.undo()
    assert len(reading.code_digest()) == 12 and reading._key(cfg) == key


def test_an_mlp_without_a_gate_has_two_linears_and_its_own_activation_terms(tok):
    from finetuner.memory.activations import layer_activation_terms, layer_transient_per_token
    from finetuner.memory.model import Settings

    plain, gated = shape_from_config(_tiny("arcee", tok), name="arcee"), shape_from_config(_tiny("llama", tok))
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

"""Layouts read from the model (finetuner/model/layout.py): families that name their linears otherwise (GPT-2's
Conv1D, OPT's fc1/fc2, Falcon's fused query_key_value ...) and mixtures of experts are counted to the last
parameter, their LoRA counted as peft builds it, and a mixture of experts trains with its load-balancing loss."""

from __future__ import annotations

import pytest

from finetuner.model.shapes import shape_from_config, lora_param_count, lora_targets
from finetuner.model.tiny import tiny_config

RENAMED = ["gpt2", "opt", "falcon", "bloom", "phi", "biogpt", "gpt_neox", "mpt", "bert-generation", "starcoder2"]
MOE = ["mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe", "gpt_oss", "phimoe"]


def _build(cfg: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))


def _counted(model_type: str):
    """A tiny ``model_type``'s shape read from the model and the model itself, counted equal to the last parameter."""
    cfg = tiny_config(model_type, 400)
    shape, model = shape_from_config(cfg, name=model_type), _build(cfg)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    return shape, model


def _lora_counted_as_peft_builds_it(shape, model, targets) -> None:
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert not lora.peft_config["default"].target_parameters  # peft added no LoRA on fused experts
    assert lora_param_count(shape, 4) == lora.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("model_type", RENAMED)
def test_a_family_with_its_own_names_is_counted_as_peft_and_transformers_build_it(model_type):
    shape, model = _counted(model_type)
    assert {role for role, _ in shape.roles} >= {"o_proj", "down_proj"}  # every linear found its role
    _lora_counted_as_peft_builds_it(shape, model, "all-linear")


def test_the_roles_of_gpt2s_conv1d_layers():
    shape = shape_from_config(tiny_config("gpt2", 400), name="gpt2")
    assert dict(shape.roles) == {"qkv_proj": "attn.c_attn", "o_proj": "attn.c_proj", "up_proj": "mlp.c_fc",
                                 "down_proj": "mlp.c_proj"}
    assert shape.fused_qkv and not shape.gated_mlp and shape.layers_path == "transformer.h"
    assert [t[0] for t in lora_targets(shape, r"transformer\.h\.0\.attn\.c_attn")] == ["attn.c_attn"]


@pytest.mark.parametrize("model_type", MOE)
def test_a_mixture_of_experts_is_counted_and_its_lora_is_the_attention_finetuner_targets(model_type):
    from finetuner.model.layout import all_linear_targets

    shape, model = _counted(model_type)
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3}
    e = shape.experts
    assert e.numel == sum(p.numel() for p in experts.values()) and e.count == next(iter(experts.values())).shape[0]
    assert e.top_k == 2 and e.layers == len({n.split(".experts.")[0] for n in experts})
    assert shape.active_weight_numel == shape.linear_weight_numel + e.numel * e.top_k // e.count
    targets = all_linear_targets(model)
    assert targets and all("attn" in t for t in targets)  # attention only: no router, expert or shared expert
    _lora_counted_as_peft_builds_it(shape, model, targets)


def test_dense_first_layers_and_shared_experts_are_counted_where_they_are():
    shape = shape_from_config(tiny_config("glm4_moe", 400), name="glm4_moe")  # layer 0 dense, layer 1 routed + shared
    dense = [lin for lin in shape.layer_linears() if lin.name.startswith("mlp.") and "shared" not in lin.name]
    shared = [lin for lin in shape.layer_linears() if "shared_experts" in lin.name]
    assert dense and all(lin.layers == (0,) for lin in dense) and all(lin.layers == (1,) for lin in shared)
    assert shape.experts.layers == 1 and shape.experts.shared_intermediate == 32
    assert shape.linear_count == 4 * 2 + 3 + 3


def test_the_experts_activation_terms_scale_with_the_experts_per_token():
    from dataclasses import replace

    from finetuner.memory.activations import layer_activation_terms
    from finetuner.memory.model import Settings

    shape = shape_from_config(tiny_config("qwen3_moe", 400), name="qwen3_moe")
    two = dict(layer_activation_terms(shape, Settings()))
    four = dict(layer_activation_terms(replace(shape, experts=replace(shape.experts, top_k=4)), Settings()))
    assert four["experts: gate, activation and up of 4 experts"] == 2 * two["experts: gate, activation and up of 2 experts"]
    c = 2  # bf16
    assert two["experts: gate, activation and up of 2 experts"] == 2 * 3 * c * shape.experts.intermediate
    assert "MoE router: logits and probabilities (fp32)" in two


def test_training_adds_the_load_balancing_loss_as_transformers_does_and_evaluation_does_not():
    import torch

    from finetuner.model.scoring import router_balance, token_loss_sum

    model = _build(tiny_config("mixtral", 400))
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    out = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids, output_router_logits=True)
    assert out.aux_loss is not None and router_balance(model)[1] == model.config.router_aux_loss_coef
    loss, n = token_loss_sum(model, batch, chunk_size=8)
    # transformers: mean cross-entropy + coef x aux; here the sum over the n tokens, each with coef x aux
    assert float(loss) / n == pytest.approx(float(out.loss), rel=1e-5)
    with torch.no_grad():
        plain, _ = token_loss_sum(model, batch, chunk_size=8)
        ce = float(model(input_ids=ids, labels=ids).loss)
    assert float(plain) / n == pytest.approx(ce, rel=1e-5) and float(plain) < float(loss)
    assert router_balance(_build(tiny_config("llama", 400))) is None


@pytest.mark.parametrize("model_type", ["beam", "doge", "minimax", "mimo_v2_flash", "glm4_moe_lite", "afmoe", "deepseek_v3",
                                        "deepseek_v4"])
def test_attention_with_more_than_q_k_v_o_is_counted_with_its_extras(model_type):
    """An output gate (Beam, MiniMax, AFMoE), Doge's dt_proj, latent attention's low-rank projections
    (glm4_moe_lite, DeepSeek-V3), DeepSeek-V4's grouped output, layers whose attention differs (MiMo-V2-Flash): counted to the last parameter, LoRA as peft builds it."""
    from finetuner.memory.activations import layer_activation_terms
    from finetuner.memory.model import Settings
    from finetuner.model.layout import all_linear_targets

    shape, model = _counted(model_type)
    if model_type != "mimo_v2_flash":
        assert shape.attention_extras
        terms = dict(layer_activation_terms(shape, Settings()))
        for path, _, out in shape.attention_extras:
            assert terms[f"{path}: output (and what reads it)"] == 2 * 2 * out
    _lora_counted_as_peft_builds_it(shape, model, all_linear_targets(model))


def test_a_linear_with_a_forward_of_its_own_is_frozen_and_never_a_lora_target():
    """DeepSeek-V4's grouped o_a_proj is a Linear subclass that uses its weight its own way: peft's LoRA
    wrapper crashed its forward. It is counted, held frozen, and left out of all-linear on both sides."""
    from finetuner.model.layout import all_linear_targets

    cfg = tiny_config("deepseek_v4", 400)
    shape = shape_from_config(cfg, name="deepseek_v4")
    assert ("frozen", "self_attn.o_a_proj") in shape.roles
    assert "self_attn.o_a_proj" not in [t[0] for t in lora_targets(shape, "all-linear")]
    assert "self_attn.o_a_proj" not in all_linear_targets(_build(cfg))
    assert all_linear_targets(_build(tiny_config("llama", 400))) == "all-linear"  # a dense model: peft's own


def test_a_config_that_leaves_sizes_to_transformers_defaults_is_read_with_them():
    """google/gemma-3-4b-it's published config names no head count, key/value heads or head width (Gemma3TextConfig's
    defaults: 8, 4, 256): the layout is read with the values transformers built the model with."""
    cfg = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    shape = shape_from_config(cfg, name="gemma-3-4b-text")
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (8, 4, 256)

"""Nemotron-H (``nemotron_h``) as llama.cpp's converter (``NemotronHModel``) writes it: each layer one block, a
Mamba-2 mixer, attention without positions, a squared-ReLU MLP, or (with ``moe`` layers, llama.cpp's
``nemotron_h_moe``) squared-ReLU experts routed by a sigmoid with a correction bias, beside a shared expert.

llama.cpp tells the blocks apart by two per-layer arrays: the key-value heads (0 but for attention) and the
feed-forward width (the MLP's, or the experts' width for an experts layer, 0 else); a layer with neither is a Mamba
layer. The Mamba-2 tensors as Mamba-2's (``A`` and ``D`` as columns, the gated norm one row a group, ``dt_bias`` as
``dt.bias``); transformers' stacked experts ``(experts, out, in)`` are llama.cpp's stacks as they are, named as the
converter names them once it has stacked a checkpoint's experts. Nemotron-H's attention turns no positions, so the
queries and keys are written as they are.

Refused: dense MLP layers beside expert layers (llama.cpp reads every feed-forward layer of a model with experts as
experts; Nemotron-H's checkpoints have one or the other), projection or MLP biases, a clamped dt, activations other
than squared ReLU (the MLPs) and SiLU (the Mamba layers), the experts' latent projection (``moe_latent_size``),
grouped routing (``n_group`` above 1), and the multi-token prediction head (``num_nextn_predict_layers``).
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError
from finetuner.export.gguf_recurrent import clamps_dt, mamba2_shape

#: llama.cpp's architecture without experts, and with them
ARCH, ARCH_MOE = "nemotron_h", "nemotron_h_moe"
ARCHES = (ARCH, ARCH_MOE)


def pattern(config: dict[str, Any]) -> list[str]:
    """Each layer's block: ``mamba``, ``attention``, ``mlp`` or ``moe`` (``layers_block_type``, transformers 5's names
    for Mamba and attention, or the checkpoints' ``hybrid_override_pattern``: M, *, -, E)."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if isinstance(types, list):
        rename = {"linear_attention": "mamba", "full_attention": "attention"}
        return [rename.get(t, t) for t in types]
    letters = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    return [letters[c] for c in str(config.get("hybrid_override_pattern") or "")]


def arch_of(config: dict[str, Any]) -> str:
    return ARCH_MOE if "moe" in pattern(config) else ARCH


def inner_size(config: dict[str, Any]) -> int:
    """The scan width (the converter's: heads x head width)."""
    return int(config["mamba_num_heads"]) * int(config["mamba_head_dim"])


def check(config: dict[str, Any], where: str) -> None:
    """Refuse (a UserError naming the setting) what llama.cpp's nemotron_h would run otherwise than transformers."""
    blocks = pattern(config)
    layers = int(config.get("num_hidden_layers") or len(blocks))
    if not blocks or len(blocks) != layers or not set(blocks) <= {"mamba", "attention", "mlp", "moe"}:
        raise UserError(f"{where}: its layer pattern {blocks} is not one block of mamba, attention, mlp or moe for each "
                        f"of its {layers} layers; GGUF export refuses it.")
    if "moe" in blocks and "mlp" in blocks:
        raise UserError(f"{where}: dense MLP layers beside expert layers are not llama.cpp's nemotron_h_moe (it reads "
                        "every feed-forward layer of a model with experts as experts); GGUF export refuses it.")
    if config.get("mamba_proj_bias") or config.get("use_bias") or config.get("attention_bias") or config.get("mlp_bias") \
            or not config.get("use_conv_bias", True):
        raise UserError(f"{where}: mamba_proj_bias, use_bias, attention_bias, mlp_bias or use_conv_bias=false is not "
                        "written for llama.cpp's nemotron_h by finetuner (no projection bias, a convolution bias); GGUF "
                        "export refuses it.")
    if clamps_dt(config) or (config.get("mamba_hidden_act") or "silu") != "silu" \
            or (config.get("mlp_hidden_act") or "relu2") != "relu2":
        raise UserError(f"{where}: time_step_limit {config.get('time_step_limit')}, mamba_hidden_act "
                        f"{config.get('mamba_hidden_act')} or mlp_hidden_act {config.get('mlp_hidden_act')} is not llama.cpp's "
                        "nemotron_h (dt unclamped, SiLU, squared ReLU); GGUF export refuses it.")
    if config.get("moe_latent_size") or int(config.get("n_group") or 1) != 1 \
            or int(config.get("num_nextn_predict_layers") or 0):
        raise UserError(f"{where}: moe_latent_size {config.get('moe_latent_size')}, n_group {config.get('n_group')} or "
                        f"num_nextn_predict_layers {config.get('num_nextn_predict_layers')} is not written for llama.cpp's "
                        "nemotron_h by finetuner (no latent projection, one routing group, no prediction head); GGUF "
                        "export refuses it.")
    if inner_size(config) % int(config.get("n_groups") or 1):
        raise UserError(f"{where}: the scan width {inner_size(config)} is not in whole groups of n_groups "
                        f"{config.get('n_groups')}; GGUF export refuses it.")


def write_metadata(writer, config: dict[str, Any], n_layers: int) -> None:
    """Nemotron-H's GGUF metadata, as the converter (``NemotronHModel.set_gguf_parameters``) writes it."""
    blocks = pattern(config)
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    eps = float(config.get("layer_norm_epsilon") or 1e-5)
    moe = arch_of(config) == ARCH_MOE
    width = {"mlp": int(config["intermediate_size"]), "moe": int(config.get("moe_intermediate_size") or 0)}
    writer.add_block_count(n_layers)
    writer.add_context_length(2**20)  # no positions: the converter's
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length([width.get(b, 0) for b in blocks])
    writer.add_head_count(heads)
    writer.add_head_count_kv([kv if b == "attention" else 0 for b in blocks])
    writer.add_key_length(int(config["head_dim"]))
    writer.add_value_length(int(config["head_dim"]))
    writer.add_layer_norm_eps(eps)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_rope_scaling_finetuned(False)
    writer.add_ssm_conv_kernel(int(config.get("conv_kernel") or 4))
    writer.add_ssm_state_size(int(config["ssm_state_size"]))
    writer.add_ssm_group_count(int(config.get("n_groups") or 1))
    writer.add_ssm_inner_size(inner_size(config))
    writer.add_ssm_time_step_rank(int(config["mamba_num_heads"]))
    if moe:  # the routed experts (sigmoid, a correction bias) and the shared one
        writer.add_expert_count(int(config["n_routed_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        writer.add_expert_shared_feed_forward_length(int(config["moe_shared_expert_intermediate_size"]))
        writer.add_expert_shared_count(int(config.get("n_shared_experts") or 1))
        writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", True)))
        writer.add_expert_weights_scale(float(config.get("routed_scaling_factor") or 1.0))
        writer.add_expert_group_count(int(config.get("n_group") or 1))


def source_key(own: str) -> str:
    """The checkpoint name gguf's map knows the tensor by: the checkpoints' ``backbone.`` prefix, ``dt_bias`` as
    ``dt.bias``, the routing correction as ``e_score_correction.bias``, stacked experts as the converter names them."""
    if own.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):  # (stacked: transformers', or finetuner's)
        return own.replace("backbone.layers.", "model.layers.", 1).replace(".mixer.experts.", ".mlp.experts.")
    own = own.replace("model.layers.", "backbone.layers.", 1)
    if own.endswith(".dt_bias"):
        return own[: -len("_bias")] + ".bias"
    return own[: -len("_bias")] + ".bias" if own.endswith("e_score_correction_bias") else own


def stored_shape(config: dict[str, Any], hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`transform` gives a tensor of ``shape`` (a Mamba mixer's as Mamba-2's)."""
    mamba = hf_name.endswith((".A_log", ".D", "conv1d.weight", "mixer.norm.weight"))
    return mamba2_shape(hf_name, shape, int(config.get("n_groups") or 1)) if mamba else shape


def transform(config: dict[str, Any], hf_name: str, w):
    """The tensor as the converter stores it (a float32 numpy array in, one out): ``A`` as ``-exp(A_log)``, a Mamba
    mixer's tensors reshaped as Mamba-2's."""
    if hf_name.endswith(".A_log"):
        import numpy as np

        w = -np.exp(w)
    return w.reshape(stored_shape(config, hf_name, w.shape))

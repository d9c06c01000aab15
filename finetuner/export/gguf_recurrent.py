"""Mamba, Falcon-Mamba, Mamba-2 and LFM2 as llama.cpp's converter (``convert_hf_to_gguf.py``) writes them: their
metadata, their tensors.

Mamba (``mamba``): no attention; the selective scan's widths (``ssm.*``), ``A`` stored as ``-exp(A_log)`` (llama.cpp
runs ``A``; transformers' GGUF loader takes the log back), the depthwise convolution's ``(channels, 1, kernel)``
weight squeezed to ``(channels, kernel)``, the context length the converter's 2**20 where the config sets none.
llama.cpp's mamba has no bias on the in- and out-projections and one on the convolution: other settings are refused.
Falcon-Mamba (``falcon_mamba``) is llama.cpp's mamba with ``ssm.dt_b_c_rms`` set: the weightless RMS norms on dt, B and
C, which llama.cpp computes with ``layer_norm_epsilon`` (transformers with ``mixer_rms_eps``; llama.cpp's converter
writes no other, and the logits check measures what the two epsilons change).

Mamba-2 (``mamba2``): the scan's heads (``ssm.time_step_rank``) and groups (``ssm.group_count``); ``A`` as
``-exp(A_log)`` and ``D`` as ``(heads, 1)`` columns, the gated output norm as ``(groups, width / groups)`` (llama.cpp
normalises each group, as transformers' ``MambaRMSNormGated`` does), ``dt_bias`` as the converter names it
(``dt_proj.bias``). Refused: projection biases, a convolution without one, heads that do not tile the scan width,
and a ``time_step_limit`` other than (0, inf) (llama.cpp does not clamp dt).

LFM2 (``lfm2``): short-convolution layers and attention layers; llama.cpp tells them apart by each layer's key-value
head count (0 for a convolution layer), reads the feed-forward width as the model built it (``block_auto_adjust_ff_dim``
applied), and the convolution's weight ``(channels, 1, L)`` as ``(channels, L)``. llama.cpp's lfm2 has no
convolution bias and finetuner writes no RoPE scaling for it: a model with either is refused.
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError

#: transformers ``model_type`` → llama.cpp architecture, for the families this module writes
RECURRENT = {"mamba": "mamba", "falcon_mamba": "mamba", "mamba2": "mamba2", "lfm2": "lfm2", "lfm2_moe": "lfm2moe"}
#: the families whose scan is Mamba's (selective, with a convolution before it)
MAMBAS = ("mamba", "falcon_mamba", "mamba2")
#: the families of LFM2's short convolutions (LFM2-MoE: with routed experts after its first dense layers)
LFM2S = ("lfm2", "lfm2_moe")
#: 2-D tensors llama.cpp's converter keeps in float32 whatever the file type (its CPU convolution reads float32 only:
#: ``GGML_ASSERT(src1->nb[0] == sizeof(float))`` in ggml's ``ssm_conv`` otherwise; Mamba-2's grouped norm, a norm)
F32_ALWAYS = ("ssm_conv1d.weight", "shortconv.conv.weight", "ssm_norm.weight")


def check(config: dict[str, Any], where: str) -> None:
    """Refuse (a UserError naming the setting) what llama.cpp's architecture would run otherwise than transformers."""
    mt = config.get("model_type")
    if mt in MAMBAS:
        if config.get("use_bias") or not config.get("use_conv_bias", True):
            raise UserError(f"{where}: use_bias={config.get('use_bias')}, use_conv_bias={config.get('use_conv_bias')} is not "
                            "llama.cpp's mamba (no projection bias, a convolution bias); GGUF export refuses it.")
    if mt == "mamba2":
        check_mamba2(config, where)
    elif mt in MAMBAS:
        if inner_size(config) != 2 * int(config["hidden_size"]):
            raise UserError(f"{where}: intermediate_size {inner_size(config)} is not twice hidden_size, which llama.cpp's "
                            "converter requires of mamba; GGUF export refuses it.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if mt in LFM2S and (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise UserError(f"{where}: RoPE scaling '{rope.get('rope_type') or rope.get('type')}' is not written for llama.cpp's "
                        "lfm2 by finetuner (its positions unscaled); GGUF export refuses it.")
    if mt in LFM2S and config.get("conv_bias"):
        raise UserError(f"{where}: conv_bias=true is not llama.cpp's lfm2 (its short convolution has no bias); GGUF "
                        "export refuses it.")
    if mt == "lfm2_moe" and (not config.get("norm_topk_prob", True) or not config.get("use_expert_bias", True)
                             or float(config.get("routed_scaling_factor") or 1.0) != 1.0):
        raise UserError(f"{where}: norm_topk_prob={config.get('norm_topk_prob')}, use_expert_bias="
                        f"{config.get('use_expert_bias')}, routed_scaling_factor={config.get('routed_scaling_factor')} is not "
                        "llama.cpp's lfm2moe (the chosen experts' weights renormalised, a routing bias, no scale); GGUF "
                        "export refuses it.")


def check_mamba2(config: dict[str, Any], where: str) -> None:
    """Refuse a Mamba-2 whose heads do not tile its scan width, or whose dt is clamped (llama.cpp's mamba2 does not)."""
    heads, head = int(config["num_heads"]), int(config.get("head_dim") or 64)
    if heads * head != inner_size(config) or inner_size(config) % int(config.get("n_groups") or 1):
        raise UserError(f"{where}: num_heads {heads} x head_dim {head} is not the scan width {inner_size(config)} (expand x "
                        "hidden_size) in whole groups, as llama.cpp's mamba2 reads it; GGUF export refuses it.")
    if clamps_dt(config):
        raise UserError(f"{where}: time_step_limit {config.get('time_step_limit')} clamps dt, which llama.cpp's mamba2 "
                        "does not; GGUF export refuses it.")


def clamps_dt(config: dict[str, Any]) -> bool:
    """Whether a Mamba-2 scan clamps dt (``time_step_limit`` other than (0, inf)), which llama.cpp never does."""
    from finetuner.model.inventory import special_floats  # the file's {"__float__": "Infinity"}, as transformers reads it

    low, high = (list(special_floats(config.get("time_step_limit")) or [0.0, float("inf")]) + [0.0, float("inf")])[:2]
    return float(low) != 0.0 or float(high) != float("inf")


def mamba2_shape(hf_name: str, shape: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """A Mamba-2 mixer's tensor as llama.cpp reads it: the convolution squeezed to (channels, kernel), ``A`` and ``D`` as
    (heads, 1) columns (llama.cpp broadcasts them so), the gated norm one row a group."""
    if hf_name.endswith("conv1d.weight"):
        return (shape[0], shape[-1])
    if hf_name.endswith((".A_log", ".D")):
        return (shape[0], 1)
    if hf_name.endswith("norm.weight"):
        return (groups, shape[0] // groups)
    return shape


def inner_size(config: dict[str, Any]) -> int:
    """Mamba's scan width (``intermediate_size``, else ``expand`` x ``hidden_size`` as MambaConfig sets it)."""
    return int(config.get("intermediate_size") or int(config.get("expand", 2)) * int(config["hidden_size"]))


def lfm2_ff_width(config: dict[str, Any]) -> int:
    """The feed-forward width LFM2 builds (transformers' ``Lfm2MLP``), which llama.cpp reads from the file."""
    width = int(config["intermediate_size"])
    if config.get("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        if config.get("block_ffn_dim_multiplier") is not None:
            width = int(config["block_ffn_dim_multiplier"] * width)
            step = int(config["block_multiple_of"])
            width = step * ((width + step - 1) // step)
    return width


def lfm2_attention_layers(config: dict[str, Any]) -> list[bool]:
    """Which LFM2 layers attend (``layer_types``, else ``full_attn_idxs``)."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types:
        return [t == "full_attention" for t in types]
    return [i in set(config.get("full_attn_idxs") or []) for i in range(n)]


def write_metadata(writer, config: dict[str, Any], n_layers: int) -> None:
    """The family's GGUF metadata, as llama.cpp's converter writes it."""
    mt = config["model_type"]
    writer.add_block_count(n_layers)
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    if mt in MAMBAS:
        hidden = int(config["hidden_size"])
        rank = config.get("time_step_rank")
        writer.add_context_length(int(config.get("max_position_embeddings") or 2**20))
        writer.add_feed_forward_length(0)  # unused by llama.cpp's mamba, but read when loading
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(int(config.get("conv_kernel") or 4))
        writer.add_ssm_inner_size(inner_size(config))
        writer.add_ssm_state_size(int(config.get("state_size") or 16))
        writer.add_layer_norm_rms_eps(float(config.get("layer_norm_epsilon") or 1e-5))
        if mt == "mamba2":  # the scan's heads and the groups its B, C and output norm share
            writer.add_ssm_time_step_rank(int(config["num_heads"]))
            writer.add_ssm_group_count(int(config.get("n_groups") or 1))
            return
        writer.add_ssm_time_step_rank(int(rank) if rank not in (None, "auto") else -(hidden // -16))
        writer.add_ssm_dt_b_c_rms(mt == "falcon_mamba")  # Falcon-Mamba's norms on dt, B and C
        return
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_feed_forward_length(lfm2_ff_width(config))
    writer.add_head_count(heads)
    writer.add_head_count_kv([kv if attends else 0 for attends in lfm2_attention_layers(config)])
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 1e6))
    writer.add_layer_norm_rms_eps(float(config.get("norm_eps") or 1e-5))
    writer.add_shortconv_l_cache(int(config["conv_L_cache"]))
    if mt == "lfm2_moe":  # the experts after the first dense layers, routed by a sigmoid (LFM2MoeModel's keys)
        import gguf

        writer.add_expert_count(int(config["num_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        writer.add_leading_dense_block_count(int(config["num_dense_layers"]))
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def squeezed(model_type: str, hf_name: str) -> bool:
    """Whether the tensor is a depthwise convolution's ``(channels, 1, kernel)`` weight, stored ``(channels, kernel)``."""
    return (model_type in MAMBAS and hf_name.endswith("conv1d.weight")) or \
        (model_type in LFM2S and hf_name.endswith("conv.conv.weight"))


def stored_shape(config: dict[str, Any], hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`transform` gives a tensor of ``shape``."""
    mt = config["model_type"]
    if mt == "mamba2" and ".mixer." in hf_name:
        return mamba2_shape(hf_name, shape, int(config.get("n_groups") or 1))
    return (shape[0], shape[-1]) if squeezed(mt, hf_name) else shape


def source_key(own: str) -> str:
    """The checkpoint name gguf's map knows the tensor by (the converter's renames: Mamba-2's ``dt_bias`` as
    ``dt_proj.bias``, LFM2-MoE's routing ``expert_bias`` as ``expert_bias.bias``)."""
    if own.endswith(".dt_bias"):
        return own[: -len(".dt_bias")] + ".dt_proj.bias"
    return own + ".bias" if own.endswith(".expert_bias") else own


def transform(config: dict[str, Any], hf_name: str, w):
    """The tensor as llama.cpp's converter stores it (a float32 numpy array in, one out)."""
    if config["model_type"] in MAMBAS and hf_name.endswith(".A_log"):
        import numpy as np

        w = -np.exp(w)
    return w.reshape(stored_shape(config, hf_name, w.shape))

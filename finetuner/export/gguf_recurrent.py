"""Mamba and LFM2 as llama.cpp's converter (``convert_hf_to_gguf.py``) writes them: their metadata, their tensors.

Mamba (``mamba``): no attention; the selective scan's widths (``ssm.*``), ``A`` stored as ``-exp(A_log)`` (llama.cpp
runs ``A``; transformers' GGUF loader takes the log back), the depthwise convolution's ``(channels, 1, kernel)``
weight squeezed to ``(channels, kernel)``, the context length the converter's 2**20 where the config sets none.
llama.cpp's mamba has no bias on the in- and out-projections and one on the convolution: other settings are refused.

LFM2 (``lfm2``): short-convolution layers and attention layers; llama.cpp tells them apart by each layer's key-value
head count (0 for a convolution layer), reads the feed-forward width as the model built it (``block_auto_adjust_ff_dim``
applied), and the convolution's weight ``(channels, 1, L)`` as ``(channels, L)``. llama.cpp's lfm2 has no
convolution bias and finetuner writes no RoPE scaling for it: a model with either is refused.
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError

#: transformers ``model_type`` → llama.cpp architecture, for the families this module writes
RECURRENT = {"mamba": "mamba", "lfm2": "lfm2"}
#: 2-D tensors llama.cpp's converter keeps in float32 whatever the file type (its CPU convolution reads float32 only:
#: ``GGML_ASSERT(src1->nb[0] == sizeof(float))`` in ggml's ``ssm_conv`` otherwise)
F32_ALWAYS = ("ssm_conv1d.weight", "shortconv.conv.weight")


def check(config: dict[str, Any], where: str) -> None:
    """Refuse (a UserError naming the setting) what llama.cpp's architecture would run otherwise than transformers."""
    mt = config.get("model_type")
    if mt == "mamba":
        if config.get("use_bias") or not config.get("use_conv_bias", True):
            raise UserError(f"{where}: use_bias={config.get('use_bias')}, use_conv_bias={config.get('use_conv_bias')} is not "
                            "llama.cpp's mamba (no projection bias, a convolution bias); GGUF export refuses it.")
        if inner_size(config) != 2 * int(config["hidden_size"]):
            raise UserError(f"{where}: intermediate_size {inner_size(config)} is not twice hidden_size, which llama.cpp's "
                            "converter requires of mamba; GGUF export refuses it.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if mt == "lfm2" and (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise UserError(f"{where}: RoPE scaling '{rope.get('rope_type') or rope.get('type')}' is not written for llama.cpp's "
                        "lfm2 by finetuner (its positions unscaled); GGUF export refuses it.")
    if mt == "lfm2" and config.get("conv_bias"):
        raise UserError(f"{where}: conv_bias=true is not llama.cpp's lfm2 (its short convolution has no bias); GGUF "
                        "export refuses it.")


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
    if mt == "mamba":
        hidden = int(config["hidden_size"])
        rank = config.get("time_step_rank")
        writer.add_context_length(int(config.get("max_position_embeddings") or 2**20))
        writer.add_feed_forward_length(0)  # unused by llama.cpp's mamba, but read when loading
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(int(config.get("conv_kernel") or 4))
        writer.add_ssm_inner_size(inner_size(config))
        writer.add_ssm_state_size(int(config.get("state_size") or 16))
        writer.add_ssm_time_step_rank(int(rank) if rank not in (None, "auto") else -(hidden // -16))
        writer.add_layer_norm_rms_eps(float(config.get("layer_norm_epsilon") or 1e-5))
        writer.add_ssm_dt_b_c_rms(False)  # Falcon-Mamba's norms on dt, B and C: not plain Mamba's
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


def squeezed(model_type: str, hf_name: str) -> bool:
    """Whether the tensor is a depthwise convolution's ``(channels, 1, kernel)`` weight, stored ``(channels, kernel)``."""
    return (model_type == "mamba" and hf_name.endswith("conv1d.weight")) or \
        (model_type == "lfm2" and hf_name.endswith("conv.conv.weight"))


def stored_shape(model_type: str, hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`transform` gives a tensor of ``shape``."""
    return (shape[0], shape[-1]) if squeezed(model_type, hf_name) else shape


def transform(model_type: str, hf_name: str, w):
    """The tensor as llama.cpp's converter stores it (a float32 numpy array in, one out)."""
    if model_type == "mamba" and hf_name.endswith(".A_log"):
        import numpy as np

        return -np.exp(w)
    if squeezed(model_type, hf_name):
        return w.reshape(stored_shape(model_type, hf_name, w.shape))
    return w

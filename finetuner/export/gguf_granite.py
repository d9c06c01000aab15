"""Granite 4.0-H (``granitemoehybrid``) and Bamba (``bamba``) as llama.cpp's converter (``GraniteHybridModel``) writes
them: llama.cpp's ``granitehybrid``, Mamba-2 layers beside attention layers, each followed by routed experts and a
shared one (Granite 4.0-H) or a dense MLP (Bamba).

Its Mamba-2 layers' tensors as Mamba-2's (``A`` and ``D`` as columns, the gated norm one row a group, ``dt_bias`` as
``dt_proj.bias``); llama.cpp tells the layer kinds apart by each layer's key-value head count (0 for a Mamba layer).
The experts' fused ``input_linear`` (gate rows, then up rows) and the shared MLP's are split into llama.cpp's gate and
up tensors; the queries and keys are permuted as Llama's are (the converter's ``undo_permute``). Granite's four
multipliers go into ``attention.scale``, ``embedding_scale``, ``residual_scale`` and ``logit_scale``. Granite 4.0-H
uses no position embedding (``position_embedding_type`` other than ``rope``): written with RoPE switched off
(``rope.scaling.finetuned`` false), as the converter writes it for a model with Mamba layers.

Bamba turns the positions of only the first half of each head (``partial_rotary_factor`` 0.5, rotating halves of
that part): written with RoPE on, ``rope.dimension_count`` that part, and only that part of each query and key head
permuted to llama.cpp's interleaved pairs (the rest as it is; the converter permutes the whole head, which
llama.cpp's ``n_rot`` of that part would not turn as transformers does), no multipliers (llama.cpp's attention
scale then 1/sqrt(head width), as transformers').

Refused: RoPE with Mamba layers in Granite 4.0-H (llama.cpp's granitehybrid would not turn the positions), projection biases or a
convolution without one, heads that do not tile the scan width, a clamped dt (``time_step_limit``), and an activation
other than SiLU.
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError
from finetuner.export.gguf_recurrent import clamps_dt, mamba2_shape

ARCH = "granitehybrid"


#: the transformers model types written as granitehybrid
MODEL_TYPES = ("granitemoehybrid", "bamba")


def attention_layers(config: dict[str, Any]) -> list[bool]:
    """Which layers attend (``layer_types``: ``attention``, or ``full_attention`` as transformers 5 names it; Bamba's
    ``attn_layer_indices`` where its config.json names no layer types)."""
    types = config.get("layer_types") or config.get("layers_block_type")
    if types:
        return [t in ("attention", "full_attention") for t in types]
    return [i in set(config.get("attn_layer_indices") or []) for i in range(int(config["num_hidden_layers"]))]


def inner_size(config: dict[str, Any]) -> int:
    return int(config.get("mamba_expand") or 2) * int(config["hidden_size"])


def mamba_head(config: dict[str, Any]) -> int:
    """The Mamba-2 head width (Bamba's ``"auto"``: the scan width over the heads, as BambaConfig sets it)."""
    head = config.get("mamba_d_head")
    return inner_size(config) // int(config["mamba_n_heads"]) if head in (None, "auto") else int(head)


def head_width(config: dict[str, Any]) -> int:
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


def rotary_width(config: dict[str, Any]) -> int:
    """How many of each attention head's leading channels Bamba turns (transformers: head width x
    ``partial_rotary_factor``, 0.5 hard-coded by BambaConfig)."""
    rope = config.get("rope_parameters") or {}
    return int(head_width(config) * float(rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 0.5))


def check(config: dict[str, Any], where: str) -> None:
    """Refuse (a UserError naming the setting) what llama.cpp's granitehybrid would run otherwise than transformers."""
    bamba = config.get("model_type") == "bamba"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if bamba and ((rope.get("rope_type") or rope.get("type") or "default") != "default" or config.get("mlp_bias")):
        raise UserError(f"{where}: RoPE scaling '{rope.get('rope_type') or rope.get('type')}' or mlp_bias="
                        f"{config.get('mlp_bias')} is not written for llama.cpp's granitehybrid by finetuner (Bamba's "
                        "positions unscaled, no MLP bias); GGUF export refuses it.")
    if not bamba and config.get("position_embedding_type") == "rope" and not all(attention_layers(config)):
        raise UserError(f"{where}: position_embedding_type 'rope' with Mamba layers is not llama.cpp's granitehybrid "
                        "(it turns no positions then); GGUF export refuses it.")
    if config.get("mamba_proj_bias") or not config.get("mamba_conv_bias", True) or config.get("attention_bias"):
        raise UserError(f"{where}: mamba_proj_bias={config.get('mamba_proj_bias')}, mamba_conv_bias="
                        f"{config.get('mamba_conv_bias')}, attention_bias={config.get('attention_bias')} is not llama.cpp's "
                        "granitehybrid (no projection bias, a convolution bias); GGUF export refuses it.")
    heads, head = int(config["mamba_n_heads"]), mamba_head(config)
    if heads * head != inner_size(config) or inner_size(config) % int(config.get("mamba_n_groups") or 1):
        raise UserError(f"{where}: mamba_n_heads {heads} x mamba_d_head {head} is not the scan width {inner_size(config)} "
                        "(mamba_expand x hidden_size) in whole groups; GGUF export refuses it.")
    if clamps_dt(config) or (config.get("hidden_act") or "silu") != "silu":
        raise UserError(f"{where}: time_step_limit {config.get('time_step_limit')} or hidden_act {config.get('hidden_act')} "
                        "is not llama.cpp's granitehybrid (dt unclamped, SiLU); GGUF export refuses it.")


def write_metadata(writer, config: dict[str, Any], n_layers: int) -> None:
    """Granite 4.0-H's GGUF metadata, as the converter (``GraniteHybridModel.set_gguf_parameters``) writes it."""
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    rope = config.get("rope_parameters") or {}
    writer.add_block_count(n_layers)
    bamba = config.get("model_type") == "bamba"
    writer.add_context_length(int(config["max_position_embeddings"]) if bamba else 2**20)  # no positions: the converter's
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv([kv if attends else 0 for attends in attention_layers(config)])
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0))
    writer.add_rope_scaling_finetuned(bamba)  # granitehybrid's switch: RoPE on for Bamba, off for Granite 4.0-H
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    writer.add_vocab_size(int(config["vocab_size"]))
    write_ssm(writer, config)
    if bamba:  # the turned part of each head; no multipliers (llama.cpp's defaults are transformers' Bamba)
        writer.add_rope_dimension_count(rotary_width(config))
        return
    writer.add_attention_scale(float(config.get("attention_multiplier") or 1.0))
    writer.add_embedding_scale(float(config.get("embedding_multiplier") or 1.0))
    writer.add_residual_scale(float(config.get("residual_multiplier") or 1.0))
    writer.add_logit_scale(float(config.get("logits_scaling") or 1.0))
    if config.get("num_local_experts"):
        writer.add_expert_count(int(config["num_local_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if config.get("shared_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(int(config["shared_intermediate_size"]))


def write_ssm(writer, config: dict[str, Any]) -> None:
    """The Mamba-2 layers' widths."""
    writer.add_ssm_conv_kernel(int(config.get("mamba_d_conv") or 4))
    writer.add_ssm_state_size(int(config["mamba_d_state"]))
    writer.add_ssm_group_count(int(config.get("mamba_n_groups") or 1))
    writer.add_ssm_inner_size(inner_size(config))
    writer.add_ssm_time_step_rank(int(config["mamba_n_heads"]))


def halves(own: str) -> tuple[tuple[str, str], int] | None:
    """A fused gate-and-up tensor's two GGUF tensors (the gate's rows first) and the axis it is split on; None else."""
    layer = own.split(".layers.", 1)[-1].split(".", 1)[0]
    if own.endswith("block_sparse_moe.input_linear.weight"):  # (experts, 2 x width, hidden)
        return (f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight"), 1
    if own.endswith("shared_mlp.input_linear.weight"):  # (2 x width, hidden)
        return (f"blk.{layer}.ffn_gate_shexp.weight", f"blk.{layer}.ffn_up_shexp.weight"), 0
    return None


def stored_shape(config: dict[str, Any], hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`transform` gives a tensor of ``shape`` (a Mamba layer's as Mamba-2's)."""
    return mamba2_shape(hf_name, shape, int(config.get("mamba_n_groups") or 1)) if ".mamba." in hf_name else shape


def permute_rotary(w, heads: int, rotary: int):
    """Each head's first ``rotary`` rows (rotating halves, as transformers turns them) as llama.cpp's interleaved
    pairs; the rest of the head as it is."""
    w = w.reshape(heads, -1, *w.shape[1:]).copy()
    part = w[:, :rotary]
    w[:, :rotary] = part.reshape(heads, 2, rotary // 2, *part.shape[2:]).swapaxes(1, 2).reshape(part.shape)
    return w.reshape(-1, *w.shape[2:])


def transform(config: dict[str, Any], hf_name: str, w):
    """A Mamba layer's tensor as the converter stores it, Bamba's queries and keys with their turned part permuted (a
    float32 numpy array in, one out); Granite 4.0-H's queries and keys are permuted by
    :class:`~finetuner.export.gguf_arch.Arch` as Llama's are."""
    if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = int(config["num_attention_heads"]) if "q_proj" in hf_name else \
            int(config.get("num_key_value_heads") or config["num_attention_heads"])
        return permute_rotary(w, heads, rotary_width(config))
    if hf_name.endswith("mamba.A_log"):
        import numpy as np

        w = -np.exp(w)
    return w.reshape(stored_shape(config, hf_name, w.shape))

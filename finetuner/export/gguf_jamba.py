"""Jamba (``jamba``) as llama.cpp's converter (``JambaModel``) writes it: llama.cpp's ``jamba``, Mamba layers (Mamba-1's
scan with weighted RMS norms on dt, B and C) beside attention layers without positions, each followed by a dense MLP or
by routed experts.

llama.cpp tells the layer kinds apart by each layer's key-value head count (0 for a Mamba layer), the experts' layers
by their router (``ffn_gate_inp``). The Mamba tensors as Mamba's (``A`` as ``-exp(A_log)``, the convolution squeezed
to ``(channels, kernel)``); a checkpoint's experts (one tensor each) stacked as llama.cpp's, named as the converter
names them (``mlp.experts``). llama.cpp's jamba routes by a softmax over all experts without renormalising the chosen
ones' weights, as transformers' Jamba does.

Refused: projection biases or a convolution without a bias (llama.cpp's jamba has no projection bias and requires the
convolution's), and an activation other than SiLU.
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError

ARCH = "jamba"


def attention_layers(config: dict[str, Any]) -> list[bool]:
    """Which layers attend (every ``attn_layer_period``-th from ``attn_layer_offset``, as JambaConfig reads them)."""
    period, offset = int(config.get("attn_layer_period") or 8), int(config.get("attn_layer_offset") or 4)
    return [i >= offset and (i - offset) % period == 0 for i in range(int(config["num_hidden_layers"]))]


def inner_size(config: dict[str, Any]) -> int:
    return int(config.get("mamba_expand") or 2) * int(config["hidden_size"])


def check(config: dict[str, Any], where: str) -> None:
    """Refuse (a UserError naming the setting) what llama.cpp's jamba would run otherwise than transformers."""
    if config.get("mamba_proj_bias") or not config.get("mamba_conv_bias", True):
        raise UserError(f"{where}: mamba_proj_bias={config.get('mamba_proj_bias')}, mamba_conv_bias="
                        f"{config.get('mamba_conv_bias')} is not llama.cpp's jamba (no projection bias, a convolution "
                        "bias); GGUF export refuses it.")
    if (config.get("hidden_act") or "silu") != "silu":
        raise UserError(f"{where}: hidden_act {config.get('hidden_act')} is not llama.cpp's jamba (SiLU); GGUF export "
                        "refuses it.")


def write_metadata(writer, config: dict[str, Any], n_layers: int) -> None:
    """Jamba's GGUF metadata, as the converter (``JambaModel.set_gguf_parameters``) writes it."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    rank = config.get("mamba_dt_rank")
    writer.add_block_count(n_layers)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv([kv if attends else 0 for attends in attention_layers(config)])
    writer.add_ssm_conv_kernel(int(config.get("mamba_d_conv") or 4))
    writer.add_ssm_inner_size(inner_size(config))
    writer.add_ssm_state_size(int(config.get("mamba_d_state") or 16))
    writer.add_ssm_time_step_rank(int(rank) if rank not in (None, "auto") else -(hidden // -16))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_expert_count(int(config.get("num_experts") or config.get("num_local_experts") or 0))
    writer.add_expert_used_count(int(config.get("num_experts_per_tok") or 0))


def source_key(own: str) -> str:
    """The checkpoint name gguf's map knows the tensor by: stacked experts as the converter names them."""
    return own.replace(".feed_forward.experts.", ".mlp.experts.") if ".feed_forward.experts." in own else own


def stored_shape(hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`transform` gives a tensor of ``shape`` (the depthwise convolution squeezed)."""
    return (shape[0], shape[-1]) if hf_name.endswith("mamba.conv1d.weight") else shape


def transform(hf_name: str, w):
    """The tensor as the converter stores it (a float32 numpy array in, one out)."""
    if hf_name.endswith("mamba.A_log"):
        import numpy as np

        w = -np.exp(w)
    return w.reshape(stored_shape(hf_name, w.shape))

"""Falcon-H1 (``falcon_h1``) as llama.cpp's converter (``FalconH1Model``) writes it: llama.cpp's ``falcon-h1``, a
Mamba-2 mixer and attention side by side in every layer (their outputs added), then a dense MLP.

Falcon-H1's muP multipliers are not llama.cpp keys: the converter multiplies them into the weights, and so does
finetuner (on the merged weights): the embeddings by ``embedding_multiplier``, the output head by
``lm_head_multiplier``, the queries and values by ``attention_in_multiplier``, the keys by it and ``key_multiplier``, the
attention output by ``attention_out_multiplier``, the Mamba in-projection by ``ssm_in_multiplier`` and, each of its
five parts (gate, x, B, C, dt), by that part's ``ssm_multipliers`` (transformers' ``mup_vector``), the Mamba
out-projection by ``ssm_out_multiplier``, the MLP's gate and down projections by ``mlp_multipliers``. Its Mamba-2
tensors as Mamba-2's (``A`` and ``D`` as columns, the gated norm one row a group, ``dt_bias`` as ``dt_proj.bias``).
llama.cpp's falcon-h1 turns the positions as NeoX does (rotating halves, as transformers): no permutation.

Refused: projection biases (llama.cpp's falcon-h1 would not scale a bias as transformers does), the gated norm before
the gate (llama.cpp gates first), a clamped dt, tied embeddings with different embedding and head multipliers (one
tensor cannot carry both), RoPE scaling, and an activation other than SiLU.
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError
from finetuner.export.gguf_recurrent import clamps_dt, mamba2_shape

ARCH = "falcon-h1"


def inner_size(config: dict[str, Any]) -> int:
    """The scan width (``mamba_d_ssm``, else ``mamba_expand`` x ``hidden_size``, as FalconH1Config reads it)."""
    return int(config.get("mamba_d_ssm") or int(config.get("mamba_expand") or 2) * int(config["hidden_size"]))


def head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


def check(config: dict[str, Any], where: str) -> None:
    """Refuse (a UserError naming the setting) what llama.cpp's falcon-h1 would run otherwise than transformers."""
    if config.get("mamba_proj_bias") or config.get("projectors_bias") or config.get("attention_bias"):
        raise UserError(f"{where}: mamba_proj_bias={config.get('mamba_proj_bias')}, projectors_bias="
                        f"{config.get('projectors_bias')}, attention_bias={config.get('attention_bias')} is not written for "
                        "llama.cpp's falcon-h1 by finetuner (no projection bias); GGUF export refuses it.")
    if config.get("mamba_rms_norm") and config.get("mamba_norm_before_gate", True):
        raise UserError(f"{where}: mamba_norm_before_gate=true is not llama.cpp's falcon-h1 (it gates, then norms); GGUF "
                        "export refuses it.")
    heads = int(config["mamba_n_heads"])
    head = config.get("mamba_d_head")
    head = inner_size(config) // heads if head in (None, "auto") else int(head)
    if heads * head != inner_size(config) or inner_size(config) % int(config.get("mamba_n_groups") or 1):
        raise UserError(f"{where}: mamba_n_heads {heads} x mamba_d_head {head} is not the scan width {inner_size(config)} "
                        "in whole groups; GGUF export refuses it.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if clamps_dt(config) or (config.get("hidden_act") or "silu") != "silu" \
            or (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise UserError(f"{where}: time_step_limit {config.get('time_step_limit')}, hidden_act {config.get('hidden_act')} or "
                        f"RoPE scaling '{rope.get('rope_type') or rope.get('type')}' is not llama.cpp's falcon-h1 (dt "
                        "unclamped, SiLU, positions unscaled); GGUF export refuses it.")
    if config.get("tie_word_embeddings") and float(config.get("embedding_multiplier") or 1.0) != \
            float(config.get("lm_head_multiplier") or 1.0):
        raise UserError(f"{where}: tied embeddings with embedding_multiplier {config.get('embedding_multiplier')} and "
                        f"lm_head_multiplier {config.get('lm_head_multiplier')}: llama.cpp's falcon-h1 reads one tensor "
                        "for both, which cannot carry two multipliers; GGUF export refuses it.")


def write_metadata(writer, config: dict[str, Any], n_layers: int) -> None:
    """Falcon-H1's GGUF metadata, as the converter (``FalconH1Model.set_gguf_parameters``) writes it."""
    rope = config.get("rope_parameters") or {}
    heads = int(config["num_attention_heads"])
    writer.add_block_count(n_layers)
    writer.add_context_length(int(config.get("max_position_embeddings") or 0))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 1e11))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-5))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_ssm_conv_kernel(int(config.get("mamba_d_conv") or 4))
    writer.add_ssm_inner_size(inner_size(config))
    writer.add_ssm_state_size(int(config["mamba_d_state"]))
    writer.add_ssm_time_step_rank(int(config["mamba_n_heads"]))
    writer.add_ssm_group_count(int(config.get("mamba_n_groups") or 1))


def stored_shape(config: dict[str, Any], hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`transform` gives a tensor of ``shape`` (a mixer's as Mamba-2's)."""
    return mamba2_shape(hf_name, shape, int(config.get("mamba_n_groups") or 1)) if ".mamba." in hf_name else shape


def multiplier(config: dict[str, Any], hf_name: str):
    """What the converter multiplies ``hf_name`` by: a number, a column of per-row factors (the in-projection's five
    parts), or None for a tensor it keeps as it is."""
    import numpy as np

    c = {k: 1.0 if v is None else v for k, v in config.items()}
    mlp = list(c.get("mlp_multipliers") or [1.0, 1.0])
    by_end = {"embed_tokens.weight": c.get("embedding_multiplier", 1.0), "lm_head.weight": c.get("lm_head_multiplier", 1.0),
              "q_proj.weight": c.get("attention_in_multiplier", 1.0), "v_proj.weight": c.get("attention_in_multiplier", 1.0),
              "k_proj.weight": c.get("attention_in_multiplier", 1.0) * c.get("key_multiplier", 1.0),
              "o_proj.weight": c.get("attention_out_multiplier", 1.0), "mamba.out_proj.weight": c.get("ssm_out_multiplier", 1.0),
              "gate_proj.weight": mlp[0], "down_proj.weight": mlp[1]}
    for end, factor in by_end.items():
        if hf_name.endswith(end):
            return float(factor)
    if not hf_name.endswith("mamba.in_proj.weight"):
        return None
    inner, bc = inner_size(config), int(config.get("mamba_n_groups") or 1) * int(config["mamba_d_state"])
    parts = list(c.get("ssm_multipliers") or [1.0] * 5)  # transformers' mup_vector: gate, x, B, C, dt
    widths = [inner, inner, bc, bc, int(config["mamba_n_heads"])]
    column = np.concatenate([np.full(w, float(p), dtype=np.float32) for w, p in zip(widths, parts)])
    return float(c.get("ssm_in_multiplier", 1.0)) * column[:, None]


def transform(config: dict[str, Any], hf_name: str, w):
    """The tensor as the converter stores it (a float32 numpy array in, one out): the multipliers folded in, a Mamba
    mixer's ``A`` as ``-exp(A_log)`` and its tensors reshaped as Mamba-2's."""
    factor = multiplier(config, hf_name)
    if factor is not None:
        w = w * factor
    if hf_name.endswith("mamba.A_log"):
        import numpy as np

        w = -np.exp(w)
    return w.reshape(stored_shape(config, hf_name, w.shape))

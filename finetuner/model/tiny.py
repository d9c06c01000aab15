"""A tiny config of any model type transformers knows: its own defaults with the sizes made small.

For tests and the model census (``scripts/dev/model_census.py``): a model of every family that trains in
seconds on a CPU. The defaults of a config class are a real model's (often 7B-class); this keeps every other
setting and shrinks the widths, the layer count, the vocabulary and the experts under the names the families
use. Lists with one entry per layer (``layer_types``) are cut to the new layer count.
"""

from __future__ import annotations

from typing import Any

#: size settings and their tiny values, under every name a family of transformers uses for them
TINY_SIZES: dict[str, int] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "sliding_window": 64,
    # mixtures of experts
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # multi-head latent attention (DeepSeek-V2/V3): its low ranks and head parts (head_dim is the rotary part)
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 32,
    # other spellings of the same sizes
    "n_embd": 64, "n_layer": 2, "n_head": 4, "num_layers": 2, "d_model": 64, "ffn_dim": 128, "word_embed_proj_dim": 64,
}


#: what :func:`tiny_config` shrinks with ``widths=False``: the depth and the experts, every width kept (for a
#: family whose widths depend on each other in ways one table cannot know)
DEPTH_ONLY = ("num_hidden_layers", "num_layers", "n_layer", "num_local_experts", "num_experts", "n_routed_experts",
              "moe_num_experts", "num_experts_per_tok", "moe_topk", "first_k_dense_replace", "n_group", "topk_group",
              "max_position_embeddings")


#: sizes a family's defaults leave None though its model reads them (Ministral's head_dim, Nemotron's
#: num_key_value_heads): set to the tiny value, which is what None stands for at the tiny widths
SET_WHEN_NONE = ("head_dim", "num_key_value_heads")


def tiny_config(model_type: str, vocab_size: int, widths: bool = True, **overrides: Any) -> dict[str, Any]:
    """``model_type``'s default config (transformers' ``CONFIG_MAPPING``) as a ``config.json`` dict with tiny
    sizes (:data:`TINY_SIZES`, only the keys the config has; with ``widths=False`` only :data:`DEPTH_ONLY`),
    ``vocab_size`` and ``overrides``. An image-text-to-text config's ``text_config`` is shrunk the same way."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = state_space_tiny(CONFIG_MAPPING[model_type]().to_dict(), widths)
    return _shrink(cfg, vocab_size, {**TINY_PATTERNS.get(model_type, {}), **overrides}, widths)


def _shrink(cfg: dict[str, Any], vocab_size: int, overrides: dict[str, Any], widths: bool = True) -> dict[str, Any]:
    out = dict(cfg)
    mha = cfg.get("num_key_value_heads") is not None and cfg.get("num_key_value_heads") == cfg.get("num_attention_heads")
    for key, value in TINY_SIZES.items():
        if (widths or key in DEPTH_ONLY) and isinstance(out.get(key), int) and not isinstance(out.get(key), bool):
            out[key] = value
        elif widths and key in SET_WHEN_NONE and key in out and out[key] is None:
            out[key] = value
    if mha and widths:  # as many key/value heads as query heads in the defaults (latent attention needs it): kept so
        out["num_key_value_heads"] = out["num_attention_heads"]
    if "vocab_size" in out:
        out["vocab_size"] = vocab_size
    layers = out.get("num_hidden_layers") or out.get("num_layers")
    for key, value in list(out.items()):
        if isinstance(value, list) and layers and len(value) > layers and key in ("layer_types", "mlp_layer_types"):
            out[key] = value[:layers]
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = _shrink(out["text_config"], vocab_size, {}, widths)
    if isinstance(out.get("vision_config"), dict):  # its own widths (a vocabulary only if it has one)
        out["vision_config"] = _shrink(out["vision_config"], vocab_size, {}, widths)
    out.update(overrides)
    return out


# --- state-space and short-convolution families (Mamba, Mamba-2, their hybrids, LFM2) ---------------------------

#: a state-space mixer's sizes at tiny widths, under the names its families use: the state (``d_state``), the
#: time-step rank, Mamba-2's heads and head width (heads x head width = expand x hidden_size = 2 x 64, which
#: Mamba-2, Bamba, Granite 4 and Falcon-H1 check), its groups of B and C, its scan's chunk, and Zamba's attention
#: (twice the hidden size wide); the expansion and the convolution's kernel keep their defaults (small already)
SSM_SIZES: dict[str, int] = {
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "time_step_rank": 8, "mamba_dt_rank": 8,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_d_ssm": 128,
    "mamba_headdim": 16,
    "n_groups": 2, "mamba_n_groups": 1, "mamba_ngroups": 1, "chunk_size": 16, "mamba_chunk_size": 16,
    "attention_hidden_size": 128, "attention_head_dim": 32, "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "block_multiple_of": 16,
}
#: keys only a state-space or short-convolution config has (:data:`SSM_SIZES` applies to such a config alone:
#: ``num_heads`` means attention heads elsewhere)
SSM_MARKS = ("state_size", "mamba_d_state", "ssm_state_size", "conv_L_cache")
#: Mamba-2's own heads (``num_heads`` x ``head_dim`` = 2 x 64)
MAMBA2_HEADS = {"num_heads": 8}
#: the layer pattern at tiny depth: a layer of each kind the family's published checkpoints mix (a Mamba layer and
#: an attention layer; LFM2's short convolution and attention; Jamba's Mamba with a dense MLP and with experts,
#: and attention on a dense layer, as in its first 8), where the defaults would give layers of one kind (Bamba's
#: and Granite 4's defaults have no attention layer, LFM2's no convolution, Jamba's first attention layer is its
#: 5th); a Mamba layer first, the layer the trace reads (:mod:`finetuner.model.trace`). Nemotron-H's default
#: pattern is one layer of each of its four kinds already
TINY_PATTERNS: dict[str, dict[str, Any]] = {
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "hybrid_layer_ids": [1, 2],
               "num_hidden_layers": 3},
}


def state_space_tiny(cfg: dict[str, Any], widths: bool = True) -> dict[str, Any]:
    """``cfg`` (a state-space or short-convolution family's defaults) with its mixer's sizes tiny
    (:data:`SSM_SIZES`, with ``widths``); any other config as it is. (:func:`tiny_config` sets the layer pattern,
    :data:`TINY_PATTERNS`, after the depth.)"""
    if not any(k in cfg for k in SSM_MARKS):
        return cfg
    out = dict(cfg)
    if widths:
        for key, value in {**SSM_SIZES, **(MAMBA2_HEADS if "head_dim" in cfg and "num_heads" in cfg else {})}.items():
            if isinstance(out.get(key), int) and not isinstance(out.get(key), bool):
                out[key] = value
    return out

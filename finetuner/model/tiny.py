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

    cfg = CONFIG_MAPPING[model_type]().to_dict()
    return _shrink(cfg, vocab_size, overrides, widths)


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

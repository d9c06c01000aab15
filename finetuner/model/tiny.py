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
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # multi-head latent attention (DeepSeek-V2/V3): its low ranks and head parts (head_dim is the rotary part)
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 32,
    # other spellings of the same sizes
    # Inkling's relative-position logits (a d_rel x rel_extent table in each full-attention layer)
    "rel_extent": 64,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "num_layers": 2, "d_model": 64, "ffn_dim": 128, "word_embed_proj_dim": 64,
    # linear attention (Gated DeltaNet: Qwen3.5, Qwen3-Next; Kimi Delta Attention): its own heads and head widths
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16,
    # per-layer inputs (Gemma 3n/4: a second embedding table, per_layer_input_gate / per_layer_projection)
    "hidden_size_per_layer_input": 16, "laurel_rank": 8,
    # GPT-J and CodeGen: the rotary part of a 16-wide head, the context; XLM's and DBRX's widths; xLSTM's
    "rotary_dim": 16, "n_positions": 512, "n_ctx": 512, "emb_dim": 64, "n_heads": 4, "n_layers": 2,
    "embedding_dim": 64, "num_blocks": 2,
    # RecurrentGemma's recurrence (LRU) width and local attention window
    "lru_width": 64, "attention_window_size": 64,
    # more expert widths and counts (LongCat-Flash, ERNIE 4.5 MoE, Ling/Bailing), and Qwen4-Exp's indexer
    "ffn_hidden_size": 128, "expert_ffn_hidden_size": 32, "zero_expert_num": 2, "moe_k": 2, "num_expert_group": 1,
    "n_shared_experts": 1,
    # BLT: its byte n-gram hash tables (each as wide as the encoder) and the global model's width the local ones read
    "encoder_hash_byte_group_vocab": 512, "hidden_size_global": 64,
    # dots3's vision and audio adapters: they read the tower's width and write the text model's
    "adapter_in_dim": 64, "adapter_input_size": 64, "adapter_out_dim": 64,
    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 32, "indexer_compress_ratio": 4,
}


#: what :func:`tiny_config` shrinks with ``widths=False``: the depth and the experts, every width kept (for a
#: family whose widths depend on each other in ways one table cannot know)
DEPTH_ONLY = ("num_hidden_layers", "num_layers", "n_layer", "num_local_experts", "num_experts", "n_routed_experts",
              "moe_num_experts", "num_experts_per_tok", "num_experts_per_token", "moe_topk", "first_k_dense_replace", "n_group", "topk_group",
              "max_position_embeddings")


#: sizes a family's defaults leave None though its model reads them (Ministral's head_dim, Nemotron's
#: num_key_value_heads): set to the tiny value, which is what None stands for at the tiny widths
SET_WHEN_NONE = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "n_group", "topk_group",
                 "n_shared_experts",
                 # Qwen4-Exp's sparse-attention indexer: its defaults leave every size None, which its model divides
                 "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
#: how many experts a token picks: at most the tiny value, never more than the defaults (ZAYA takes exactly one)
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")
#: per-layer lists that name each layer's kind: cut to the tiny depth with every kind of the defaults kept
PATTERN_KEYS = ("layer_types", "mlp_layer_types")
#: layer kinds that differ from full attention only in their mask: a pattern of these alone is cut as it is (Gemma 3's
#: five sliding layers to one full stays sliding at two layers, as llama.cpp's gemma3 pattern wants)
MASK_KINDS = {"full_attention", "sliding_attention", "chunked_attention"}
#: token ids a family's defaults set (Kimi-Linear's pad 163839): None when outside the tiny vocabulary
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")
#: dicts in a config that are settings, not a sub-model's config (:func:`_shrink` shrinks every other one with sizes)
NOT_SUB_CONFIGS = ("id2label", "label2id", "rope_parameters", "rope_scaling", "per_layer_config")


def tiny_config(model_type: str, vocab_size: int, widths: bool = True, **overrides: Any) -> dict[str, Any]:
    """``model_type``'s default config (transformers' ``CONFIG_MAPPING``) as a ``config.json`` dict with tiny
    sizes (:data:`TINY_SIZES`, only the keys the config has; with ``widths=False`` only :data:`DEPTH_ONLY`),
    ``vocab_size`` and ``overrides``. An image-text-to-text config's ``text_config`` is shrunk the same way."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = state_space_tiny(CONFIG_MAPPING[model_type]().to_dict(), widths)
    return _shrink(cfg, vocab_size, {**TINY_PATTERNS.get(model_type, {}), **overrides}, widths)


def _shrink(cfg: dict[str, Any], vocab_size: int, overrides: dict[str, Any], widths: bool = True,
            ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """``cfg`` shrunk, then ``overrides``; ``ids``: the token ids a sub-config takes where its own are outside the
    tiny vocabulary (the top level's: Emu3's and Mllama's text configs want an int, not None)."""
    out = dict(cfg)
    ids = {k: overrides[k] for k in TOKEN_ID_KEYS if k in overrides} if ids is None else ids
    mha = cfg.get("num_key_value_heads") is not None and cfg.get("num_key_value_heads") == cfg.get("num_attention_heads")
    for key, value in TINY_SIZES.items():
        if (widths or key in DEPTH_ONLY) and isinstance(out.get(key), int) and not isinstance(out.get(key), bool):
            out[key] = min(value, out[key]) if key in TOP_K_KEYS else value
        elif widths and key in SET_WHEN_NONE and key in out and out[key] is None:
            out[key] = value
    if mha and widths:  # as many key/value heads as query heads in the defaults (latent attention needs it): kept so
        out["num_key_value_heads"] = out["num_attention_heads"]
    if "vocab_size" in out:
        out["vocab_size"] = vocab_size
    if isinstance(out.get("vocab_size_per_layer_input"), int):  # Gemma 3n/4's per-layer table reads the same ids
        out["vocab_size_per_layer_input"] = vocab_size
    for key in TOKEN_ID_KEYS:
        if isinstance(out.get(key), int) and out[key] >= vocab_size:
            out[key] = ids.get(key)
    _per_layer(cfg, out, widths)
    for key, value in cfg.items():  # every sub-config (text, vision, audio, BLT's encoder and patcher): its own widths
        if isinstance(value, dict) and key not in NOT_SUB_CONFIGS and ("model_type" in value or TINY_SIZES.keys() & value):
            sub = state_space_tiny(value, widths)
            out[key] = _shrink(sub, vocab_size, TINY_PATTERNS.get(value.get("model_type", ""), {}), widths, ids)
    out.update(overrides)
    return out


def _per_layer(cfg: dict[str, Any], out: dict[str, Any], widths: bool) -> None:
    """Settings with one entry per layer, cut to the tiny depth: the layer pattern (``layer_types``) of a hybrid keeps
    every kind the defaults have, in turn (Qwen3.5's linear and full attention, three to one: one of each), else is
    cut as it is; the last layer's kind is the defaults' (Gemma 4 wants full attention there); other lists
    as long as the default depth are cut (Gemma 3n's ``activation_sparsity_pattern``), its per-layer MLP widths
    made tiny; a ``per_layer_config`` (Gemma 4's: a full-attention layer's own head width; dots3's vision tower's:
    a sparse MLP layer's expert count) follows its layer's kind (``layer_types``, else ``mlp_layer_types``) to
    the tiny layers, its widths scaled as the layer's defaults are; KV shared across layers (Gemma 3n/4's
    ``num_kv_shared_layers``) kept with one sharing layer per kind (the depth grown to two layers per kind)."""
    before = cfg.get("num_hidden_layers") or cfg.get("num_layers")
    layers = out.get("num_hidden_layers") or out.get("num_layers")
    if not (isinstance(before, int) and isinstance(layers, int)) or layers >= before:
        return
    kinds = {key: list(dict.fromkeys(cfg[key])) for key in PATTERN_KEYS if isinstance(cfg.get(key), list)}
    shared = isinstance(cfg.get("num_kv_shared_layers"), int) and cfg["num_kv_shared_layers"] > 0
    widest = max((len(k) for k in kinds.values() if shared or set(k) - MASK_KINDS), default=1)
    layers = max(layers, widest * (2 if shared else 1))
    out["num_hidden_layers" if "num_hidden_layers" in out else "num_layers"] = layers
    if shared:
        out["num_kv_shared_layers"] = widest
    for key, value in cfg.items():
        if not (isinstance(value, list) and len(value) == before):
            continue
        if key in kinds and (shared or set(kinds[key]) - MASK_KINDS):  # each kind in turn, the last layer's at the end
            order = [k for k in kinds[key] if k != value[-1]] + [value[-1]]
            out[key] = [order[(i - layers) % len(order)] for i in range(layers)]
        elif key in kinds:
            out[key] = [*value[:layers - 1], value[-1]]
        elif widths and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and key in TINY_SIZES:
            out[key] = [TINY_SIZES[key]] * layers
        else:
            out[key] = value[:layers]
    pattern = next((key for key in PATTERN_KEYS if isinstance(cfg.get(key), list) and len(cfg[key]) == before), None)
    if isinstance(cfg.get("per_layer_config"), dict) and pattern:
        old = {int(i): over for i, over in cfg["per_layer_config"].items()}
        by_kind = {cfg[pattern][i]: over for i, over in sorted(old.items())}
        scaled = {kind: {k: max(1, round(v * out[k] / cfg[k])) if widths and isinstance(v, int) and isinstance(cfg.get(k), int)
                         and isinstance(out.get(k), int) and cfg[k] else v for k, v in over.items()}
                  for kind, over in by_kind.items()}
        out["per_layer_config"] = {i: scaled[kind] for i, kind in enumerate(out[pattern]) if kind in scaled}


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
    # RecurrentGemma's pattern (two recurrent blocks to one attention block, repeated): one of each kind
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # HRM's stack: its serialised depth is the stack's (one layer) times H_cycles x (L_cycles + 1), 2 x 4
    "hrm_text": {"num_layers_per_stack": 1, "num_hidden_layers": 8},
    # dots3's sliding layers take the head width as their qk_nope + qk_rope (24 + 16, its per-layer 192 made tiny)
    "dots3_note_text": {"head_dim": 40},
    # xLSTM's config rounds its query/key width (hidden x qk_dim_factor 0.5) up to a multiple of 64 and its mLSTM
    # layer does not: the two agree (its state's shape) only where half the hidden size is a multiple of 64
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    # XLM's defaults are its masked LM's (attending both ways); its causal-LM checkpoints (xlm-clm-*) attend causally
    "xlm": {"causal": True},
    # Reformer's LM head builds only as a decoder (its attention causal)
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    # BLT's cache reads a num_hidden_layers its top config does not have: trained and answered without one
    "blt": {"use_cache": False},
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

"""Qwen3.5's text model (``qwen3_5_text``) and Qwen3-Next (``qwen3_next``) as llama.cpp's converter writes them (``Qwen3_5TextModel`` in its
``conversion/qwen.py``, through ``_LinearAttentionVReorderBase`` and ``Qwen3NextModel``): three Gated DeltaNet layers
for each full-attention layer.

The Gated DeltaNet's widths go to ``ssm.*`` (the key head width as the state size, the key heads as the group count,
the value heads as the time-step rank), which layers are linear to ``attention.recurrent_layers``. Its tensors, as the
converter transforms them: ``A`` stored as ``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the depthwise
convolution's ``(channels, 1, kernel)`` squeezed to ``(channels, kernel)`` (float32), every RMSNorm but the DeltaNet's
output norm stored as ``1 + weight`` (Qwen3.5's norms are zero-centred). Where there are more value heads than key
heads, llama.cpp broadcasts the key heads tiled (``K0, K1, K0, K1...``) while the checkpoint groups the value heads by
key head (``K0's v0, v1, K1's v0, v1``): the value rows of ``in_proj_qkv``, ``in_proj_z``, ``in_proj_a``,
``in_proj_b``, ``A_log``, ``dt_bias``, the convolution's value channels and ``out_proj``'s columns are reordered to
tiles. The full-attention layers' query projection keeps its output gate (llama.cpp's qwen35 reads both halves).

Qwen3-Next (llama.cpp's ``qwen3next``; Qwen3.5-MoE's experts and gated shared expert after every layer) keeps the
checkpoint's order: llama.cpp's qwen3next repeats each key head for its value heads as transformers groups them, and
reads the fused ``in_proj_qkvz`` (``ssm_in``) and ``in_proj_ba`` (``ssm_ba``) per key head as transformers lays them
out ((q, k, v, z) and (b, a) for each key head); the converter's newer split of ``in_proj_qkvz`` into ``attn_qkv`` and
``attn_gate`` is the same arithmetic. Its RoPE is plain (no M-RoPE sections). Refused for it: dense layers among the
experts' (``mlp_only_layers``, ``decoder_sparse_step``) and ``norm_topk_prob`` false (llama.cpp's qwen3next always
renormalises the chosen experts' weights).

Refused for Qwen3.5: a value head width other than the key head width (llama.cpp's qwen35 takes one width for both,
``ssm.state_size``), RoPE scaling, value heads that are not a whole multiple of the key heads, and M-RoPE sections
that cover more rotary pairs than a head turns.
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError

#: the llama.cpp architectures of the Gated DeltaNet families this module writes (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)
ARCHES = ("qwen35", "qwen35moe", "qwen3next")
#: the family whose value heads llama.cpp reads grouped by key head, as transformers has them (no M-RoPE either)
NEXT = "qwen3_next"
#: llama.cpp's key for which layers are linear attention (gguf's ``Keys.Attention.RECURRENT_LAYERS``; the installed
#: gguf package's writer may lack its ``add_recurrent_layers``)
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"


def check(config: dict[str, Any], where: str) -> None:
    """Refuse (a UserError naming the setting) what llama.cpp's qwen35 (or qwen3next) would run otherwise."""
    if config.get("model_type") == NEXT:
        check_next(config, where)
        return
    if int(config["linear_key_head_dim"]) != int(config["linear_value_head_dim"]):
        raise UserError(f"{where}: linear_key_head_dim {config['linear_key_head_dim']} differs from linear_value_head_dim "
                        f"{config['linear_value_head_dim']}; llama.cpp's qwen35 takes one width for both, so GGUF export "
                        "refuses it.")
    if int(config["linear_num_value_heads"]) % int(config["linear_num_key_heads"]):
        raise UserError(f"{where}: linear_num_value_heads {config['linear_num_value_heads']} is not a multiple of "
                        f"linear_num_key_heads {config['linear_num_key_heads']}; GGUF export refuses it.")
    if sum(mrope_sections(config)) > rotary_dims(config) // 2:
        raise UserError(f"{where}: its M-RoPE sections {mrope_sections(config)} cover more than the {rotary_dims(config) // 2} "
                        "rotary pairs of a head; llama.cpp's qwen35 would abort on them, so GGUF export refuses it.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise UserError(f"{where}: RoPE scaling '{rope.get('rope_type') or rope.get('type')}' is not written for "
                        "llama.cpp's qwen35 by finetuner; GGUF export refuses it.")


def check_next(config: dict[str, Any], where: str) -> None:
    """Refuse a Qwen3-Next that llama.cpp's qwen3next would run otherwise."""
    if int(config["linear_num_value_heads"]) % int(config["linear_num_key_heads"]):
        raise UserError(f"{where}: linear_num_value_heads {config['linear_num_value_heads']} is not a multiple of "
                        f"linear_num_key_heads {config['linear_num_key_heads']}; GGUF export refuses it.")
    if not config.get("norm_topk_prob", True) or config.get("mlp_only_layers") \
            or int(config.get("decoder_sparse_step") or 1) != 1:
        raise UserError(f"{where}: norm_topk_prob={config.get('norm_topk_prob')}, mlp_only_layers "
                        f"{config.get('mlp_only_layers')} or decoder_sparse_step {config.get('decoder_sparse_step')} is not "
                        "llama.cpp's qwen3next (experts in every layer, their weights renormalised); GGUF export refuses it.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise UserError(f"{where}: RoPE scaling '{rope.get('rope_type') or rope.get('type')}' is not written for "
                        "llama.cpp's qwen3next by finetuner; GGUF export refuses it.")


def linear_layers(config: dict[str, Any]) -> list[bool]:
    """Which layers are Gated DeltaNet (``layer_types``, else every ``full_attention_interval``-th layer attends)."""
    n, every = int(config["num_hidden_layers"]), int(config.get("full_attention_interval") or 4)
    types = config.get("layer_types")
    return [t == "linear_attention" for t in types] if types else [(i + 1) % every != 0 for i in range(n)]


def write_metadata(writer, config: dict[str, Any], n_layers: int) -> None:
    """Qwen3.5's GGUF metadata, as the converter (``TextModel``, ``Qwen3NextModel`` and ``_Qwen35MRopeMixin``'s
    ``set_gguf_parameters``) writes it."""
    rope = config.get("rope_parameters") or {}
    heads = int(config["num_attention_heads"])
    head = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    writer.add_block_count(n_layers)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    if config.get("intermediate_size"):  # Qwen3.5-MoE has none: its feed-forward is the experts'
        writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 1e7))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_ssm_conv_kernel(int(config["linear_conv_kernel_dim"]))
    writer.add_ssm_state_size(int(config["linear_key_head_dim"]))
    writer.add_ssm_group_count(int(config["linear_num_key_heads"]))
    writer.add_ssm_time_step_rank(int(config["linear_num_value_heads"]))
    writer.add_ssm_inner_size(int(config["linear_value_head_dim"]) * int(config["linear_num_value_heads"]))
    writer.add_array(RECURRENT_LAYERS.format(arch=writer.arch), linear_layers(config))
    writer.add_full_attention_interval(int(config.get("full_attention_interval") or 4))
    writer.add_rope_dimension_count(rotary_dims(config))
    if config.get("model_type") != NEXT:  # Qwen3.5's interleaved M-RoPE
        writer.add_rope_dimension_sections(mrope_sections(config))
    if config.get("num_experts"):  # Qwen3.5-MoE (qwen35moe): the routed experts and the shared one (Qwen2MoeModel's keys)
        writer.add_expert_count(int(config["num_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))


def rotary_dims(config: dict[str, Any]) -> int:
    """How many of a head's dimensions RoPE turns (``partial_rotary_factor`` of ``head_dim``)."""
    rope = config.get("rope_parameters") or {}
    head = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    return int(head * float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))))


def mrope_sections(config: dict[str, Any]) -> list[int]:
    """The M-RoPE sections llama.cpp's qwen35 requires: the config's ``mrope_section``, else each rotary pair dealt to
    the time, height and width sections in turn, as llama.cpp's interleaved M-RoPE reads them (pair i to section
    i mod 3). For Qwen3.5's 32 rotary pairs that is the converter's default [11, 11, 10, 0] (``_Qwen35MRopeMixin``);
    a head that turns fewer pairs gets fewer (ggml asserts ``sect_dims <= ne0``), and a pair left out of every section
    would take the fourth position, 0 on text: not turned). Text alone gives the three sections the same position, so
    they rotate as plain RoPE."""
    given = (config.get("rope_parameters") or {}).get("mrope_section")
    pairs = rotary_dims(config) // 2
    sections = [int(x) for x in given] if given else [len(range(k, pairs, 3)) for k in range(3)]
    return (sections + [0, 0, 0, 0])[:4]


def source_key(own: str) -> str:
    """The checkpoint name gguf's map knows the tensor by (``dt_bias`` as ``dt_proj.bias``: the converter's rename)."""
    return own[: -len(".dt_bias")] + ".dt_proj.bias" if own.endswith(".dt_bias") else own


def squeezed(hf_name: str) -> bool:
    return hf_name.endswith("linear_attn.conv1d.weight")


def stored_shape(hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`transform` gives a tensor of ``shape``."""
    return (shape[0], shape[-1]) if squeezed(hf_name) else shape


def tiled(w, axis: int, n_k: int, per_k: int, width: int):
    """The value heads along ``axis`` from grouped by key head to tiled (the converter's ``_reorder_v_heads``)."""
    import numpy as np

    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(n_k, per_k, width, *rest).swapaxes(0, 1).reshape(n_k * per_k * width, *rest)
    return np.moveaxis(w, 0, axis)


def transform(config: dict[str, Any], hf_name: str, w):
    """The tensor as the converter stores it (a float32 numpy array in, one out)."""
    import numpy as np

    n_k, n_v = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    k_dim, v_dim = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    if squeezed(hf_name):
        w = w.reshape(stored_shape(hf_name, w.shape))
    if n_k != n_v and "linear_attn." in hf_name and config.get("model_type") != NEXT:  # _LinearAttentionVReorderBase
        per_k, qk = n_v // n_k, 2 * n_k * k_dim
        if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # only the value rows (channels)
            w = np.concatenate([w[:qk], tiled(w[qk:], 0, n_k, per_k, v_dim)])
        elif hf_name.endswith("in_proj_z.weight"):
            w = tiled(w, 0, n_k, per_k, v_dim)
        elif hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
            w = tiled(w, 0, n_k, per_k, 1)
        elif hf_name.endswith("out_proj.weight"):
            w = tiled(w, 1, n_k, per_k, v_dim)
    if hf_name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors
        return -np.exp(w)
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        return w + 1
    return w

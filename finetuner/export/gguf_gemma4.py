"""Gemma 4's text model (``gemma4_text``) as llama.cpp's converter writes it (``Gemma4Model`` in its
``conversion/gemma.py``): its metadata and the tensors the checkpoint does not hold.

Gemma 4 mixes sliding-window layers (head width ``head_dim``, RoPE at the sliding base over the whole head) with
full-attention layers (a wider head, ``per_layer_config`` or ``global_head_dim``, and "proportional" RoPE that turns
only ``partial_rotary_factor`` of the head). llama.cpp reads the two head widths as ``attention.key_length`` and
``attention.key_length_swa``, which layers slide from ``attention.sliding_window_pattern``, and runs the proportional
RoPE over the full head with a ``rope_freqs`` tensor whose unturned pairs have the factor 1e30 (the converter's
``generate_extra_tensors``). Unlike Gemma 2 and 3 its norms multiply by the weight itself (the converter's
``norm_shift`` is 0), and each layer's ``layer_scalar`` is stored as ``layer_output_scale.weight``. The per-layer input
embeddings (``embed_tokens_per_layer``, ``per_layer_model_projection``...) keep their shapes.

Refused, in one line each (llama.cpp's gemma4 would run them otherwise, or finetuner does not write them yet): the
mixture-of-experts block, the double-wide MLP of the key-value-sharing layers, keys reused as values
(``attention_k_eq_v``), bidirectional attention, other per-layer settings than the full layers' head width and
key-value heads, and RoPE other than Gemma 4's (default on the sliding layers, proportional on the full ones).
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError

#: checkpoint parameters without a ``.weight`` suffix that the converter stores with one (its ``filter_tensors``)
WEIGHT_SUFFIXED = ("layer_scalar", "per_dim_scale")


def check(config: dict[str, Any], where: str) -> None:
    """Refuse (a UserError naming the setting) what llama.cpp's gemma4 would run otherwise, or finetuner does not write."""
    for key, why in (("enable_moe_block", "its mixture-of-experts block is not written by finetuner"),
                     ("use_double_wide_mlp", "the double-wide MLP of its key-value-sharing layers is not written by finetuner"),
                     ("attention_k_eq_v", "keys reused as values are not written by finetuner"),
                     ("use_bidirectional_attention", "llama.cpp's gemma4 attends causally on text")):
        if config.get(key):
            raise UserError(f"{where}: {key}={config[key]!r}: {why}; GGUF export refuses it.")
    rope = config.get("rope_parameters") or {}
    full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    if full.get("rope_type") != "proportional" or (local.get("rope_type") or "default") != "default":
        raise UserError(f"{where}: RoPE {rope} is not Gemma 4's (default on the sliding layers, proportional on the full "
                        "ones), which llama.cpp's converter writes; GGUF export refuses it.")
    for layer, settings in (config.get("per_layer_config") or {}).items():
        other = set(settings) - {"head_dim", "num_key_value_heads"}
        if other or layer_types(config)[int(layer)] != "full_attention":
            raise UserError(f"{where}: per_layer_config of layer {layer} ({settings}) is not the full-attention layers' head "
                            "width and key-value heads that llama.cpp's gemma4 reads; GGUF export refuses it.")


def layer_types(config: dict[str, Any]) -> list[str]:
    """Each layer's attention kind (``layer_types``; Gemma4TextConfig's default: every sixth layer full)."""
    n = int(config["num_hidden_layers"])
    types = list(config.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types[-1] = "full_attention"  # Gemma4TextConfig forces the last layer to attend fully
    return types


def full_setting(config: dict[str, Any], key: str, default: Any) -> Any:
    """A full-attention layer's ``head_dim`` or ``num_key_value_heads`` (its ``per_layer_config``, else the config's
    ``global_head_dim`` / ``num_global_key_value_heads``), as the converter's ``set_gguf_parameters`` finds it."""
    for layer, settings in sorted((config.get("per_layer_config") or {}).items(), key=lambda kv: int(kv[0])):
        if layer_types(config)[int(layer)] == "full_attention" and key in settings:
            return int(settings[key])
    return config.get({"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}[key]) or default


def write_metadata(writer, config: dict[str, Any], n_layers: int) -> None:
    """Gemma 4's GGUF metadata, as llama.cpp's converter (``Gemma3Model`` and ``Gemma4Model.set_gguf_parameters``)
    writes it."""
    rope = config["rope_parameters"]
    swa = [t == "sliding_attention" for t in layer_types(config)]
    head_swa = int(config["head_dim"])
    head_full = int(full_setting(config, "head_dim", 512))
    kv_swa = int(config["num_key_value_heads"])
    kv_full = int(full_setting(config, "num_key_value_heads", kv_swa))
    writer.add_block_count(n_layers)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv([kv_swa if s else kv_full for s in swa] if kv_full != kv_swa else kv_swa)
    writer.add_rope_freq_base(float(rope["full_attention"].get("rope_theta", 1e6)))
    writer.add_rope_freq_base_swa(float(rope["sliding_attention"].get("rope_theta", 1e4)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    writer.add_vocab_size(int(config["vocab_size"]))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    writer.add_sliding_window(int(config["sliding_window"]))
    writer.add_shared_kv_layers(int(config.get("num_kv_shared_layers") or 0))
    writer.add_embedding_length_per_layer_input(int(config.get("hidden_size_per_layer_input") or 0))
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(head_full)
    writer.add_value_length(head_full)
    writer.add_key_length_swa(head_swa)
    writer.add_value_length_swa(head_swa)
    writer.add_rope_dimension_count(head_full)  # proportional: the whole head, the unturned pairs by rope_freqs
    writer.add_rope_dimension_count_swa(int(head_swa * float(rope["sliding_attention"].get("partial_rotary_factor", 1.0))))


def rope_freqs(config: dict[str, Any]):
    """The full-attention layers' RoPE frequency factors: 1 for the turned pairs, 1e30 (no rotation) for the others
    (the converter's ``Gemma4Model.generate_extra_tensors``)."""
    import numpy as np

    head_full = int(full_setting(config, "head_dim", 512))
    turned = int(head_full * float(config["rope_parameters"]["full_attention"]["partial_rotary_factor"]) / 2)
    return np.asarray([1.0] * turned + [1e30] * (head_full // 2 - turned), dtype=np.float32)

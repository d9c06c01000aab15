"""Which models GGUF export handles, and how their config and tensors become GGUF metadata and tensors.

Supported: the Llama family (``model_type`` ``llama``), Mistral (written as llama.cpp writes it: the
``llama`` architecture), Qwen2 and Qwen3 (Qwen2's layout with per-head q/k norms, llama.cpp's ``qwen3``
architecture), Phi-3 (its fused qkv and gate_up as llama.cpp's ``phi3`` reads them), Gemma 2 (norms stored as
``1 + weight``, as llama.cpp's converter writes them; its soft-capping and sliding window; llama.cpp scales the
queries by the head width, or by hidden / heads for the 46-layer 27B, so another ``query_pre_attn_scalar`` is
refused), Gemma 3's text model (``gemma3_text``: its norms as Gemma 2's, every sixth layer global as llama.cpp's
``gemma3`` runs it, the global layers' RoPE linearly scaled, the local ones' at base 10,000), the language models of
image-text checkpoints (Gemma 3's, LLaVA's; Qwen2-VL's and Qwen2.5-VL's as llama.cpp's ``qwen2vl``: Qwen2's tensors
with the M-RoPE sections, ``rope.dimension_sections``), Gemma 4's text model (its two head widths, proportional
RoPE and per-layer input embeddings as :mod:`finetuner.export.gguf_gemma4` writes them), Qwen3.5's and Qwen3.5-MoE's
text models and Qwen3-Next (their Gated DeltaNet layers as :mod:`finetuner.export.gguf_qwen35` writes them), Mamba, Falcon-Mamba,
Mamba-2, LFM2 and LFM2-MoE (their scans and short convolutions as :mod:`finetuner.export.gguf_recurrent` writes them),
Granite 4.0-H and Bamba (:mod:`finetuner.export.gguf_granite`), Falcon-H1 (its muP multipliers folded into the
weights by :mod:`finetuner.export.gguf_falcon_h1`), Nemotron-H (its Mamba, attention, MLP and expert blocks as
:mod:`finetuner.export.gguf_nemotron_h` writes them), Jamba (:mod:`finetuner.export.gguf_jamba`).
The other newest families (:data:`NOT_WRITTEN`: Gemma 3n, Kimi Linear, Zamba...) are refused in one line that says whether the installed gguf package lacks llama.cpp's
architecture or finetuner's mapping to it is not written yet. Names come from gguf's own ``TensorNameMap`` for the
architecture, and every tensor must be one of the architecture's ``MODEL_TENSORS``: a model with
tensors llama.cpp would not load is refused, not written. Llama and Mistral store the query and
key projections permuted the way llama.cpp's rotary embedding expects (llama.cpp's converter does
the same; transformers' GGUF loader undoes it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from finetuner.errors import UserError
from finetuner.export import (gguf_falcon_h1, gguf_gemma4, gguf_granite, gguf_jamba, gguf_nemotron_h, gguf_qwen35,
                              gguf_recurrent)
from finetuner.export.gguf_recurrent import RECURRENT

#: transformers ``model_type`` → (llama.cpp architecture name, q/k permuted for llama.cpp's RoPE)
SUPPORTED = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
             "phi3": ("phi3", False), "gemma2": ("gemma2", False), "gemma3_text": ("gemma3", False),
             "qwen3_moe": ("qwen3moe", False), "qwen2_vl_text": ("qwen2vl", False), "qwen2_5_vl_text": ("qwen2vl", False),
             "qwen3_vl_text": ("qwen3vl", False), "gemma4_text": ("gemma4", False),
             "qwen3_5_text": ("qwen35", False), "qwen3_5_moe_text": ("qwen35moe", False),
             "qwen3_next": ("qwen3next", False),
             "granitemoehybrid": (gguf_granite.ARCH, True), "bamba": (gguf_granite.ARCH, False),
             "falcon_h1": (gguf_falcon_h1.ARCH, False), "nemotron_h": (gguf_nemotron_h.ARCH, False),
             "jamba": (gguf_jamba.ARCH, False),
             **{mt: (arch, False) for mt, arch in RECURRENT.items()}}
#: the newest families (issue 56) that finetuner plans and trains but does not write to GGUF yet → the llama.cpp
#: architecture llama.cpp's converter writes them as (None: llama.cpp has none); the refusal says which is missing
NOT_WRITTEN = {"gemma3n_text": "gemma3n",
               "kimi_linear": "kimi-linear", "zamba": None, "zamba2": None}
#: families whose RMSNorm multiplies by ``1 + weight``: llama.cpp's (and its converter's) norms store ``1 + weight``
ONE_PLUS_NORMS = ("gemma2", "gemma3_text")
ROPE_TYPES = ("default", "llama3", "linear")


@dataclass
class Arch:
    """A supported model's GGUF architecture and the hyper-parameters the export needs."""

    model_type: str
    gguf_arch: str
    permute_qk: bool
    config: dict[str, Any]
    n_layers: int
    n_head: int
    n_kv_head: int
    head_dim: int
    rope: dict[str, Any] = field(default_factory=dict)
    #: the image-text-to-text checkpoint's model_type when only its language model is written (None: a causal LM)
    text_of: str | None = None
    #: Qwen3-VL: how many of the language model's first layers take the vision tower's DeepStack features
    deepstack_layers: int = 0

    def language_name(self, hf_name: str) -> str | None:
        """The name of a checkpoint tensor as the language model's own (``model.language_model.x`` →
        ``model.x``), or None for a vision tower's or projector's, which llama.cpp reads from an mmproj file."""
        if self.text_of is None:
            return hf_name
        if hf_name.startswith(VISION_PREFIXES):
            return None
        for prefix, own in LANGUAGE_PREFIXES:  # transformers 5's names and the checkpoints' (transformers 4's)
            if hf_name.startswith(prefix):
                return own + hf_name[len(prefix):]
        return hf_name

    @property
    def rope_type(self) -> str:
        return self.rope.get("rope_type") or self.rope.get("type") or "default"

    @property
    def rope_theta(self) -> float:
        return float(self.rope.get("rope_theta") or self.config.get("rope_theta") or 10000.0)

    def write_metadata(self, writer) -> None:
        c = self.config
        if self.model_type in RECURRENT:  # Mamba's scan, LFM2's short convolutions: their own keys
            gguf_recurrent.write_metadata(writer, c, self.n_layers)
            return
        if self.gguf_arch == "gemma4":  # two head widths, the sliding pattern, the per-layer inputs
            gguf_gemma4.write_metadata(writer, c, self.n_layers)
            return
        if self.gguf_arch == gguf_granite.ARCH:  # the Mamba-2 layers' widths, Granite's multipliers, RoPE off
            gguf_granite.write_metadata(writer, c, self.n_layers)
            return
        if self.gguf_arch in gguf_qwen35.ARCHES:  # the Gated DeltaNet's widths, which layers are linear
            gguf_qwen35.write_metadata(writer, c, self.n_layers)
            return
        if self.gguf_arch == gguf_falcon_h1.ARCH:  # the Mamba-2 mixer's widths beside attention's
            gguf_falcon_h1.write_metadata(writer, c, self.n_layers)
            return
        if self.gguf_arch in gguf_nemotron_h.ARCHES:  # each layer's block, told apart by two per-layer arrays
            gguf_nemotron_h.write_metadata(writer, c, self.n_layers)
            return
        if self.gguf_arch == gguf_jamba.ARCH:  # Mamba's widths, the attention layers, the experts
            gguf_jamba.write_metadata(writer, c, self.n_layers)
            return
        writer.add_context_length(int(c["max_position_embeddings"]))
        writer.add_embedding_length(int(c["hidden_size"]))
        writer.add_block_count(self.n_layers)
        writer.add_feed_forward_length(int(c["intermediate_size"]))
        writer.add_head_count(self.n_head)
        writer.add_head_count_kv(self.n_kv_head)
        writer.add_rope_freq_base(self.rope_theta)
        writer.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
        writer.add_vocab_size(int(c["vocab_size"]))
        if self.gguf_arch in ("llama", "phi3"):  # phi3: its fused qkv and gate_up as llama.cpp's phi3 reads them
            writer.add_rope_dimension_count(self.head_dim)
        if self.gguf_arch == "gemma2":  # soft-capping and the sliding window of its local layers
            writer.add_attn_logit_softcapping(float(c.get("attn_logit_softcapping") or 50.0))
            writer.add_final_logit_softcapping(float(c.get("final_logit_softcapping") or 30.0))
            writer.add_sliding_window(int(c.get("sliding_window") or 4096))
        if self.gguf_arch == "gemma3":  # its local layers' window (llama.cpp: every sixth layer global)
            writer.add_sliding_window(int(c.get("sliding_window") or 512))
        if self.rope_type == "linear":  # positions divided by the factor (Gemma-3-4B and up: 8, global layers)
            import gguf

            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(self.rope.get("factor", 1.0)))
        if self.head_dim != int(c["hidden_size"]) // self.n_head:
            writer.add_key_length(self.head_dim)
            writer.add_value_length(self.head_dim)
        if self.gguf_arch in ("qwen2vl", "qwen3vl"):  # M-RoPE: each position's (time, height, width) sections
            writer.add_rope_dimension_sections(mrope_sections(self.rope))
        if self.gguf_arch == "qwen3vl":
            writer.add_num_deepstack_layers(self.deepstack_layers)
        if self.gguf_arch == "qwen3moe":  # the routed experts: how many, how many a token, each one's width
            writer.add_expert_count(int(c.get("num_experts") or c["num_local_experts"]))
            writer.add_expert_used_count(int(c["num_experts_per_tok"]))
            writer.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))

    def stored_shape(self, hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape GGUF stores for a checkpoint tensor of ``shape`` (what :meth:`transform` returns)."""
        if self.model_type in RECURRENT:
            return gguf_recurrent.stored_shape(self.config, hf_name, shape)
        if self.gguf_arch in gguf_qwen35.ARCHES:
            return gguf_qwen35.stored_shape(hf_name, shape)
        if self.gguf_arch == gguf_granite.ARCH:
            return gguf_granite.stored_shape(self.config, hf_name, shape)
        if self.gguf_arch == gguf_falcon_h1.ARCH:
            return gguf_falcon_h1.stored_shape(self.config, hf_name, shape)
        if self.gguf_arch in gguf_nemotron_h.ARCHES:
            return gguf_nemotron_h.stored_shape(self.config, hf_name, shape)
        if self.gguf_arch == gguf_jamba.ARCH:
            return gguf_jamba.stored_shape(hf_name, shape)
        return shape

    def halves(self, own: str) -> tuple[tuple[str, str], int] | None:
        """A fused gate-and-up tensor this architecture writes as two GGUF tensors: their names and the axis it is split
        on (Granite's ``input_linear``); None for any other."""
        return gguf_granite.halves(own) if self.gguf_arch == gguf_granite.ARCH else None

    def source_key(self, own: str) -> str:
        """The checkpoint name gguf's ``TensorNameMap`` knows ``own`` by (the converter's renames)."""
        if self.gguf_arch in gguf_qwen35.ARCHES:
            return gguf_qwen35.source_key(own)
        if self.gguf_arch in gguf_nemotron_h.ARCHES:
            return gguf_nemotron_h.source_key(own)
        if self.gguf_arch == gguf_jamba.ARCH:
            return gguf_jamba.source_key(own)
        mamba2 = self.model_type in RECURRENT or self.gguf_arch in (gguf_granite.ARCH, gguf_falcon_h1.ARCH)
        return gguf_recurrent.source_key(own) if mamba2 else own

    def transform(self, hf_name: str, w):
        """The tensor as GGUF stores it (a float32 numpy array in, one out)."""
        if self.model_type in RECURRENT:
            return gguf_recurrent.transform(self.config, hf_name, w)
        if self.gguf_arch == gguf_granite.ARCH and (".mamba." in hf_name or not self.permute_qk):  # A, D, the norm and
            # the convolution reshaped; Bamba's queries and keys, of which only the first half of each head turns
            return gguf_granite.transform(self.config, hf_name, w)
        if self.gguf_arch == gguf_falcon_h1.ARCH:  # its muP multipliers folded in, the mixer as Mamba-2's
            return gguf_falcon_h1.transform(self.config, hf_name, w)
        if self.gguf_arch in gguf_nemotron_h.ARCHES:  # the Mamba mixers as Mamba-2's
            return gguf_nemotron_h.transform(self.config, hf_name, w)
        if self.gguf_arch == gguf_jamba.ARCH:  # the Mamba layers as Mamba's
            return gguf_jamba.transform(hf_name, w)
        if self.gguf_arch in gguf_qwen35.ARCHES:  # A, the convolution, the zero-centred norms, the value heads tiled
            return gguf_qwen35.transform(self.config, hf_name, w)
        if self.model_type in ONE_PLUS_NORMS and hf_name.endswith("norm.weight"):
            return w + 1
        if self.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return permute_for_rope(w, self.n_head, self.n_head)
        if self.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return permute_for_rope(w, self.n_head, self.n_kv_head)
        return w

    def extra_tensors(self) -> dict[str, Any]:
        """Tensors llama.cpp needs that the checkpoint does not hold (Llama 3.1's RoPE frequency factors, Gemma 4's
        full-attention layers' proportional RoPE)."""
        if self.gguf_arch == "gemma4":
            return {"rope_freqs.weight": gguf_gemma4.rope_freqs(self.config)}
        if self.rope_type != "llama3":
            return {}
        import numpy as np

        return {"rope_freqs.weight": np.asarray(llama3_rope_factors(self.rope, self.rope_theta, self.head_dim), dtype=np.float32)}


def mrope_sections(rope: dict[str, Any]) -> list[int]:
    """Qwen2-VL's and Qwen2.5-VL's ``mrope_section`` as llama.cpp's ``rope.dimension_sections``: four numbers, the
    missing ones 0 (llama.cpp's converter)."""
    sections = [int(x) for x in rope.get("mrope_section") or []]
    return (sections + [0, 0, 0, 0])[:4]


def permute_for_rope(w, n_head: int, n_kv_head: int):
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved (rows of ``w``)."""
    if n_kv_head != n_head:
        n_head = n_kv_head
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict[str, Any], theta: float, head_dim: int) -> list[float]:
    """Per-frequency divisors of Llama 3.1's RoPE scaling, as llama.cpp's converter computes them."""
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


#: an image-text-to-text checkpoint's language model tensors, and their names in a causal LM's checkpoint
LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("model.text_model.", "model."))
#: where an image-text-to-text checkpoint keeps what is not its language model (Qwen-VL's tower and merger: visual;
#: Idefics3's and SmolVLM's: vision_model and connector)
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
                   "model.visual.", "visual.", "model.vision_model.", "model.connector.")


def arch_for(config: dict[str, Any], where: str) -> Arch:
    """The :class:`Arch` of a model's ``config.json`` contents, or a UserError naming what is supported. For an
    image-text-to-text checkpoint (Gemma 3), its language model's."""
    if "vision_config" in config and "text_config" not in config:  # a checkpoint of transformers 4's layout
        config = nested_config(config)  # (Qwen2.5-VL's on the hub: the language model's settings at the top)
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:
        inner = {**text, **({"tie_word_embeddings": config["tie_word_embeddings"]} if "tie_word_embeddings" in config else {})}
        arch = arch_for(inner, where)
        arch.text_of = str(config.get("model_type"))
        arch.deepstack_layers = len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or [])
        return arch
    mt = config.get("model_type")
    supported = ("Llama family (llama), Mistral (mistral), Qwen2 (qwen2), Qwen3 (qwen3), Qwen3-MoE (qwen3_moe), Phi-3 (phi3), "
                 "Gemma 2 (gemma2), Gemma 3 text (gemma3_text), Gemma 4 text (gemma4_text), Qwen3.5 text (qwen3_5_text) and the language models of Gemma 3, LLaVA, Qwen2-VL, "
                 "Qwen2.5-VL, Qwen3-VL, Idefics3 and SmolVLM; Mamba (mamba), Falcon-Mamba (falcon_mamba), Mamba-2 "
                 "(mamba2), LFM2 (lfm2), LFM2-MoE (lfm2_moe), Granite 4.0-H (granitemoehybrid), Bamba (bamba), Falcon-H1 (falcon_h1), Nemotron-H (nemotron_h), Jamba "
                 "(jamba) and Qwen3-Next (qwen3_next)")
    if mt in NOT_WRITTEN:
        raise not_written(mt, where)
    if mt not in SUPPORTED:
        raise UserError(f"{where}: GGUF export does not support model_type '{mt}'; it supports the {supported}.",
                        hint="Use `finetuner merge` for a transformers folder, and llama.cpp's convert_hf_to_gguf.py on it.")
    if mt == "qwen3_moe":
        if not config.get("norm_topk_prob", False):  # llama.cpp's qwen3moe always renormalises the top-k weights
            raise UserError(f"{where}: norm_topk_prob=false is not llama.cpp's qwen3moe (it renormalises the chosen "
                            "experts' weights); GGUF export refuses it.")
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
            raise UserError(f"{where}: dense layers among the experts' (mlp_only_layers, decoder_sparse_step) are not "
                            "llama.cpp's qwen3moe; GGUF export refuses it.")
    if mt == "gemma4_text":  # its RoPE and head widths per kind of layer: gguf_gemma4's
        gguf_gemma4.check(config, where)
        n_head = int(config["num_attention_heads"])
        return Arch(mt, "gemma4", False, config, int(config["num_hidden_layers"]), n_head,
                    int(config.get("num_key_value_heads") or n_head), int(config["head_dim"]), {})
    if mt in gguf_granite.MODEL_TYPES:  # its Mamba-2 layers' settings: gguf_granite's
        gguf_granite.check(config, where)
        n_head = int(config["num_attention_heads"])
        return Arch(mt, gguf_granite.ARCH, SUPPORTED[mt][1], config, int(config["num_hidden_layers"]), n_head,
                    int(config.get("num_key_value_heads") or n_head), int(config["hidden_size"]) // n_head, {})
    if mt == "falcon_h1":  # its Mamba-2 mixer's settings and multipliers: gguf_falcon_h1's
        gguf_falcon_h1.check(config, where)
        n_head = int(config["num_attention_heads"])
        return Arch(mt, gguf_falcon_h1.ARCH, False, config, int(config["num_hidden_layers"]), n_head,
                    int(config.get("num_key_value_heads") or n_head), gguf_falcon_h1.head_dim(config), {})
    if mt == "jamba":  # its Mamba layers' settings: gguf_jamba's
        gguf_jamba.check(config, where)
        n_head = int(config["num_attention_heads"])
        return Arch(mt, gguf_jamba.ARCH, False, config, int(config["num_hidden_layers"]), n_head,
                    int(config.get("num_key_value_heads") or n_head), int(config["hidden_size"]) // n_head, {})
    if mt == "nemotron_h":  # its blocks and experts: gguf_nemotron_h's (nemotron_h_moe with experts)
        gguf_nemotron_h.check(config, where)
        n_head = int(config["num_attention_heads"])
        return Arch(mt, gguf_nemotron_h.arch_of(config), False, config, len(gguf_nemotron_h.pattern(config)), n_head,
                    int(config.get("num_key_value_heads") or n_head), int(config["head_dim"]), {})
    if mt in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):  # the Gated DeltaNet's settings: gguf_qwen35's
        gguf_qwen35.check(config, where)
        n_head = int(config["num_attention_heads"])
        return Arch(mt, SUPPORTED[mt][0], False, config, int(config["num_hidden_layers"]), n_head,
                    int(config.get("num_key_value_heads") or n_head),
                    int(config.get("head_dim") or int(config["hidden_size"]) // n_head), {})
    if config.get("mlp_bias"):
        raise UserError(f"{where}: mlp_bias=true is not part of llama.cpp's {mt} architecture; GGUF export refuses it.")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "full_attention" in rope:  # Gemma 3: per kind of layer; llama.cpp reads the global layers' and runs the
        local = dict(rope.get("sliding_attention") or {})  # local ones at base 10,000 unscaled
        if float(local.get("rope_theta", 10000.0)) != 10000.0 or (local.get("rope_type") or "default") != "default":
            raise UserError(f"{where}: its sliding-window layers' RoPE ({local}) is not llama.cpp's gemma3 (base 10000, "
                            "unscaled); GGUF export refuses it.")
        rope = dict(rope["full_attention"])
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UserError(f"{where}: RoPE scaling '{rope_type}' is not supported by GGUF export (supported: {', '.join(ROPE_TYPES)}).")
    gguf_arch, permute = SUPPORTED[mt]
    if gguf_arch == "qwen3vl" and not rope.get("mrope_interleaved", False):
        raise UserError(f"{where}: llama.cpp's qwen3vl interleaves the M-RoPE sections; this model does not "
                        "(mrope_interleaved false), so GGUF export refuses it.")
    if gguf_arch in ("qwen2vl", "qwen3vl"):  # llama.cpp's M-RoPE: the sections must cover each head's rotary pairs
        head = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
        if sum(mrope_sections(rope)) != head // 2 or len(rope.get("mrope_section") or []) > 4:
            raise UserError(f"{where}: its M-RoPE sections {rope.get('mrope_section')} do not cover the {head // 2} "
                            f"rotary pairs of a head as llama.cpp's {gguf_arch} reads them; GGUF export refuses it.")
    if mt == "gemma3_text":  # llama.cpp's gemma3: every sixth layer global, the others sliding
        types = config.get("layer_types") or []
        want = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(int(config["num_hidden_layers"]))]
        if types and list(types) != want:
            raise UserError(f"{where}: its layers' attention kinds are not llama.cpp's gemma3 pattern (every sixth "
                            "layer global); GGUF export refuses it.")
    if mt in ("gemma2", "gemma3_text"):
        hd = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
        scalar = config.get("query_pre_attn_scalar", 256)
        if scalar != hd and not (int(config["num_hidden_layers"]) == 46
                                 and scalar == int(config["hidden_size"]) // int(config["num_attention_heads"])):
            raise UserError(f"{where}: query_pre_attn_scalar {scalar} is neither the head width {hd} nor Gemma-2-27B's; "
                            "llama.cpp's gemma2 would scale the queries otherwise, so GGUF export refuses it.")
    gguf_recurrent.check(config, where)
    if mt in RECURRENT and not config.get("num_attention_heads"):  # Mamba: no attention
        return Arch(mt, gguf_arch, permute, config, int(config["num_hidden_layers"]), 0, 0, 0, rope)
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // n_head)
    return Arch(mt, gguf_arch, permute, config, int(config["num_hidden_layers"]), n_head, n_kv, head_dim, rope)


def not_written(model_type: str, where: str) -> UserError:
    """The one-line refusal of a family in :data:`NOT_WRITTEN`: what is missing, the installed gguf package's
    architecture (it names the tensors llama.cpp loads) or finetuner's mapping to it."""
    import gguf
    from importlib.metadata import version

    arch = NOT_WRITTEN[model_type]
    if arch is None:
        missing = "llama.cpp has no architecture for it"
    elif arch not in gguf.MODEL_ARCH_NAMES.values():
        missing = f"the installed gguf package ({version('gguf')}) has no '{arch}' architecture"
    else:
        missing = (f"the installed gguf package ({version('gguf')}) knows llama.cpp's '{arch}' architecture, but finetuner's "
                   "mapping to it is not written yet")
    return UserError(f"{where}: GGUF export of model_type '{model_type}': {missing}; nothing was written.",
                     hint="Use `finetuner merge` for a transformers folder instead; "
                          "docs/export_families.md lists what each family needs.")


def nested_config(config: dict[str, Any]) -> dict[str, Any]:
    """An image-text ``config.json`` as the installed transformers reads it: with a ``text_config`` (transformers 4's
    layout has the language model's settings at the top, as Qwen2-VL's and Qwen2.5-VL's checkpoints on the hub have
    them) and every setting the file leaves to its defaults (SmolVLM2's tower widths); the config as it is where
    transformers cannot read it."""
    from finetuner.model.inventory import transformers_config

    try:
        nested = transformers_config(config).to_dict()
    except Exception:  # noqa: BLE001 - a config transformers cannot read: arch_for refuses it by its model_type
        return config
    return nested if isinstance(nested.get("text_config"), dict) else config

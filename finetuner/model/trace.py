"""What one decoder layer saves for backward, traced from the model itself: a check of the memory model's terms.

The memory model's activation terms (:func:`finetuner.memory.activations.layer_activation_terms`) are written from
transformers' forward code and measured on a GPU for Llama (docs/memory.md). For every other family they are
applied to the layout read from the model, which can miss what a family's layer saves beyond it (an extra norm,
a gate, a cast). This module asks the model instead: the causal LM is built on the ``meta`` device (no weight
takes memory), LoRA is applied as the trainer applies it (peft, ``all-linear``), and one forward of a decoder
layer runs under :func:`torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for
backward; each storage is counted once and parameters are left out. Two lengths give bytes = a + b·T.

What tracing on ``meta`` cannot see is stated, not guessed:

* the attention kernel: on ``meta`` SDPA falls back to its math path (a T x T matrix); the trace runs the
  attention through :class:`FlashLikeAttention` instead, which saves what FlashAttention-2 and PyTorch's
  flash kernels save (q, k, v, the output and the fp32 log-sum-exp), the kernel the trainer runs without a
  mask;
* the device: the trace runs in fp32 without autocast, the CPU's semantics (``Settings(platform="cpu")``);
  CUDA's autocast copies and bitsandbytes' layers are the formula's alone;
* routing: a mixture of experts picks its tokens' experts by value (data-dependent shapes, which ``meta``
  cannot run), so an MoE layer is not traced.

The inventory keeps each model's trace (:attr:`finetuner.model.inventory.Inventory.trace`); the memory model adds
what the trace holds beyond its named terms (:func:`finetuner.memory.activations.traced_excess`), and
``python -m scripts.dev.model_census`` compares the two for every supported family (docs/models.md's
"activations vs trace" column); ``tests/memory/test_trace.py`` holds the families of the common layout to it.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

#: the attention implementation the trace registers (transformers' AttentionInterface)
TRACE_ATTENTION = "finetuner_trace_flash"
#: the lengths the trace runs at (tokens, micro-batch 1): three, so a layer that materialises its attention
#: (T x T) is fitted exactly as a + b·T + c·T²
LENGTHS = (64, 128, 256)
#: the LoRA the trace applies (the settings :func:`finetuner.memory.activations.traced_excess` compares it under)
TRACE_LORA_R, TRACE_LORA_DROPOUT = 16, 0.05


@dataclass(frozen=True)
class LayerTrace:
    """Bytes one decoder layer saves for backward, fitted through :data:`LENGTHS`: ``constant`` + ``per_token``·T +
    ``per_token2``·T² (``per_token2`` > 0 only where the layer materialises its attention)."""

    constant: float
    per_token: float
    per_token2: float = 0.0

    def at(self, tokens: int) -> float:
        return self.constant + self.per_token * tokens + self.per_token2 * tokens * tokens


def _flash_like():
    import torch

    class FlashLikeAttention(torch.autograd.Function):
        """Stands in for a flash kernel on ``meta``: the output's shape, and exactly what the kernel saves."""

        @staticmethod
        def forward(ctx, q, k, v):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
            q, k, v, _, _ = ctx.saved_tensors
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def attention(module, query, key, value, attention_mask, **kwargs: Any):
        out = FlashLikeAttention.apply(query, key, value)
        return out.transpose(1, 2).contiguous(), None

    return attention


def register_trace_attention() -> None:
    """Register the trace's attention (:data:`TRACE_ATTENTION`) with transformers, once."""
    from transformers import AttentionInterface

    if TRACE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(TRACE_ATTENTION, _flash_like())


#: config keys of a chunked scan's chunk (Mamba-2's and its hybrids' ``chunk_size``): the scan pads the sequence
#: to whole chunks and keeps a state per chunk
CHUNK_KEYS = ("chunk_size", "mamba_chunk_size")


def trace_lengths(text_cfg: dict[str, Any]) -> tuple[int, int, int]:
    """The lengths a layer is traced at: :data:`LENGTHS`; for a chunked scan whose chunk is longer than their first,
    4, 8 and 16 chunks. Inside one chunk the padding to a whole chunk reads as a constant (Nemotron-H's default traced
    at 64, 128 and 256 tokens, chunks of 128, fits a negative b); over 1, 2 and 4 chunks the fit still bends down
    (Falcon-H1's default: 0.78 MB a token at 4,096 tokens where traced at 1,024, 2,048 and 4,096 it saves 1.69 MB a
    token, as at 8,192); from 4 chunks on it is a straight line."""
    chunk = max((int(text_cfg[k]) for k in CHUNK_KEYS if isinstance(text_cfg.get(k), int)), default=0)
    return LENGTHS if chunk <= LENGTHS[0] else (4 * chunk, 8 * chunk, 16 * chunk)


def trace_layer(cfg: dict[str, Any], lora_r: int = TRACE_LORA_R, lora_dropout: float = TRACE_LORA_DROPOUT,
                layer_index: int = 0, model: Any = None) -> LayerTrace:
    """Trace decoder layer ``layer_index`` of the model ``cfg`` (a ``config.json`` dict) under LoRA ``all-linear`` (the trainer's
    paths, :func:`finetuner.model.layout.all_linear_targets`) at :func:`trace_lengths`; raises RuntimeError when the layer cannot run on ``meta`` (say, an MoE's routing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from finetuner.model.inventory import build_on_meta, language_config, layer_modules
    from finetuner.model.layout import all_linear_targets

    register_trace_attention()
    text_cfg, outer = language_config(cfg)
    model = model if model is not None else build_on_meta(cfg if outer else text_cfg)  # a model given is changed
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        config._attn_implementation = TRACE_ATTENTION
        if hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"  # grouped_mm takes bf16 only; the trace runs in fp32
        for sub in ("text_config", "language_config"):
            if hasattr(config, sub):
                getattr(config, sub)._attn_implementation = TRACE_ATTENTION
    model = model.float()
    with warnings.catch_warnings():  # peft asks the model about checkpointing by a name transformers deprecates
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=lora_dropout,
                                                      target_modules=all_linear_targets(model)))  # as the trainer names them
    peft_model.train()
    _, layers = layer_modules(model, text_cfg.get("num_hidden_layers"))
    layer = layers[layer_index]
    inner = next((m for m in model.modules() if getattr(m, "rotary_emb", None) is not None and m is not layer), None)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    hidden = int(model.get_input_embeddings().embedding_dim)
    accepts = inspect.signature(layer.forward).parameters
    lm_cfg = getattr(layer, "config", None) or model.config.get_text_config()
    streams = int(getattr(lm_cfg, "altup_num_inputs", 0) or 0)  # Gemma 3n's AltUp: the layer reads every stream
    per_layer = int(getattr(lm_cfg, "hidden_size_per_layer_input", 0) or 0)
    totals: dict[int, int] = {}
    lengths = trace_lengths(text_cfg)
    for n in lengths:
        x = torch.empty(*((streams,) if streams else ()), 1, n, hidden, device="meta", requires_grad=True)
        pos = torch.arange(n, device="meta")[None]
        kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": pos}
        made_once = []  # inputs the model makes once for all layers (Gemma 3n/4's per-layer inputs)
        if per_layer and "per_layer_input" in accepts:
            made_once.append(torch.empty(1, n, per_layer, device="meta"))
            kwargs["per_layer_input"] = made_once[-1]
        if "shared_kv_states" in accepts:  # a layer that stores its keys and values for later layers (KV sharing)
            kwargs["shared_kv_states"] = {}
        if inner is not None:
            layer_types = getattr(inner.config, "layer_types", None)
            if "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters and layer_types:
                kwargs["position_embeddings"] = inner.rotary_emb(x, pos, layer_types[layer_index])  # Gemma 3's per type
            else:
                kwargs["position_embeddings"] = inner.rotary_emb(x, pos)
        seen: dict[int, int] = {}
        # the rotary cos/sin are made once for all layers (the model's forward), not by a layer
        shared = params | {t.untyped_storage()._cdata for t in (*(kwargs.get("position_embeddings") or ()), *made_once)}

        def pack(t, seen=seen, shared=shared):
            storage = t.untyped_storage()
            if storage._cdata not in shared:  # the layer's input counts: the residual sum before it saves nothing
                seen[storage._cdata] = storage.nbytes()
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                layer(x, **kwargs)
        except Exception as e:  # noqa: BLE001 - a layer meta cannot run: say why, in one line
            raise RuntimeError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]) from None
        totals[n] = sum(seen.values())
    (t1, t2, t3), (y1, y2, y3) = lengths, (totals[n] for n in lengths)
    c = ((y3 - y2) / (t3 - t2) - (y2 - y1) / (t2 - t1)) / (t3 - t1)  # the parabola through the three points
    c = c if abs(c * t3 * t3) > 1e-9 * max(y3, 1) else 0.0  # rounding of a straight line
    if c < 0:  # no layer saves less per token as T grows: the shortest length is the odd one (Qwen3.5's chunked delta
        # rule: from 64 tokens, one chunk, to 128 it adds 10 % more a token than beyond, where it is a straight line; a
        # parabola would fall to a tenth by 2,048): the line through the two longest lengths
        return LayerTrace(constant=y3 - (y3 - y2) / (t3 - t2) * t3, per_token=(y3 - y2) / (t3 - t2))
    b = (y2 - y1) / (t2 - t1) - c * (t1 + t2)
    return LayerTrace(constant=y1 - b * t1 - c * t1 * t1, per_token=b, per_token2=c)

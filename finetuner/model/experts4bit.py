"""A mixture of experts' fused expert weights held in 4-bit (QLoRA of the experts).

bitsandbytes quantizes ``torch.nn.Linear`` layers; transformers (5.x) stores a mixture of experts' experts as
3-D parameters (``gate_up_proj``: every expert's gate and up projections, ``down_proj``) in one module per
layer, which its bitsandbytes integration leaves in 16-bit. The experts are nearly all of such a model
(29.0B of Qwen3-30B-A3B's 30.5B parameters, 19.1B of gpt-oss-20b's 20.9B), so QLoRA without them fits no
24 GB card. Here each expert's two matrices are quantized with bitsandbytes' own blockwise 4-bit
(``quantize_4bit``: NF4 or FP4, double quantization as the recipe says, the same format as a ``Linear4bit``
weight) and the experts module runs the forward transformers' eager experts run, with each matmul through
``bitsandbytes.matmul_4bit``: the weight is dequantized for the product and again in the backward, never
saved for it (the experts are frozen; LoRA trains the attention, :func:`finetuner.model.layout.all_linear_paths`).

The module keeps transformers' flags (``has_gate``, ``has_bias``, ``is_transposed``, ``_apply_gate``: the
gated activation of its family, gpt-oss's clamped interleaved SwiGLU included) and its biases, routers and
norms, so one forward serves every family built with transformers' ``use_experts_implementation``; a module
without those flags is left in 16-bit and said so. Checked against the same model with its experts replaced by
their dequantized values (``tests/model/test_experts4bit.py``): outputs and input gradients equal.
"""

from __future__ import annotations

import logging
import types

log = logging.getLogger(__name__)

#: the 3-D weights of a transformers experts module, the first one read by the up (or gate+up) projection
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
#: where the quantized experts are kept on the module: ``{name: (packed per expert, quant state per expert)}``
_STORE = "_finetuner_experts_4bit"


def experts_modules(model) -> list[tuple[str, object]]:
    """The experts modules of ``model`` (peft-wrapped or not): modules with fused 3-D expert weights."""
    found = []
    for name, mod in model.named_modules():
        weights = [getattr(mod, w, None) for w in _WEIGHTS]
        if any(w is not None and getattr(w, "dim", lambda: 0)() == 3 for w in weights) or hasattr(mod, _STORE):
            found.append((name, mod))
    return found


def is_mixture_of_experts(model) -> bool:
    return bool(experts_modules(model))


def _describable(mod) -> bool:
    """A module built with transformers' ``use_experts_implementation`` (its flags say its layout)."""
    return all(hasattr(mod, f) for f in ("has_gate", "has_bias", "is_transposed", "num_experts", "_apply_gate"))


def quantize_experts(model, quant_type: str = "nf4", double_quant: bool = True, device=None) -> int:
    """Quantize every experts module's 3-D weights to 4-bit, one expert at a time (on ``device``, default
    where the weight is), and run those modules through :func:`_forward_4bit`; returns how many modules."""
    from bitsandbytes.functional import quantize_4bit

    done = 0
    for name, mod in experts_modules(model):
        if hasattr(mod, _STORE):
            continue
        if not _describable(mod):
            log.warning("%s (%s): its experts stay in 16-bit: finetuner quantizes the experts modules of transformers' "
                        "use_experts_implementation only.", name, type(mod).__name__)
            continue
        store = {}
        for wname in ("gate_up_proj" if mod.has_gate else "up_proj", "down_proj"):
            param = mod._parameters.pop(wname)
            packed, states = [], []
            for e in range(param.shape[0]):
                w = param.data[e]
                if device is not None:
                    w = w.to(device)
                w = (w.t() if mod.is_transposed else w).contiguous()  # (out, in), as F.linear reads it
                p, qs = quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=double_quant)
                packed.append(p)
                states.append(qs)
            store[wname] = (packed, states)
            del param
        setattr(mod, _STORE, store)
        if device is not None:  # what stays a parameter (gpt-oss's expert biases) goes where the experts went
            mod.to(device)
        mod.forward = types.MethodType(_forward_4bit, mod)
        done += 1
    return done


def quantized_bytes(model) -> int:
    """Bytes the 4-bit experts take (packed weights and their quantization states)."""
    n = 0
    for _, mod in experts_modules(model):
        for packed, states in getattr(mod, _STORE, {}).values():
            n += sum(p.numel() * p.element_size() for p in packed)
            for qs in states:
                n += qs.absmax.numel() * qs.absmax.element_size()
                if qs.state2 is not None:
                    n += qs.state2.absmax.numel() * qs.state2.absmax.element_size() + qs.offset.numel() * qs.offset.element_size()
    return n


def _matmul(mod, wname: str, e: int, x):
    import bitsandbytes as bnb

    packed, states = getattr(mod, _STORE)[wname]
    out = bnb.matmul_4bit(x, packed[e].t(), quant_state=states[e])
    if mod.has_bias:
        out = out + getattr(mod, f"{wname}_bias")[e]
    return out


def _forward_4bit(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts forward (each expert hit, its tokens gathered), its matmuls 4-bit."""
    import torch

    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    up = "gate_up_proj" if self.has_gate else "up_proj"
    for e in hit:
        e = int(e[0])
        if e == self.num_experts:  # the expert-parallel sentinel
            continue
        pos, tokens = torch.where(mask[e])
        x = hidden_states[tokens]
        h = _matmul(self, up, e, x)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        out = _matmul(self, "down_proj", e, h)
        if getattr(self, "has_post_expert_norm", False):
            out = self.post_expert_norm(out)
        out = out * top_k_weights[tokens, pos, None]
        final.index_add_(0, tokens, out.to(final.dtype))
    return final

"""The memory model's storage terms: the model's weights (16-bit, nf4, int8), the trainable
parameters and the optimizer's states and step temporaries (:func:`finetuner.memory.model.estimate` adds them).
"""

from __future__ import annotations

import math

from finetuner.memory.settings import (DTYPE_BYTES, NF4_BLOCK, NF4_NESTED_BLOCK, NF4_PER_LAYER_BYTES, OPT8_BLOCK,
                                       OPT8_MIN_SIZE, Settings)
from finetuner.model.shapes import ModelShape, lora_param_count, lora_targets

# ====================================================================== weights
def weight_bytes(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Bytes of the model's own parameters on the device, by storage kind.

    * ``lora``: every parameter in ``weight_dtype`` (2 bytes for bf16).
    * ``full``: fp32 master weights (4 bytes), mixed precision.
    * ``qlora`` 4-bit: the decoder's linear weights as packed 4-bit (0.5 byte) plus the block-wise
      absmax (fp32 per 64 → 0.0625 byte/param; with double quant uint8 per 64 plus fp32 per
      64*256 → 0.0159 byte/param) plus the code tables; 8-bit: int8 (1 byte) plus one fp32 scale
      per output row (``SCB``). Everything else — embeddings, LM head (never quantized:
      transformers skips the output layer), norms, biases — in ``weight_dtype`` (finetuner does
      not upcast them as ``prepare_model_for_kbit_training`` would).
    """
    counts = shape.param_counts()
    total = counts["total"]
    if s.method == "full":
        return {"fp32 (trainable)": 4 * total}
    w = DTYPE_BYTES[s.weight_dtype]
    if s.method == "lora":
        return {s.weight_dtype: w * total}
    other = total - quantized_numel(shape, s)  # embeddings, lm head, norms, biases (8-bit: also the experts)
    other_bytes = w * other
    packed, state = quantized_weight_parts(shape, s)
    kind = f"{s.quant_type}{' + double quant' if s.double_quant else ''}" if s.quant_bits == 4 else "int8"
    return {kind: packed + state, f"{s.weight_dtype} (not quantized)": other_bytes}


def quantized_numel(shape: ModelShape, s: Settings) -> int:
    """The weights a QLoRA base holds quantized: the decoder's linear layers and, in 4-bit, a mixture of
    experts' fused expert weights (:mod:`finetuner.model.experts4bit`; in 8-bit they stay in ``weight_dtype``)."""
    return shape.linear_weight_numel + (shape.expert_numel if s.quant_bits == 4 else 0)


def quantized_weight_parts(shape: ModelShape, s: Settings) -> tuple[int, int]:
    """The quantized linear weights of a QLoRA base as ``(data bytes, quantization-state bytes)``.

    * 4-bit: the packed weights, two per byte (``ceil(numel / 2)``), and the state: the block-wise
      absmax (one fp32 per ``NF4_BLOCK`` values; with double quant one uint8 per block plus one
      fp32 per ``NF4_NESTED_BLOCK`` blocks) plus ``NF4_PER_LAYER_BYTES`` of code tables per linear;
    * 8-bit: one int8 byte per weight, and the state: one fp32 scale per output row (``SCB``).

    The split matters under FSDP (:mod:`finetuner.memory.fsdp`): the data are a parameter and are
    sharded, the state is an attribute of the layer and stays whole on every device.
    """
    numel = quantized_numel(shape, s)
    if s.quant_bits == 4:
        blocks = sum(math.ceil(lin.in_features * lin.out_features / NF4_BLOCK) * shape.copies(lin) for lin in shape.layer_linears())
        # each expert's two matrices quantized on their own (experts4bit): their blocks and code tables
        matrices = shape.linear_count + (2 * shape.experts.count * shape.experts.layers if shape.experts else 0)
        blocks += math.ceil(shape.expert_numel / NF4_BLOCK)
        absmax = blocks * 1 + math.ceil(blocks / NF4_NESTED_BLOCK) * 4 if s.double_quant else blocks * 4
        return math.ceil(numel / 2), absmax + matrices * NF4_PER_LAYER_BYTES
    rows = sum(lin.out_features * shape.copies(lin) for lin in shape.layer_linears())
    return numel, 4 * rows


def trainable_tensors(shape: ModelShape, s: Settings) -> list[tuple[int, int, int]]:
    """The trainable tensors as ``(rows, cols, copies)`` (1-D tensors have ``cols == 1``)."""
    if s.method == "full":
        out = [(lin.out_features, lin.in_features, shape.copies(lin)) for lin in shape.layer_linears()]
        out += [(lin.out_features, 1, shape.copies(lin)) for lin in shape.layer_linears() if lin.bias]
        if shape.counts_read:  # a layout read from the model: its other parameters by kind, as read
            c = shape.param_counts()
            out.append((c["embeddings"] // shape.hidden_size, shape.hidden_size, 1) if c["embeddings"] else (0, 0, 0))
            if c["lm_head"]:
                out.append((c["lm_head"] // shape.hidden_size, shape.hidden_size, 1))
            if shape.experts:  # each MoE layer's fused expert tensors (count x rows, hidden)
                e = shape.experts
                out.append((e.numel // e.layers // shape.hidden_size, shape.hidden_size, e.layers))
            out += [(c[k], 1, 1) for k in ("norms", "router", "other") if c[k] > 0]
            return [t for t in out if t[0]]
        out.append((shape.vocab_size, shape.hidden_size, 1))
        if not shape.tie_word_embeddings:
            out.append((shape.vocab_size, shape.hidden_size, 1))
        out.append((shape.hidden_size, 1, shape.norms_per_layer * shape.num_layers + 1))
        if shape.qk_norm:
            out.append((shape.head_dim, 1, 2 * shape.num_layers))
        return out
    targets = lora_targets(shape, list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets)
    out = []
    for _, fin, fout, copies in targets:
        out += [(s.lora_r, fin, copies), (fout, s.lora_r, copies)]
    return out


def trainable_params(shape: ModelShape, s: Settings) -> int:
    if s.method == "full":
        return shape.num_params
    targets = list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets
    return lora_param_count(shape, s.lora_r, targets, s.lora_bias)


# ====================================================================== optimizer
def optimizer_state_bytes(tensors: list[tuple[int, int, int]], optimizer: str) -> int:
    """Optimizer state for trainable tensors given as ``(rows, cols, copies)``.

    * ``adamw_torch`` / ``paged_adamw_32bit``: ``exp_avg`` and ``exp_avg_sq`` in fp32, 8 bytes per
      parameter (``torch.optim.AdamW``; the step counters are scalars and ignored).
    * ``adamw_8bit`` / ``paged_adamw_8bit`` (bitsandbytes): two uint8 states (2 bytes/param) plus
      one fp32 absmax per 256 values for each; tensors under 4096 elements keep 32-bit states.
    * ``adafactor`` (no first moment, ``beta1=None``): factored second moment, one fp32 row and
      one column vector per matrix (Shazeer & Stern 2018), the full vector for 1-D tensors.
    * ``sgd`` (no momentum): nothing.
    """
    total = 0
    for rows, cols, copies in tensors:
        n = rows * cols
        if optimizer in ("adamw_torch", "paged_adamw_32bit"):
            b = 8 * n
        elif optimizer in ("adamw_8bit", "paged_adamw_8bit"):
            b = 8 * n if n < OPT8_MIN_SIZE else 2 * n + 2 * 4 * math.ceil(n / OPT8_BLOCK)
        elif optimizer == "adafactor":
            b = 4 * (rows + cols) if cols > 1 else 4 * n
        else:
            b = 0
        total += b * copies
    return total


def optimizer_step_temp_bytes(tensors: list[tuple[int, int, int]], optimizer: str) -> int:
    """Temporaries of ``optimizer.step()`` (on top of weights, grads and states).

    torch's default multi-tensor (foreach) AdamW computes ``sqrt(exp_avg_sq)`` for all tensors at
    once (``torch/optim/adamw.py``, ``_multi_tensor_adamw``): one fp32 copy of every parameter.
    bitsandbytes' 8-bit and paged optimizers update in place in one fused kernel. Adafactor and
    SGD go tensor by tensor: about three fp32 temporaries of the largest tensor.
    """
    if optimizer in ("adamw_torch",):
        return 4 * sum(r * c * k for r, c, k in tensors)
    if optimizer in ("adafactor", "sgd"):
        return 3 * 4 * max((r * c for r, c, _ in tensors), default=0)
    return 0


"""The memory model's activation terms against the layer's own trace (:mod:`finetuner.model.trace`): the check
docs/models.md's "activations vs trace" column and ``tests/memory/test_trace.py`` make."""

from __future__ import annotations

from typing import Any

from finetuner.model.trace import LENGTHS, TRACE_LORA_DROPOUT, TRACE_LORA_R, trace_layer


def formula_bytes(shape: Any, tokens: int, lora_r: int = TRACE_LORA_R, lora_dropout: float = TRACE_LORA_DROPOUT) -> float:
    """The memory model's named terms' bytes of one decoder layer at ``tokens`` under the trace's settings (LoRA
    all-linear, fp32, the CPU, no mask, flash-like attention), without the trace's excess."""
    from finetuner.memory.activations import TRACE_SETTINGS, layer_activation_terms

    s = TRACE_SETTINGS.with_(lora_r=lora_r, lora_dropout=lora_dropout, seq_len=tokens)
    return sum(b for _, b in layer_activation_terms(shape, s, traced=False)) * tokens


def compare(cfg: dict[str, Any], shape: Any) -> dict[str, Any]:
    """The traced and the formula's bytes of the first decoder layer at the longer length, and the formula's
    error against the trace (``error_pct``: negative when the formula counts less than the layer saves)."""
    trace = trace_layer(cfg)
    tokens = LENGTHS[-1]
    traced, formula = trace.at(tokens), formula_bytes(shape, tokens)
    return {"traced_bytes": int(traced), "formula_bytes": int(formula), "tokens": tokens,
            "error_pct": round(100 * (formula - traced) / traced, 1) if traced else None}

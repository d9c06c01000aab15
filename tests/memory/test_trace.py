"""The memory model's activation terms against what a decoder layer itself saves for backward, traced on the meta
device (finetuner/memory/trace.py): equal for the families of the common layout at their published shapes, and
the trace sees what the terms do not name."""

from __future__ import annotations

import pytest

from finetuner.memory.trace_check import compare
from finetuner.model.trace import LENGTHS, trace_layer
from finetuner.model.shapes import load_config, shape_from_config

#: real shapes of the families the terms were written for, and newer ones read from the model
PRESETS = ["llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "gemma-2-9b", "phi-3-mini", "gemma-3-4b", "olmo-2-7b", "granite-3.3-8b"]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_terms_are_what_the_layer_saves(preset):
    """Every saved tensor is named by a term: the bytes agree to 0.5 % (Gemma's fp32 scaling constants and the
    like are the rest), on the CPU's fp32 semantics the trace runs in."""
    cfg, _ = load_config(preset)
    c = compare(cfg, shape_from_config(cfg))
    assert abs(c["error_pct"]) <= 0.5, c


def test_the_trace_is_linear_in_the_length_and_sees_what_the_terms_do_not():
    """GPT-2 keeps its own residual dropout on in training and normalises with LayerNorm (mean and rstd saved):
    the terms name neither, the trace sees both, so the comparison can fail."""
    from finetuner.model.tiny import tiny_config

    cfg, _ = load_config("llama-3.2-1b")
    plain = trace_layer(cfg)
    assert plain.per_token > 0 and plain.constant == pytest.approx(0, abs=1e-6)  # no attention matrix: a + b·T, a = 0
    gpt2 = tiny_config("gpt2", 400)
    c = compare(gpt2, shape_from_config(gpt2))
    assert c["error_pct"] < -5, c


def test_a_mixture_of_experts_is_not_traced_and_says_why():
    cfg, _ = load_config("olmoe-1b-7b")
    with pytest.raises(RuntimeError, match="nonzero"):
        trace_layer(cfg)
    assert LENGTHS[0] < LENGTHS[1]


def test_the_memory_model_adds_what_the_trace_holds_beyond_its_terms():
    """GPT-2's layer saves more than the named terms: the estimate carries the difference as its own term, at the
    trace's fp32 (so the named terms plus it are the trace, at the trace's settings); Llama's has none."""
    from finetuner.memory.activations import TRACE_SETTINGS, layer_activation_terms
    from finetuner.model.tiny import tiny_config

    gpt2 = tiny_config("gpt2", 400)
    shape = shape_from_config(gpt2)
    s = TRACE_SETTINGS.with_(seq_len=200)
    terms = dict(layer_activation_terms(shape, s))
    extra = terms.pop("saved beyond the terms above (the layer's trace, at fp32)")
    assert extra > 0 and sum(terms.values()) * 200 + extra * 200 == pytest.approx(trace_layer(gpt2).at(200), rel=1e-9)
    llama = shape_from_config(load_config("llama-3.1-8b")[0])
    assert not any(n.startswith("saved beyond") for n, _ in layer_activation_terms(llama, s))

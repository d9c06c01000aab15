"""The memory model with a tiled MLP (``Settings.tiled_mlp``): pure arithmetic on an 8B shape.

What a tiled chunk saves is counted against torch on the CPU in tests/model/test_tiled_mlp.py;
here the model's own bookkeeping: which terms move into the chunk, that the estimate is the
untiled one when a chunk holds the whole micro-batch, and what the longest-sequence search makes
of it (predictions, not GPU measurements).
"""

from __future__ import annotations

import pytest

from finetuner.errors import UserError
from finetuner.memory.model import Settings, activation_bytes, estimate
from finetuner.model.shapes import resolve_shape
from finetuner.planning.longest import longest_sequence

SHAPE = resolve_shape("llama-3.1-8b")
QLORA = Settings(method="qlora", lora_dropout=0.0, micro_batch=1, seq_len=65536, gradient_checkpointing=True,
                 activation_offload=True, optimizer="paged_adamw_8bit")


def _mlp_terms(terms):
    names = [n for n, _ in terms]
    return terms[names.index("MLP norm: fp32 input") + 1:]


def test_the_mlp_tensors_move_into_one_chunk_and_its_input_stays():
    plain, tiled = activation_bytes(SHAPE, QLORA), activation_bytes(SHAPE, QLORA.with_(tiled_mlp=2048))
    T, h, i = QLORA.tokens, SHAPE.hidden_size, SHAPE.intermediate_size
    mlp = _mlp_terms(plain.terms)
    inner = sum(b for n, b in mlp if n != "MLP input (kept for backward)")
    assert inner >= 4 * 2 * i  # gate, act(gate), up, their product: bf16, intermediate-wide
    # kept from forward to backward: everything but the MLP's tensors (its bf16 input stays)
    assert plain.per_layer - tiled.per_layer == pytest.approx(T * inner, abs=2)
    assert ("MLP input (kept for backward)", 2 * h) in _mlp_terms(tiled.terms)
    # in a layer's backward: one chunk of them
    assert tiled.mlp_chunk == pytest.approx(2048 * inner, abs=2) and plain.mlp_chunk == 0
    # the short-lived gradients: intermediate-wide ones for one chunk, hidden-wide ones whole, plus
    # the chunks' input gradients before they are concatenated
    assert tiled.transient == pytest.approx(plain.transient - (3 * 2 * i + 4 * i) * (T - 2048) + 2 * h * T, abs=2)
    assert tiled.transient_whole == (16 * h + 2 * h) * T and plain.transient_whole == 0


def test_tiling_lowers_the_layer_backward_and_nothing_else():
    plain, tiled = estimate(SHAPE, QLORA), estimate(SHAPE, QLORA.with_(tiled_mlp=2048))
    a, b = plain.details["activations"], tiled.details["activations"]
    assert plain.peak_phase == tiled.peak_phase == "forward/backward"
    assert b["layer_phase_bytes"] < a["layer_phase_bytes"] and b["loss_phase_bytes"] == a["loss_phase_bytes"]
    assert tiled.total_bytes < plain.total_bytes
    for key in plain.components:
        if "activations" not in key and key != "allocator slack":
            assert tiled.components.get(key) == plain.components[key], key


@pytest.mark.parametrize("gc", [False, True])
def test_a_chunk_as_long_as_the_micro_batch_is_no_tiling(gc):
    s = QLORA.with_(seq_len=4096, gradient_checkpointing=gc, activation_offload=False)
    assert estimate(SHAPE, s.with_(tiled_mlp=4096)).to_dict()["components"] == estimate(SHAPE, s).to_dict()["components"]
    layer = "layer_phase_bytes"
    assert estimate(SHAPE, s.with_(tiled_mlp=2048)).details["activations"][layer] < estimate(SHAPE, s).details["activations"][layer]
    with pytest.raises(UserError, match="tiled_mlp"):
        s.with_(tiled_mlp=-1)


def test_the_longest_search_tiles_and_says_so():
    plain = longest_sequence("llama-3.1-8b", "rtx4090", "qlora", tiled_mlp=False)
    r = longest_sequence("llama-3.1-8b", "rtx4090", "qlora")
    assert r.candidate.tiled_mlp and "tiled MLP" in r.candidate.label
    assert r.recipe_values()["training.tiled_mlp"] is True and plain.recipe_values()["training.tiled_mlp"] is False
    assert r.settings.tiled_mlp == 2048 and not plain.settings.tiled_mlp
    assert r.max_seq > plain.max_seq and r.total_bytes_per_token < plain.total_bytes_per_token
    # the goal for 8B QLoRA on 24 GB, by the memory model (a prediction)
    assert r.max_seq >= 80_000
    assert any(c["settings"].endswith("tiled MLP") for c in r.considered)
    assert not any(c["settings"].endswith("tiled MLP") for c in plain.considered)

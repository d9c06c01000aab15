"""The memory model's term for the preference objectives: two sequences per example, the
reference pass without gradients, the per-sequence buffers; read by the planner through the recipe."""

from __future__ import annotations

import pytest

from finetuner.config.recipe import Recipe
from finetuner.memory.model import Settings, activation_bytes, estimate, preference_cost, settings_from_recipe
from finetuner.model.shapes import resolve_shape

SHAPE = "llama-3-8b"


def shape():
    return resolve_shape(SHAPE)


def test_sft_has_no_preference_term():
    assert preference_cost(shape(), Settings()) is None
    assert estimate(shape(), Settings()).details["preference"] is None


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo", "kto"])
def test_a_pair_costs_the_activations_of_two_sequences(objective):
    s = Settings(micro_batch=2, seq_len=1024, objective=objective, reference="precomputed" if objective in ("dpo", "kto") else "none")
    est = estimate(shape(), s)
    doubled = activation_bytes(shape(), s.with_(micro_batch=4, objective="sft"))
    assert est.details["activations"]["saved_total_bytes"] == doubled.saved_total
    assert est.details["preference"]["rows"] == 4
    # more than SFT on the same micro-batch, less than SFT on twice the micro-batch plus the buffers
    sft, sft2 = estimate(shape(), s.with_(objective="sft", reference="none")), estimate(shape(), s.with_(micro_batch=4, objective="sft", reference="none"))
    assert sft.allocated_bytes < est.allocated_bytes <= sft2.allocated_bytes + est.details["preference"]["buffers_bytes"]
    assert est.settings.micro_batch == 2  # the planner reads back the micro-batch it asked for


def test_the_reference_pass_costs_memory_only_with_the_adapter_switched_off():
    s = Settings(micro_batch=4, seq_len=2048, objective="dpo", reference="adapter_off", gradient_checkpointing=True)
    on = preference_cost(shape(), s)
    assert on.reference_pass_bytes > 0
    assert preference_cost(shape(), s.with_(reference="precomputed")).reference_pass_bytes == 0
    assert preference_cost(shape(), s.with_(objective="simpo", reference="none")).reference_pass_bytes == 0
    # with checkpointing the saved activations are small, so the reference pass can set the peak
    assert estimate(shape(), s).allocated_bytes >= estimate(shape(), s.with_(reference="precomputed")).allocated_bytes
    # the full-logits path holds the reference's logits of the whole micro-batch
    T, V = 8 * 2048, shape().vocab_size
    full = preference_cost(shape(), s.with_(loss_chunk=0)).reference_pass_bytes
    assert full - on.reference_pass_bytes == 2 * T * V + 8 * T * V - 8 * 1024 * V  # bf16 logits, fp32 copy and log-softmax


def test_the_buffers_grow_with_the_scored_tokens():
    s = Settings(micro_batch=2, seq_len=1024, objective="orpo")
    assert preference_cost(shape(), s.with_(label_fraction=0.5)).buffers_bytes < preference_cost(shape(), s).buffers_bytes


def test_the_recipe_carries_the_objective_to_the_planner():
    raw = {"model": {"name": SHAPE}, "data": {"path": "org/data", "max_seq_len": 1024}, "training": {"micro_batch_size": 2}}
    sft = settings_from_recipe(Recipe.from_dict(raw))
    dpo = settings_from_recipe(Recipe.from_dict({**raw, "objective": "dpo"}))
    simpo = settings_from_recipe(Recipe.from_dict({**raw, "objective": "simpo"}))
    assert (sft.objective, dpo.objective, dpo.reference, simpo.reference) == ("sft", "dpo", "adapter_off", "none")
    assert estimate(shape(), dpo).allocated_bytes > estimate(shape(), sft).allocated_bytes

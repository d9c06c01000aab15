"""What training the projector or the vision tower adds to a picture run's memory (finetuner/memory/vision.py):
the trainable tensors the trainer makes, and what the pictures' way through the tower keeps for backward."""

from __future__ import annotations

import pytest

from tests.conftest import write_picture_chats


def recipe_for(model_dir, data, micro: int = 2, **lora):
    from finetuner.config.recipe import Recipe

    return Recipe.from_dict({"name": "eyes", "model": {"name": str(model_dir)}, "method": "lora", "lora": lora,
                             "data": {"path": str(data), "max_seq_len": 64},
                             "training": {"micro_batch_size": micro, "max_steps": 3}, "device": "cpu"})


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    return write_picture_chats(tmp_path_factory.mktemp("vision_memory"), 8)


@pytest.mark.parametrize("lora", [{"train_projector": True}, {"train_projector": True, "train_vision_tower": True},
                                  {"train_vision_tower": True}])
def test_the_counted_tensors_are_the_ones_the_trainer_trains(tiny_vlm_dir, pictures, lora):
    from finetuner.config.runtime import resolve_runtime
    from finetuner.model.loading import load_base_model, prepare_for_training
    from finetuner.memory.vision import vision_cost_of

    r = recipe_for(tiny_vlm_dir, pictures, **lora)
    model = prepare_for_training(load_base_model(r, resolve_runtime(r), pictures=True), r, pictures=True)
    trained = sorted(tuple(p.shape) for n, p in model.named_parameters()
                     if p.requires_grad and "language_model" not in n)
    cost = vision_cost_of(r)
    assert cost.trainable_params == sum(p.numel() for n, p in model.named_parameters()
                                        if p.requires_grad and "language_model" not in n) > 0
    assert len(cost.trainable) == len(trained)


def test_the_traced_activations_are_what_the_model_keeps(tiny_vlm_dir, pictures):
    """On real tensors (CPU, fp32, the trace's attention) the picture's way through the trained tower keeps as many
    bytes for backward as the trace on the meta device counts; two a micro-batch keep twice as many."""
    import torch
    from PIL import Image

    from finetuner.config.runtime import resolve_runtime
    from finetuner.data.formats import FileExamples
    from finetuner.model.loading import load_base_model, prepare_for_training
    from finetuner.model.trace import TRACE_ATTENTION, register_trace_attention
    from finetuner.model.vision import load_processor
    from finetuner.memory.vision import vision_cost_of

    one = vision_cost_of(recipe_for(tiny_vlm_dir, pictures, micro=1, train_projector=True, train_vision_tower=True))
    assert one.saved_per_picture > 0 and one.activation_bytes(2) == 2 * one.activation_bytes(1)
    r = recipe_for(tiny_vlm_dir, pictures, micro=1, train_projector=True, train_vision_tower=True)
    model = prepare_for_training(load_base_model(r, resolve_runtime(r), pictures=True), r, pictures=True)
    register_trace_attention()
    for m in model.modules():
        if getattr(m, "config", None) is not None:
            m.config._attn_implementation = TRACE_ATTENTION
    processor = load_processor(str(tiny_vlm_dir))
    picture = next(iter(FileExamples(str(pictures))))["images"][0]
    pixel_values = processor.image_processor(Image.open(picture).convert("RGB"), return_tensors="pt")["pixel_values"]
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage()._cdata not in params:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_base_model().model.get_image_features(pixel_values=pixel_values)
    assert sum(seen.values()) == one.saved_per_picture


def test_the_estimate_counts_them_and_says_how(tiny_vlm_dir, pictures):
    from finetuner.planning.predict import predict

    plain = predict(recipe_for(tiny_vlm_dir, pictures), "rtx4090").memory
    both = predict(recipe_for(tiny_vlm_dir, pictures, train_projector=True, train_vision_tower=True), "rtx4090").memory
    vision = both.details["vision_activation_bytes"]
    assert vision > 0 and both.components["activations: vision tower and projector (traced)"] == vision
    assert both.details["trainable_params"] == plain.details["trainable_params"] + both.details["vision_trainable_params"]
    assert both.total_bytes > plain.total_bytes + vision
    assert "traced for a" in both.notes[-1] and "upper bound" in both.notes[-1]
    assert plain.details["vision_activation_bytes"] == 0 and "activations: vision tower and projector (traced)" not in plain.components


def test_the_planner_counts_them_for_each_micro_batch_it_tries(tiny_vlm_dir, pictures):
    """An ``auto`` micro-batch: every option the planner weighs carries the pictures of its micro-batch."""
    from finetuner.config.hardware import get_gpu
    from finetuner.memory.vision import vision_cost_of
    from finetuner.model.shapes import resolve_shape
    from finetuner.planning.search import search

    base = recipe_for(tiny_vlm_dir, pictures, micro="auto", train_vision_tower=True)
    cost = vision_cost_of(base)
    options = search(base, resolve_shape(str(tiny_vlm_dir)), get_gpu("rtx4090"))
    assert options
    for candidate, r in options:
        assert candidate.estimate.details["vision_activation_bytes"] == cost.activation_bytes(r.training.micro_batch_size)


def test_without_the_processor_the_tensors_are_counted_and_the_note_says_why(tiny_vlm_dir, pictures):
    from finetuner.memory.vision import vision_cost

    r = recipe_for(tiny_vlm_dir, pictures, train_vision_tower=True)
    cost = vision_cost(r, None, [], 1)
    assert cost.trainable_params > 0 and cost.saved_per_picture is None and cost.activation_bytes(4) == 0
    assert "processor (the pictures' size) is not on this machine" in cost.note


def test_a_prediction_traces_the_tower_once(tiny_vlm_dir, pictures, monkeypatch):
    """An auto micro-batch: the planner's search and the chosen recipe's estimate ask for the same cost; the tower
    is built and traced once."""
    import finetuner.memory.vision as vision
    from finetuner.planning.predict import predict

    calls = []
    real = vision._vision_cost_of
    monkeypatch.setattr(vision, "_vision_cost_of", lambda recipe: calls.append(1) or real(recipe))
    monkeypatch.setattr(vision, "_COSTS", {})
    p = predict(recipe_for(tiny_vlm_dir, pictures, micro="auto", train_vision_tower=True), "rtx4090")
    assert p.memory.details["vision_activation_bytes"] > 0 and "traced for a" in p.memory.notes[-1]
    assert len(calls) == 1


def test_a_smolvlm_tower_is_counted_and_the_note_says_why_its_activations_are_not(pictures, tmp_path):
    """SmolVLM's processor loads without its video processor (whose own chat template method needs it); its tower
    picks the pictures' patches by value (torch.nonzero), which the meta device cannot run: the trainable tensors
    are counted, the note says why the activations are not."""
    from transformers import AutoTokenizer

    from finetuner.memory.vision import vision_cost_of
    from finetuner.model.tiny_vlm import tiny_smolvlm
    from tests.conftest import REPO

    tiny_smolvlm(AutoTokenizer.from_pretrained(REPO / "data" / "demo_model"), tmp_path / "smol")
    cost = vision_cost_of(recipe_for(tmp_path / "smol", pictures, train_projector=True, train_vision_tower=True))
    assert cost.trainable_params > 0 and cost.saved_per_picture is None
    assert "does not run on the meta device (NotImplementedError" in cost.note

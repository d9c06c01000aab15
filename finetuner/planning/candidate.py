"""The memory of one candidate recipe on one card: the one function :func:`~finetuner.planning.predict.predict`
and the planner's search (:func:`~finetuner.planning.search.search`, every option it weighs) both call, so the
plan ranks its options by the memory the chosen recipe's prediction then reports: the recipe's settings, a
trained projector's or vision tower's extra, and the objective's peak (GRPO's phases for a generating objective).
"""

from __future__ import annotations

from typing import Any

from finetuner.config.hardware import GpuProfile
from finetuner.memory.grpo import grpo_memory_estimate, grpo_settings_of
from finetuner.memory.model import MemoryEstimate, Settings, estimate, settings_from_recipe
from finetuner.model.shapes import ModelShape
from finetuner.objectives.specs import spec_of


def candidate_memory(recipe: Any, shape: ModelShape, gpu: GpuProfile | None, *, label_fraction: float, margin: float,
                     runtime: Any = None) -> tuple[Settings, MemoryEstimate, Any]:
    """``(settings, memory, vision)`` of a resolved ``recipe`` on ``gpu`` (None: no card, so no budget):
    the memory model's settings, its peak on one device (no sharding), and the vision cost it counted
    (:func:`~finetuner.memory.vision.vision_cost_of`; None when it trains neither projector nor tower)."""
    from finetuner.memory.vision import vision_cost_of

    s = settings_from_recipe(recipe, gpu, shape.model_type, runtime=runtime, shape=shape).with_(label_fraction=label_fraction)
    vision = vision_cost_of(recipe)
    if vision is not None:
        s = s.with_(vision_trainable=vision.trainable,
                    vision_activation_bytes=vision.activation_bytes(recipe.training.micro_batch_size))
    if spec_of(recipe.objective).generates:
        card = gpu.memory_bytes if gpu is not None else None
        memory = grpo_memory_estimate(shape, s, grpo_settings_of(recipe, card), gpu, margin=margin,
                                      top_p=recipe.grpo.top_p < 1)
    else:
        memory = estimate(shape, s, gpu, margin=margin)
    return s, memory, vision

"""A resolved recipe's predicted step time: the one entry point the plan, ``estimate``, the trainer's
``start`` event and the validation scripts predict through. It reads the recipe's settings as the memory
model does and hands them to the step model of its objective: :func:`finetuner.planning.speed.step_time`
(SFT and the preference objectives) or :func:`finetuner.planning.speed_grpo.grpo_step_time` (GRPO, whose
step is a rollout then the training passes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetuner.memory.grpo import grpo_settings_of
from finetuner.objectives.specs import spec_of
from finetuner.planning.lengths import BatchShape
from finetuner.planning.speed import DeviceSpeed, StepTime, step_time
from finetuner.planning.speed_grpo import grpo_step_time

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.hardware import GpuProfile
    from finetuner.memory.model import MemoryEstimate
    from finetuner.model.shapes import ModelShape


def recipe_step_time(recipe: Any, gpu: GpuProfile, speed: DeviceSpeed, *, shape: ModelShape | None = None,
                     label_fraction: float = 1.0, est: MemoryEstimate | None = None, runtime: Any = None,
                     padding_free: bool = False, batch: BatchShape | None = None, settings: Any = None,
                     sharded: Any = None) -> StepTime:
    """:func:`step_time` of a resolved recipe on ``gpu`` (the settings the memory model reads:
    :func:`finetuner.memory.model.settings_from_recipe`, with the trainer's ``runtime`` when it has
    one). The plan, ``estimate``, the trainer's ``start`` event and ``scripts/validate/speed_model.py``
    all predict through here. ``padding_free``: every row of every micro-batch is full (no padding),
    so no mask reaches attention (transformers then takes the causal kernel). ``batch``: the data's
    average micro-batch (:func:`finetuner.planning.recipe_data.data_batch_of`): the step is timed at its
    padded length and counts its real tokens; without it every row is ``data.max_seq_len`` long.

    A GRPO recipe (``objective: grpo``) predicts through
    :func:`finetuner.planning.speed_grpo.grpo_step_time` (its rollout, then the training passes over the
    completions) with :func:`finetuner.memory.grpo.grpo_settings_of`: ``batch`` is then the data's prompts
    (:func:`finetuner.planning.lengths.prompt_batch`), the completions at their upper bound
    (``label_fraction`` and ``padding_free`` do not apply).

    The planner's search times each candidate here too, with the ``settings`` its memory was predicted with
    (:func:`finetuner.planning.candidate.candidate_memory`: the vision terms included) and, over several GPUs,
    the ``sharded`` memory of its strategy (:func:`finetuner.memory.sharding.shard_estimate`)."""
    from finetuner.memory.model import settings_from_recipe
    from finetuner.model.shapes import resolve_shape

    shape = shape or resolve_shape(recipe.model.name, recipe.model.revision)
    if spec_of(getattr(recipe, "objective", None)).generates:
        s = settings or settings_from_recipe(recipe, gpu, shape.model_type, runtime=runtime, shape=shape)
        g = grpo_settings_of(recipe, gpu.memory_bytes if gpu is not None else None)
        return grpo_step_time(shape, s, g, speed, est=est, top_p=recipe.grpo.top_p, prompts=batch)
    s = settings or settings_from_recipe(recipe, gpu, shape.model_type, runtime=runtime, shape=shape).with_(label_fraction=label_fraction)
    if padding_free and not recipe.data.packing:
        s = s.with_(attention_mask=False)
    return step_time(shape, s, speed, est, sharded, batch=batch)

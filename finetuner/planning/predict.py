"""One prediction of a run: its peak memory, its step time, its optimizer steps and its whole wait.

A recipe on a card (and, inside a run, the trainer's :class:`~finetuner.config.runtime.Runtime`) goes in, a
:class:`Prediction` comes out. ``finetuner estimate`` (the CLI, ``finetuner.estimate`` and
:func:`estimate_time`), the trainer's ``start`` event and the web UI's Plan tab all take theirs from
:func:`predict`, so none of them can say what another does not: the ``auto`` values resolved by the planner
once, the model resolved once (``shape``, or :func:`~finetuner.model.shapes.resolve_shape` once), the share of
trained tokens measured once (:func:`~finetuner.planning.recipe_data.label_fraction_of`), the objective's memory
(GRPO's phases for ``objective: grpo``, :func:`~finetuner.memory.grpo.grpo_memory_estimate`), the step timed
with that memory's offloaded bytes, and the wait (:func:`~finetuner.planning.recipe_data.run_wait`). ``finetuner
plan`` ranks its options with the same memory and speed functions, and its chosen recipe's prediction is this
one (``tests/planning/test_predict.py``). The time is computed when first asked for: the memory alone
(the UI's editor, on every change) reads no data file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetuner.config.hardware import GpuProfile, cpu_profile, get_gpu
from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.memory.grpo import grpo_settings_of
from finetuner.memory.model import MemoryEstimate, Settings
from finetuner.memory.sharding import ShardedEstimate, recipe_offload, shard_estimate
from finetuner.model.shapes import ModelShape, resolve_shape
from finetuner.planning.calibrate import speed_for
from finetuner.planning.candidate import candidate_memory
from finetuner.planning.load import note_now
from finetuner.planning.plan_result import Plan
from finetuner.planning.reasons import grpo_largest
from finetuner.planning.recipe_data import data_batch_of, label_fraction_of, lengths_text, run_optimizer_steps, run_wait
from finetuner.planning.resolve import resolve_auto
from finetuner.planning.search import DEFAULT_MARGIN
from finetuner.planning.recipe_speed import recipe_step_time
from finetuner.planning.speed import DeviceSpeed, StepTime
from finetuner.planning.wait import Wait, check_currency, cost_of
from finetuner.surface import say


@dataclass
class Prediction:
    """What a run of ``recipe`` on ``gpu`` is predicted to take. ``recipe``: the recipe as it runs (``auto``
    values resolved; ``planned``: the planner's choice that resolved them, None when there were none);
    ``memory``: the objective's peak (with the card's budget and ``fits``; no budget when ``gpu`` is None);
    ``step``, ``optimizer_steps``, ``wait``: the speed model's, on ``gpu`` (the CPU when None)."""

    recipe: Recipe
    gpu: GpuProfile | None
    shape: ModelShape
    settings: Settings
    label_fraction: float
    memory: MemoryEstimate
    speed: DeviceSpeed
    planned: Plan | None = None
    runtime: Any = None
    steps_given: int | None = None
    loaded_as: tuple[bool, bool] | None = None
    replay_cached: bool | None = None

    @property
    def timed_on(self) -> GpuProfile:
        return self.gpu or cpu_profile()

    @functools.cached_property
    def batch(self):
        """The data's average micro-batch (:func:`~finetuner.planning.recipe_data.data_batch_of`), None unread."""
        return data_batch_of(self.recipe)

    @functools.cached_property
    def step(self) -> StepTime:
        return recipe_step_time(self.recipe, self.timed_on, self.speed, shape=self.shape, label_fraction=self.label_fraction,
                                est=self.memory, runtime=self.runtime, batch=self.batch)

    @functools.cached_property
    def optimizer_steps(self) -> int | None:
        return self.steps_given or run_optimizer_steps(self.recipe)

    @functools.cached_property
    def sharded(self) -> ShardedEstimate | None:
        """The memory per device of the recipe's own strategy (:func:`~finetuner.memory.sharding.shard_estimate`)
        when it runs on several processes or offloads; None for one process that keeps everything on its device.
        ``finetuner estimate`` reads it; the plan's search shards each candidate with the same function."""
        d = self.recipe.distributed
        offload = recipe_offload(d)
        if d.world_size <= 1 and offload == "none":
            return None
        return shard_estimate(self.memory, d.strategy, d.world_size, offload, self.shape)

    @functools.cached_property
    def wait(self) -> Wait | None:
        return run_wait(self.recipe, self.timed_on, self.speed, self.step, self.optimizer_steps, self.label_fraction,
                        shape=self.shape, runtime=self.runtime, loaded_as=self.loaded_as, replay_cached=self.replay_cached)

    def time(self, price_per_hour: float | None = None, currency: str | None = None) -> dict[str, Any]:
        """The time and cost as ``finetuner estimate`` reports them (:func:`estimate_time`'s dict)."""
        if price_per_hour is not None and not price_per_hour >= 0:  # also NaN
            raise UserError(f"{say(cli='--price-per-hour', ui='Price per hour')} {price_per_hour}: must be 0 or more.")
        currency = check_currency(currency, price_per_hour)
        st, steps, wait = self.step, self.optimizer_steps, self.wait
        return {"tokens_per_s": st.tokens_per_s, "step_s": st.step_s, "optimizer_steps": steps,
                "steps_s": st.step_s * steps if steps else None, "wall_s": wait.wall_s if wait else None,
                "wait": wait.to_dict() if wait else None, "price_per_hour": price_per_hour, "currency": currency,
                "cost": cost_of(wait.wall_s if wait else None, price_per_hour), "source": self.speed.source,
                "parts_s": dict(st.parts), "upper_bound": st.upper_bound, "padded_tokens_per_s": st.padded_tokens_per_s,
                "lengths": lengths_text(self.recipe, self.batch), "load_note": note_now(self.speed)}

    def speed_dict(self) -> dict[str, Any]:
        """The trainer's ``start`` event's ``predicted_speed``: tokens/s, the step, its steps alone, the whole wait."""
        st, wait, steps = self.step, self.wait, self.optimizer_steps or 0
        return {"tokens_per_s": round(st.tokens_per_s, 1), "step_s": round(st.step_s, 5),
                "total_s": round(st.step_s * steps, 1), "wall_s": round(wait.wall_s, 2) if wait else None,
                "wait": wait.to_dict() if wait else None, "source": st.source, "upper_bound": st.upper_bound,
                "data_lengths": st.data_lengths, "load_note": note_now(self.speed)}


def _profile(gpu: GpuProfile | str | None) -> GpuProfile | None:
    return get_gpu(gpu) if isinstance(gpu, str) else gpu


def predict(recipe: Recipe | str | Path, gpu: GpuProfile | str | None = None, *, shape: ModelShape | None = None,
            label_fraction: float | None = None, speed: DeviceSpeed | None = None, runtime: Any = None,
            steps: int | None = None, loaded_as: tuple[bool, bool] | None = None, margin: float = DEFAULT_MARGIN,
            replay_cached: bool | None = None) -> Prediction:
    """The one prediction of a run of ``recipe`` (a Recipe or a recipe YAML's path) on ``gpu`` (a card name, a
    size such as ``24GB``, ``cpu``, a profile, or None: no card, so no budget, timed on this CPU).

    ``label_fraction``: the share of tokens the loss is computed on (None: measured from the recipe's data as the
    planner measures it); ``runtime``: the trainer's device choices, in a run; ``steps``: the run's optimizer
    steps when the caller counted them (the trainer), else counted from the recipe and its data;
    ``loaded_as``: whether the model was to be downloaded and converted when the run began (the trainer's);
    ``replay_cached``: whether ``data.replay``'s answers came from its cache (the trainer's record)."""
    if isinstance(recipe, (str, Path)):
        recipe = Recipe.from_yaml(recipe)
    from finetuner.planning.data_auto import resolve_data

    recipe = resolve_data(recipe)[0]  # data ``auto`` values as the run resolves them
    prof = _profile(gpu)
    if label_fraction is None:
        label_fraction = label_fraction_of(recipe)
    shape = shape or resolve_shape(recipe.model.name, recipe.model.revision)  # the model's name is never auto
    planned = None
    if recipe.auto_keys():
        planned = resolve_auto(recipe, prof or cpu_profile(), label_fraction=label_fraction, shape=shape, margin=margin)
        recipe = planned.recipe
    s, memory, vision = candidate_memory(recipe, shape, prof, label_fraction=label_fraction, margin=margin,
                                         runtime=runtime)
    if vision is not None:
        memory.notes.append(vision.note)
    return Prediction(recipe=recipe, gpu=prof, shape=shape, settings=s, label_fraction=label_fraction, memory=memory,
                      speed=speed or speed_for(prof or cpu_profile()), planned=planned, runtime=runtime,
                      steps_given=steps, loaded_as=loaded_as, replay_cached=replay_cached)


def estimate_recipe(recipe: Recipe | str | Path, gpu: GpuProfile | str | None = None, shape: ModelShape | None = None,
                    margin: float = DEFAULT_MARGIN, label_fraction: float | None = None) -> MemoryEstimate:
    """Predict the peak memory of a recipe (``finetuner.estimate``): :func:`predict`'s memory.

    Args:
        recipe: a :class:`~finetuner.config.recipe.Recipe` or the path of a recipe YAML; ``auto`` values
            are resolved by the planner for ``gpu`` first.
        gpu: a card name, a size (``24GB``), ``cpu``, a :class:`~finetuner.config.hardware.GpuProfile`, or
            None (no card: the estimate has no budget and ``fits`` is True).
        label_fraction: the share of tokens the loss is computed on; None (the default): measured from
            the recipe's data as the planner does (1.0, every token, when the data cannot be read here).

    Example:
        >>> est = estimate_recipe("recipes/7b_4090.yaml", gpu="rtx4090")
        >>> est.fits, round(est.total_bytes / 2**30, 1)  # doctest: +SKIP
        (True, 20.2)
    """
    return predict(recipe, gpu, shape=shape, margin=margin, label_fraction=label_fraction).memory


def estimate_time(recipe: Recipe | str | Path, gpu: GpuProfile | str | None = None, *, shape: ModelShape | None = None,
                  label_fraction: float | None = None, price_per_hour: float | None = None,
                  speed: DeviceSpeed | None = None, currency: str | None = None) -> dict[str, Any]:
    """How long a recipe's run takes on ``gpu`` (None: this CPU), and what it costs (``finetuner estimate``):
    :meth:`Prediction.time`, ``{"tokens_per_s", "step_s", "optimizer_steps", "steps_s", "wall_s", "wait", "cost",
    "price_per_hour", "currency", "source", "parts_s", "upper_bound", "padded_tokens_per_s", "lengths"}``:
    ``steps_s`` the optimizer steps alone, ``wall_s`` the whole run (``wait``: by part: download, load, replay, steps,
    evaluations, checkpoints, probe, samples), ``cost`` the whole run's at ``price_per_hour`` (in ``currency``),
    ``parts_s`` the step's own parts; ``upper_bound``: GRPO, predicted with its completions at their longest.
    The optimizer steps are the run's own count (its ``max_steps``, else epochs over the data's training rows),
    None when the data cannot be read here (and then so are ``steps_s``, ``wall_s``, ``wait`` and ``cost``)."""
    check_currency(currency, price_per_hour)
    if price_per_hour is not None and not price_per_hour >= 0:  # before any work: a bad price is the user's to fix
        raise UserError(f"{say(cli='--price-per-hour', ui='Price per hour')} {price_per_hour}: must be 0 or more.")
    p = predict(recipe, _profile(gpu) or cpu_profile(), shape=shape, label_fraction=label_fraction, speed=speed)
    return p.time(price_per_hour, currency)


def estimate_grpo(recipe: Recipe, gpu: GpuProfile | None, margin: float = DEFAULT_MARGIN,
                  label_fraction: float = 1.0, limit: int = 1 << 17) -> dict[str, Any]:
    """``finetuner estimate`` for a resolved ``objective: grpo`` recipe: the GRPO step's peak over its
    phases (:func:`finetuner.memory.grpo.grpo_estimate`: generation with its KV cache, the loss over the
    group, the reference pass, the optimizer step), whether it fits ``gpu``'s budget, and the largest
    ``max_new_tokens`` (group size held) and ``num_generations`` (length held) that fit it.
    Returns ``{"memory": GrpoMemory, "budget_bytes", "device_bytes", "fits", "largest_max_new_tokens",
    "largest_num_generations"}`` (the largest values None without a card, or when even 1 does not fit;
    ``limit`` when the search reached it)."""
    return grpo_report(predict(recipe, gpu, margin=margin, label_fraction=label_fraction), limit)


def grpo_report(p: Prediction, limit: int = 1 << 17) -> dict[str, Any]:
    """:func:`estimate_grpo` of a GRPO recipe's :class:`Prediction`."""
    from finetuner.memory.grpo import grpo_estimate

    gpu = p.gpu
    shape, settings, card = p.shape, p.settings, gpu.memory_bytes if gpu is not None else None
    mem = grpo_estimate(shape, settings, grpo_settings_of(p.recipe, card), top_p=p.recipe.grpo.top_p < 1)
    budget = p.memory.budget_bytes if gpu is not None else None
    out: dict[str, Any] = {"memory": mem, "budget_bytes": budget, "device_bytes": card,
                           "fits": mem.vllm_fits if budget is None else mem.fits(budget),
                           "largest_max_new_tokens": None, "largest_num_generations": None}
    if budget is not None:
        big = grpo_largest(p.recipe, settings, shape, budget, limit, card_bytes=card)
        out["largest_max_new_tokens"], out["largest_num_generations"] = big["max_new_tokens"], big["num_generations"]
    return out

"""A run's optimizer steps: per epoch and in all. The trainer's schedule, the plan's step count (and so its total
time) and a run folder's progress all count with these, so they sit below all three."""

from __future__ import annotations

import math


def steps_per_epoch(units: int, effective_batch: int) -> int:
    """Optimizer steps in one pass over ``units`` training rows (examples, pairs or packed rows),
    ``effective_batch`` a step: the last step of an epoch takes the rows left over. The trainer's
    schedule and the plan's step count both come from here."""
    return max(1, math.ceil(units / max(1, effective_batch)))


def total_steps(epochs: float, per_epoch: int) -> int:
    """Optimizer steps of a run of ``epochs`` (a fraction allowed) at ``per_epoch`` steps an epoch."""
    return max(1, math.ceil(epochs * per_epoch))


def optimizer_steps(max_steps: int | None, epochs: float, units: int, effective_batch: int) -> int:
    """The optimizer steps a run takes: ``max_steps`` when set, else ``epochs`` passes over ``units``
    training rows (examples, pairs or packed rows) at ``effective_batch`` a step. The trainer's
    schedule and the plan's count (and so its total time) both come from here."""
    return max_steps or total_steps(epochs, steps_per_epoch(units, effective_batch))

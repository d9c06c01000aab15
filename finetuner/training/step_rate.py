"""The run's ETA from the steps it has timed, and the one warning when they are much slower than planned.

The speed model (:mod:`finetuner.planning.speed`) plans a step's seconds from a calibration of the machine;
a machine busier than when it was calibrated, or another machine's calibration, makes that plan wrong by
any factor. The run corrects itself: for its first :data:`WARMUP_STEPS` steps (in this process) the ETA
is the planned seconds a step times the steps left (the first steps carry one-time costs: the allocator's
first blocks, kernels chosen on first use, the data loader's first batches, so they say little of the
steps after them); from then on it is the wall time since the end of those steps divided by the steps
done since (evaluations and checkpoints between them included, as they will recur), times the steps
left. Without a plan the ETA is measured from the first step on.

A run whose steps (the steps alone, as the plan counts them; the mean of at least :data:`WARMUP_STEPS` of
them after the warm-up, so that one step a pause stretched says nothing) take more than :data:`SLOW_FACTOR`
times the planned seconds says so once, with both rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Steps whose time the ETA does not trust (one-time costs of a process's first steps).
WARMUP_STEPS = 3
#: Measured steps this many times slower than planned are said once. The speed model's recorded
#: validation (docs/benchmarks.md) errs at most 25 % on a machine as calibrated; twice the planned
#: time (a 100 % error, four times its largest) is not the model's error but the machine: busier
#: than at calibration, or not the machine that was calibrated. A run that is twice as long as said
#: is also what a user notices and plans around.
SLOW_FACTOR = 2.0


@dataclass
class StepRate:
    """The timing of a run's steps in this process: :meth:`record` after each step, :meth:`eta` when a
    step is logged, :meth:`slow_message` for the warning (once)."""

    planned_step_s: float | None  # the plan's seconds an optimizer step (None: no plan)
    max_steps: int
    started_at: float  # perf_counter when this process's steps began
    first_step: int = 0  # the step this process resumed from
    warmup_steps: int = WARMUP_STEPS
    slow_factor: float = SLOW_FACTOR
    _mark: tuple[int, float] | None = None  # (step, perf_counter) at the end of the warm-up steps
    _steps_s: list[float] = field(default_factory=list)  # each step's own seconds after the warm-up
    _warned: bool = False

    def record(self, step: int, took_s: float, now: float) -> None:
        """Step ``step`` (1-based, counted over the whole run) ended at ``now`` after ``took_s`` seconds of its own."""
        done = step - self.first_step
        if done == self.warmup_steps:
            self._mark = (step, now)
        elif done > self.warmup_steps:
            self._steps_s.append(took_s)

    def measured(self) -> bool:
        """Whether the ETA comes from timed steps (after the warm-up, or from the start with no plan)."""
        return self._mark is not None or not self.planned_step_s

    def eta(self, step: int, now: float) -> tuple[float, str]:
        """Seconds to the last step after step ``step`` ended at ``now``, and where the rate came from
        (``"planned"`` or ``"measured"``)."""
        left = self.max_steps - step
        if self._mark is not None and step > self._mark[0]:
            return (now - self._mark[1]) / (step - self._mark[0]) * left, "measured"
        if self.planned_step_s:
            return self.planned_step_s * left, "planned"
        return (now - self.started_at) / max(step - self.first_step, 1) * left, "measured"

    def measured_step_s(self) -> float | None:
        """The mean seconds of the steps timed after the warm-up (their own time: no evaluation), or None."""
        return sum(self._steps_s) / len(self._steps_s) if self._steps_s else None

    def slow_message(self) -> tuple[str, float] | None:
        """Once, when the steps after the warm-up are :data:`SLOW_FACTOR` times slower than planned: the
        warning and the measured seconds a step; None otherwise (and every time after the first)."""
        measured = self.measured_step_s()
        if self._warned or not self.planned_step_s or len(self._steps_s) < self.warmup_steps or measured is None or measured <= self.slow_factor * self.planned_step_s:
            return None
        self._warned = True
        return (f"Steps take {measured:.3g} s each, {measured / self.planned_step_s:.1f}x the {self.planned_step_s:.3g} s "
                f"planned: the machine is busier than when it was calibrated, or not the machine calibrated "
                f"(`finetuner gpus --calibrate` measures it again). The ETA now follows the measured steps."), measured

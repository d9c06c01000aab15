"""A long plan says so up front, with the cheaper choices that exist and each one's predicted time.

``LONG_RUN_S`` (3 hours): the trial of issue 55 found plans of 4 h 34 min (LLaMA-Factory's alpaca demo on a CPU), 25 h
and 42 h said without a word; a run of more than 3 hours no longer finishes while its user waits on it (an afternoon),
and at that length a cheaper choice saves hours. The choices (:func:`long_run_warning`), each planned as
``finetuner plan`` plans it with that one flag added (``replan``, the same job), so its time is the one that
plan would say:

* the sequence at the data's 95th percentile (``--seq-len``, rounded as the planner rounds), when the plan's is longer:
  the rows above it are truncated (the warning says how many);
* fewer epochs (``--epochs``): as many as the time allows, at least one fewer;
* a GPU (``--gpu``): the first of ``CARDS`` (cheapest first) faster than the plan's card whose plan fits and ends
  within ``LONG_RUN_S``, else the fastest that fits (its speed from the card's data sheet).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from finetuner.config.hardware import get_gpu
from finetuner.objectives.specs import spec_of
from finetuner.errors import UserError
from finetuner.planning.length_cap import round_up
from finetuner.units import duration_text

#: A plan predicted to take longer than this (the whole run) says so up front.
LONG_RUN_S = 3 * 3600
#: The cards a long plan names, cheapest first.
CARDS = ("t4", "l4", "rtx4090", "a100-80gb", "h100-80gb")


def long_run_warning(p: Any, replan: Callable[..., Any], profile: Any = None) -> str | None:
    """The warning of a plan ``p`` (a :class:`~finetuner.planning.plan_result.Plan`) whose whole run is predicted to take
    more than ``LONG_RUN_S``, with its cheaper choices; None when it is not that long. ``replan(**changes)``: the
    same job planned with ``seq_len``, ``epochs`` or ``gpu`` changed; ``profile``: the data's
    (:class:`~finetuner.data.stats.DataProfile`), for the sequence at its 95th percentile."""
    if not p.fits or not p.wall_s or p.wall_s <= LONG_RUN_S:
        return None
    choices: list[str] = []
    if profile is not None and not p.recipe.data.packing:
        seq = round_up(profile.percentile(95))
        if seq < p.seq_len:
            q = replan(seq_len=seq)
            if q.fits and q.wall_s:
                choices.append(f"--seq-len {seq} (the data's 95th percentile; {profile.truncated(seq)} of {profile.rows} "
                               f"rows truncated): ~{duration_text(q.wall_s)}")
    epochs = p.recipe.training.epochs
    if epochs > 1:
        fewer = max(1, min(int(epochs) - 1, int(epochs * LONG_RUN_S / p.wall_s)))
        q = replan(epochs=fewer)
        if q.fits and q.wall_s:
            choices.append(f"--epochs {fewer} (not {epochs:g}): ~{duration_text(q.wall_s)}")
    best = None
    for card in CARDS:
        gpu = get_gpu(card)
        if gpu.tflops <= p.gpu.tflops:
            continue
        q = replan(gpu=gpu)
        if q.fits and q.wall_s:
            best = q
            if q.wall_s <= LONG_RUN_S:
                break
    if best is not None:
        choices.append(f"--gpu {best.gpu.name}: ~{duration_text(best.wall_s)} (speed: {best.speed_source})")
    more = f": cheaper choices: {'; '.join(choices)}" if choices else ""
    return (f"the whole run is predicted to take ~{duration_text(p.wall_s)} on {p.gpu.name}, more than "
            f"{LONG_RUN_S // 3600} hours{more}")


def budget_cuts(p: Any) -> list[tuple[dict[str, Any], str]]:
    """The cheaper choices :func:`within_budget` tries for the plan ``p`` as asked, least reduced first, each as
    ``plan``'s changed arguments and the words for them: fewer epochs (one fewer each, down to one), then the
    sequence at the data's 95th percentile (when it is shorter than ``p``'s, unpacked and not GRPO: the rows above
    it are truncated) with the epochs as asked and again one fewer each. Never another card: the budget is for the
    machine asked for."""
    epochs = p.recipe.training.epochs
    fewer = [({"epochs": e}, f"--epochs {e} (not {epochs:g})") for e in range(math.ceil(epochs) - 1, 0, -1)]
    cuts = list(fewer)
    data = p.data or {}
    if data.get("p95_tokens") and not spec_of(p.recipe.objective).generates and not p.recipe.data.packing:
        seq = round_up(data["p95_tokens"])
        if seq < p.seq_len:
            shorter = f"--seq-len {seq} (the data's 95th percentile, not {p.seq_len}: the rows above it are truncated)"
            cuts.append(({"seq_len": seq}, shorter))
            cuts += [({"seq_len": seq, **c}, f"{shorter}, {what}") for c, what in fewer]
    return cuts


def hours_above(seconds: float) -> str:
    """``seconds`` in hours rounded up to two significant digits, as a ``--max-hours`` that holds them."""
    hours = seconds / 3600
    step = 10 ** (math.floor(math.log10(hours)) - 1)
    return f"{math.ceil(round(hours / step, 9)) * step:.2g}"


def within_budget(max_hours: float, replan: Callable[..., Any]) -> Any:
    """The plan of ``finetuner plan --max-hours H``: the least-reduced of the job as asked and its
    :func:`budget_cuts` whose whole run (:attr:`~finetuner.planning.plan_result.Plan.wall_s`) is predicted to take at
    most ``max_hours``, planned in full, its first reason saying what was reduced and the predicted time. When none
    is, the one predicted shortest, with :attr:`~finetuner.planning.plan_result.Plan.over_budget` saying so (the CLI
    exits 1 and writes no recipe). ``replan(**changes)``: the same job planned with ``seq_len``, ``epochs`` or
    ``alternatives`` changed. A plan that does not fit the card is returned as it is (memory comes first)."""
    if not max_hours > 0 or math.isinf(max_hours):  # also NaN
        raise UserError(f"--max-hours {max_hours:g}: the time budget must be a number of hours above 0, e.g. 2 or 0.5.")
    limit = max_hours * 3600
    asked = replan(alternatives=False)
    if not asked.fits:
        return replan()
    if not asked.wall_s:
        raise UserError(f"--max-hours {max_hours:g}: the whole run's time of this plan is not predicted (its steps are "
                        "not known), so no plan can be chosen by it.", hint="Plan with --data FILE, or leave out --max-hours.")
    if asked.wall_s <= limit:
        chosen = replan()
        chosen.reasons.insert(0, f"fits --max-hours {max_hours:g} as asked: the whole run ~{duration_text(chosen.wall_s)}")
        return chosen
    shortest, said = asked, "the plan as asked"
    for changes, what in budget_cuts(asked):
        q = replan(alternatives=False, **changes)
        if not (q.fits and q.wall_s):
            continue
        if q.wall_s <= limit:
            chosen = replan(**changes)
            chosen.reasons.insert(0, f"reduced to fit --max-hours {max_hours:g}: {what}: the whole run ~"
                                     f"{duration_text(chosen.wall_s)} (as asked ~{duration_text(asked.wall_s)})")
            return chosen
        if q.wall_s < shortest.wall_s:
            shortest, said = q, what
    shortest.over_budget = (f"nothing fits --max-hours {max_hours:g} on {shortest.gpu.name}: the shortest "
                            f"plan is {said}, ~{duration_text(shortest.wall_s)} (as asked ~{duration_text(asked.wall_s)}); give "
                            f"--max-hours {hours_above(shortest.wall_s)} or more, or a faster --gpu")
    return shortest

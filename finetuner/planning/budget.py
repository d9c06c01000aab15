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

from collections.abc import Callable
from typing import Any

from finetuner.config.hardware import get_gpu
from finetuner.planning.length_cap import round_up

#: A plan predicted to take longer than this (the whole run) says so up front.
LONG_RUN_S = 3 * 3600
#: The cards a long plan names, cheapest first.
CARDS = ("t4", "l4", "rtx4090", "a100-80gb", "h100-80gb")


def long_run_warning(p: Any, replan: Callable[..., Any], duration: Callable[[float | None], str],
                     profile: Any = None) -> str | None:
    """The warning of a plan ``p`` (a :class:`~finetuner.planning.planner.Plan`) whose whole run is predicted to take
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
                               f"rows truncated): ~{duration(q.wall_s)}")
    epochs = p.recipe.training.epochs
    if epochs > 1:
        fewer = max(1, min(int(epochs) - 1, int(epochs * LONG_RUN_S / p.wall_s)))
        q = replan(epochs=fewer)
        if q.fits and q.wall_s:
            choices.append(f"--epochs {fewer} (not {epochs:g}): ~{duration(q.wall_s)}")
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
        choices.append(f"--gpu {best.gpu.name}: ~{duration(best.wall_s)} (speed: {best.speed_source})")
    more = f": cheaper choices: {'; '.join(choices)}" if choices else ""
    return (f"the whole run is predicted to take ~{duration(p.wall_s)} on {p.gpu.name}, more than "
            f"{LONG_RUN_S // 3600} hours{more}")

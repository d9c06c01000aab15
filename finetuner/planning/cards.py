"""The first sentence of a plan for several cards: whether one card would do, what the chosen
strategy does (in a clause a newcomer reads), and what the extra cards save per step and in all.

``finetuner plan --gpus N`` prints it before the strategy table (which stays, for those who want the
numbers); :func:`finetuner.planning.planner.plan` computes the one-card plan it compares with.
"""

from __future__ import annotations

from typing import Any

from finetuner.strategy_table import FSDP_ENGINE, find_row
from finetuner.units import duration_text

def strategy_words(sharded: Any) -> str:
    """What ``sharded``'s strategy does (its row's words in :mod:`finetuner.strategy_table`) and what it offloads."""
    row = find_row(sharded.strategy)
    words = row.words if row is not None else sharded.strategy
    if sharded.offload != "none":
        words += f" (with {'the shards' if row is not None and row.engine == FSDP_ENGINE else sharded.offload} kept in CPU memory)"
    return words


def headline(n_plan: Any, one_plan: Any) -> str | None:
    """The sentence for ``n_plan`` (a plan on ``n_plan.gpus`` cards) beside ``one_plan`` (the same job on
    one)."""
    _dur = duration_text
    if n_plan.gpus <= 1 or n_plan.sharded is None or not n_plan.fits:
        return None
    card, n = n_plan.gpu.name, n_plan.gpus
    how = strategy_words(n_plan.sharded)
    per_card = n_plan.sharded.per_device_bytes / 2**30
    if not one_plan.fits:
        return (f"One {card} is not enough for this run; on {n} it fits ({per_card:.1f} GiB per card) with {how}.")
    one_gib = one_plan.peak_bytes / 2**30
    text = f"One {card} is enough for this run ({one_gib:.1f} of {n_plan.gpu.memory_gib:.1f} GiB)"
    if n_plan.step_s is None or one_plan.step_s is None:
        return text + f"; on {n} it runs with {how}."
    saved = one_plan.step_s - n_plan.step_s
    if saved <= 0:
        return text + f"; {n} cards would not be faster ({_dur(n_plan.step_s)} a step against {_dur(one_plan.step_s)} on one): use one."
    steps = n_plan.optimizer_steps
    total = f", {_dur(saved * steps)} over its {steps:,} steps" if steps else ""
    return (text + f"; {n} save {_dur(saved)} a step ({_dur(n_plan.step_s)} instead of {_dur(one_plan.step_s)}){total}, "
            f"with {how}.")

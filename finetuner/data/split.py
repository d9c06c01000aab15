"""The held-out split and packing: which examples a run holds out and how it packs the rest into rows.

The data pipelines (:mod:`finetuner.data.pipeline`, :mod:`finetuner.data.preference`,
:mod:`finetuner.data.prompts`) split and pack with these, and the planner (:mod:`finetuner.planning.sizing`,
:mod:`finetuner.planning.planner`) counts held-out rows and packed rows with the same functions, so a plan's
step count is the run's. Pure Python (numpy for the split's permutation, as ``datasets`` draws it).
"""

from __future__ import annotations

import random


def held_out_rows(val_size: float, rows: int) -> int:
    """How many of ``rows`` examples ``data.val_size`` holds out: a number of rows when at least 1, else a
    fraction (at least one row). The trainer's split and the plan's count both come from here."""
    if val_size <= 0:
        return 0
    return int(val_size) if val_size >= 1 else max(1, round(val_size * rows))


def held_out_checked(val_size: float, rows: int, unit: str = "examples") -> int:
    """:func:`held_out_rows`, refused in one line when it would leave no ``unit`` to train on."""
    n = held_out_rows(val_size, rows)
    if n >= rows:
        from finetuner.errors import UserError

        raise UserError(f"data.val_size: {val_size} leaves no training {unit} ({rows} {unit} in all).",
                        hint="Use a fraction below 1, or a smaller number of rows.")
    return n


def held_out_size(rows: int) -> float:
    """The ``data.val_size`` finetuner chooses for ``rows`` examples when nobody named one: none under 10
    rows (each is needed for training), a tenth (at least 2) under 200, then 2 % and at most 200 rows. A
    plan's recipe (:mod:`finetuner.planning.sizing`) and a recipe pointed at other data than its held-out
    file belongs to (:meth:`finetuner.config.recipe.Recipe.from_dict`) both take it from here."""
    if rows < 10:
        return 0.0
    if rows < 200:
        return float(max(2, round(rows * 0.1)))
    return 0.02 if round(rows * 0.02) < 200 else 200.0


def _permutation(rows: int, seed: int) -> list[int]:
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).permutation(rows)]


def train_positions(rows: int, n_val: int, seed: int) -> list[int]:
    """Which of ``rows`` examples stay for training when ``n_val`` are held out: ``datasets``'
    ``train_test_split(test_size=n_val, seed=seed, shuffle=True)``, which the trainer's split calls
    (a ``numpy.random.default_rng(seed)`` permutation; the first ``n_val`` are held out)."""
    return _permutation(rows, seed)[n_val:] if n_val > 0 else list(range(rows))


def held_out_positions(rows: int, n_val: int, seed: int) -> list[int]:
    """The ``n_val`` examples :func:`train_positions` leaves out, in the order the trainer's held-out split
    keeps them (the plan's sample prompts are the first of them, :mod:`finetuner.planning.sample_prompts`)."""
    return _permutation(rows, seed)[:n_val] if n_val > 0 else []


def shuffled_split(rows: int, n_val: int, seed: int) -> tuple[list[int], list[int]]:
    """The split of the preference pairs and of GRPO's prompts (plain lists, not ``datasets``): a
    ``random.Random(seed)`` shuffle of the ``rows`` positions, the first ``n_val`` held out. Returns the
    held-out positions and the training positions, each in the shuffled order."""
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    return order[:n_val], order[n_val:]


def pack_bins(lengths: list[int], max_len: int, seed: int) -> list[list[int]]:
    """Greedy packing of examples of ``lengths`` tokens (already cut at ``max_len``) into rows of at
    most ``max_len`` tokens, in a seeded random order: the positions each packed row holds.
    :func:`finetuner.data.pipeline.pack` packs by it, and the plan counts packed rows with it."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    rows: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        if cur and used + lengths[i] > max_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        rows.append(cur)
    return rows


def count_packed_rows(lengths: list[int], n_val: int, max_len: int, seed: int) -> int:
    """Packed training rows of a data set whose examples have ``lengths`` tokens, ``n_val`` held out:
    the trainer's split (:func:`train_positions`), examples cut at ``max_len``, then :func:`pack_bins`."""
    train = [min(lengths[i], max_len) for i in train_positions(len(lengths), n_val, seed)]
    return len(pack_bins(train, max_len, seed))

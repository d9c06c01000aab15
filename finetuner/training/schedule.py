"""Which examples each optimizer step trains on, and how one step is cut into micro-batches over the ranks
(what :mod:`finetuner.planning.lengths` reproduces to size the padding)."""

from __future__ import annotations

import random

from finetuner.steps import steps_per_epoch


def split_step(n_examples: int, micro_batch_size: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Each rank's micro-batches of one optimizer step, as ``(start, end)`` slices of its examples.

    One process cuts the step's examples into micro-batches of ``micro_batch_size``. When their
    number divides by ``world_size``, rank ``r`` takes micro-batches ``r, r + W, ...`` (the same
    micro-batches, just spread out); otherwise the examples are cut into ``W`` contiguous shares
    (sizes differ by at most one) and each share into micro-batches. Ranks may get different
    numbers of micro-batches (or none).
    """
    bounds = [(i, min(i + micro_batch_size, n_examples)) for i in range(0, n_examples, micro_batch_size)]
    if len(bounds) % world_size == 0:
        return [bounds[r::world_size] for r in range(world_size)]
    base, extra = divmod(n_examples, world_size)
    out, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        out.append([(i, min(i + micro_batch_size, end)) for i in range(start, end, micro_batch_size)])
        start = end
    return out


class StepSchedule:
    """Which examples each optimizer step uses: chunks of a seeded permutation per epoch."""

    def __init__(self, n_examples: int, effective_batch: int, seed: int):
        self.n, self.eff, self.seed = n_examples, effective_batch, seed
        self.steps_per_epoch = steps_per_epoch(n_examples, effective_batch)  # as the plan counts them
        self._perm_epoch, self._perm = -1, []

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            self._perm = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._perm)
            self._perm_epoch = epoch
        return self._perm[k * self.eff : (k + 1) * self.eff]

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch


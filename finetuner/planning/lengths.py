"""The data's lengths as the trainer batches them: how long a micro-batch is, padding included, and
how many of its positions are real tokens.

The trainer draws each step's rows from a seeded permutation (:class:`finetuner.training.schedule.StepSchedule`),
cuts them into micro-batches (:func:`finetuner.training.schedule.split_step`) and pads each micro-batch
to its longest row (the collators of :mod:`finetuner.data.pipeline` and :mod:`finetuner.data.preference`).
A micro-batch of ``k`` rows drawn from ``n`` without replacement is, on average over the permutation,
as long as the expected largest of ``k`` of the ``n`` lengths: with the lengths sorted,
``E[max] = sum_i L_(i) C(i-1, k-1) / C(n, k)`` (the ``i``-th smallest is the largest when the other
``k - 1`` come from the ``i - 1`` below it). Rows longer than ``data.max_seq_len`` are cut to it, as the
trainer cuts them. Packed rows are full: no padding.

The speed model (:func:`finetuner.planning.speed.step_time`) times a micro-batch at this padded
length and counts its real tokens for tokens/s, which is then what a run reports: real tokens
(prompt and response, padding excluded) per second of training. ``tests/planning/test_lengths.py``
checks the expectation against the trainer's own batching.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchShape:
    """One micro-batch of the data on average: ``padded_len`` positions per row (its longest row),
    ``real_per_row`` real tokens per row (padding excluded)."""

    padded_len: float
    real_per_row: float
    #: where the lengths came from, for the estimate's one line (``data.path``, ``the run's data``)
    source: str = "data"

    @property
    def fill(self) -> float:
        """Share of the padded positions that are real tokens."""
        return self.real_per_row / max(self.padded_len, 1e-9)


def expected_longest(lengths: Sequence[int], k: int) -> float:
    """The expected largest of ``k`` lengths drawn without replacement from ``lengths``."""
    n = len(lengths)
    if n == 0:
        raise ValueError("no lengths")
    k = max(1, min(k, n))
    ordered = sorted(lengths)
    if k == 1:
        return sum(ordered) / n
    # P(the i-th smallest, 1-based, is the largest) = C(i-1, k-1) / C(n, k), in logs for large n
    log_total = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    out = 0.0
    for i in range(k, n + 1):
        log_p = math.lgamma(i) - math.lgamma(k) - math.lgamma(i - k + 1) - log_total
        out += ordered[i - 1] * math.exp(log_p)
    return out


def batch_shape(lengths: Sequence[int], micro_batch: int, max_seq_len: int, packing: bool = False,
                source: str = "data") -> BatchShape:
    """The average micro-batch of ``micro_batch`` rows of data with these token ``lengths`` (one per
    training row; for preference pairs the longer sequence of each pair), cut to ``max_seq_len``."""
    cut = [max(1, min(int(x), max_seq_len)) for x in lengths]
    if packing:  # rows are filled to max_seq_len from the examples end to end
        return BatchShape(float(max_seq_len), float(max_seq_len), source)
    return BatchShape(expected_longest(cut, micro_batch), sum(cut) / len(cut), source)



def prompt_batch(lengths: Sequence[int], prompts: int, max_prompt_len: int, source: str = "data") -> BatchShape:
    """GRPO's prompts as its ``generate`` calls take them (:func:`finetuner.objectives.rollout.generate_group`):
    the ``prompts`` prompts sampled together (a step's ``micro_batch_size × gradient_accumulation``, or an
    evaluation's held-out prompts) are left-padded to the longest of them before they are cut into
    calls, so ``padded_len`` is the expected longest of ``prompts`` prompt lengths and ``real_per_row``
    the mean prompt (both cut to ``max_prompt_len``, ``data.max_seq_len − grpo.max_new_tokens``: the
    trainer refuses a longer prompt). ``lengths``: the prompts' token lengths
    (:func:`finetuner.data.stats.profile_prompts`)."""
    cut = [max(1, min(int(x), max_prompt_len)) for x in lengths]
    return BatchShape(expected_longest(cut, prompts), sum(cut) / len(cut), source)

"""The planned sequence follows the data's lengths, not its single longest row.

Every row of a micro-batch is padded to its longest row, and a step's attention and activations grow with that
length, so a sequence sized to one outlier (LLaMA-Factory's ``glaive_toolcall_en_demo.json``: one 11,625-token row,
99 % of the rows at most 1,594) makes every batch that draws the outlier, and the memory the planner must leave
for it, pay for a row the other 99 % do not have: the planner took 8,192 tokens (SmolLM2's positions) for that
file; capped, it takes 1,600 (``tests/planning/test_length_cap.py``).

The rule (:func:`outlier_cap`): when the longest row is more than ``OUTLIER_RATIO`` times the
``CAP_PERCENTILE``-th percentile of the lengths, the sequence is that percentile rounded up as the planner rounds
lengths (:func:`round_up`, to ``SEQ_ROUND``). By the percentile's definition at most 1 % of the rows lie above it,
so a file of fewer than 100 rows is never capped (there the percentile is the longest row). The rows above the cap
are truncated as the trainer truncates any row longer than ``data.max_seq_len``: a supervised example loses its
end (answers included; one left with no answer token is dropped and counted), a preference pair the start of its
prompt. The plan says how many, and what keeping them would cost (:meth:`LengthCap.keeping_text`: the plan of the
same job at the uncapped length, as ``finetuner plan --seq-len N`` gives it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetuner.units import duration_text, gib_text

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.data.stats import DataProfile

#: Sequence lengths from the data are rounded up to this.
SEQ_ROUND = 64
#: The percentile a sequence is capped at when a few rows are outliers.
CAP_PERCENTILE = 99
#: The longest row must be more than this many times the percentile for the cap.
OUTLIER_RATIO = 2.0


def round_up(n: int, to: int = SEQ_ROUND) -> int:
    """``n`` rounded up to a multiple of ``to`` (at least ``to``): how the planner rounds lengths."""
    return max(to, int(math.ceil(n / to)) * to)


@dataclass(frozen=True)
class LengthCap:
    """A sequence capped below the data's longest row: ``seq`` (the percentile rounded up), ``uncapped`` (the
    sequence the longest row would take, at most the model's positions), ``cut`` of ``rows`` rows longer than
    ``seq``."""

    seq: int
    uncapped: int
    at_percentile: int
    longest: int
    cut: int
    rows: int
    #: what the trainer does with a row longer than ``seq`` (from the objective)
    preference: bool = False

    def reason(self, units: str = "examples", packed: str | None = None) -> str:
        """The plan's reason for the sequence: the percentile, the longest row, and the rows cut; ``packed``:
        the packing's reason when packing set the sequence (at or above the cap)."""
        what = ("their prompts lose their start" if self.preference else
                "their ends, answers included, are not trained; one left with no answer token is dropped")
        why = packed or (f"the {CAP_PERCENTILE}th percentile of the {units}' lengths ({self.at_percentile} tokens) "
                         f"rounded up to a multiple of {SEQ_ROUND}, not the longest ({self.longest} tokens, "
                         f"{self.longest / max(1, self.at_percentile):.1f}x it)")
        return (f"sequence {self.seq}{' ' if packed else ': '}{why}: {self.cut} of {self.rows} {units} are longer and are "
                f"truncated to {self.seq} tokens ({what})")

    def keeping_text(self, uncapped: Any, capped: Any, units: str = "examples") -> str:
        """What keeping the cut rows whole costs: ``uncapped``, the plan of the same job at ``self.uncapped``
        (``--seq-len``), against ``capped``, this plan (both :class:`~finetuner.planning.plan_result.Plan`)."""
        head = f"keeping the {self.cut} longer {units} whole: --seq-len {self.uncapped}"
        if self.uncapped < self.longest:
            head += " (the model's positions; the longest is cut even then)"
        if not uncapped.fits:
            return f"{head} does not fit {uncapped.gpu.name}: {uncapped.reasons[-1] if uncapped.reasons else ''}".rstrip(": ")
        gib, c = 1024**3, uncapped.recipe_choice()
        mem = (f"micro-batch {c['micro_batch_size']}, checkpointing {'on' if c['gradient_checkpointing'] else 'off'}, "
               f"peak {gib_text(uncapped.peak_bytes, 1)} (this plan {capped.peak_bytes / gib:.1f})")
        if uncapped.wall_s and capped.wall_s:
            when = (f"the whole run ~{duration_text(uncapped.wall_s)} (this plan ~{duration_text(capped.wall_s)}, "
                    f"{uncapped.wall_s / capped.wall_s:.1f}x)")
        else:
            when = f"{duration_text(uncapped.step_s)} per optimizer step (this plan {duration_text(capped.step_s)})"
        return f"{head}: {mem}, {when}"


def outlier_cap(profile: DataProfile, positions: int, preference: bool = False) -> LengthCap | None:
    """The cap of the module doc for the rows of ``profile`` (their token lengths, by the nearest-rank
    percentile of :meth:`~finetuner.data.stats.DataProfile.percentile`) and a model of ``positions``, or None when
    the longest row is not an outlier (or capping would not shorten the sequence)."""
    longest, at = profile.max_tokens, profile.percentile(CAP_PERCENTILE)
    if longest <= OUTLIER_RATIO * at:
        return None
    seq = min(round_up(at), positions)
    uncapped = min(round_up(longest), positions)
    if seq >= uncapped:
        return None
    return LengthCap(seq, uncapped, at, longest, profile.truncated(seq), profile.rows, preference)

"""The tokens a ``model.generate`` call makes, counted into the open phase (:mod:`finetuner.phases`) step by step.

A batched generation (the replay answers, the general probe's, an evaluation's completions) returns its answers
only when its longest one ends: counted by answers alone, a phase says "0/12 answers" for as long as the batch
takes. :func:`counted` gives ``generate`` a stopping criterion that never stops anything and, at each decoding
step, adds to the phase's ``tokens`` one token for each row still answering (a row is done once it has made one
of ``stop_ids``), so that the phase's record moves while the batch runs.

Imports torch and transformers only when called (any layer above :mod:`finetuner.phases` may use it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import finetuner.phases as phases


def counted(stop_ids: int | Iterable[int | None] | None, phase: phases.Phase | None = None) -> Any:
    """A ``transformers.StoppingCriteriaList`` to pass to ``generate`` (``stopping_criteria=``): its one criterion
    counts the generated tokens into ``phase`` (by default the one this thread opened last: call it in the thread
    that opened the phase, also when ``generate`` runs in another); empty outside a phase. ``stop_ids``: the
    generation's ``eos_token_id`` (an id, a list of ids or None)."""
    from transformers import StoppingCriteriaList

    phase = phase or phases.current()
    if phase is None:
        return StoppingCriteriaList()
    ids = [stop_ids] if isinstance(stop_ids, int) else [i for i in stop_ids or () if isinstance(i, int)]
    return StoppingCriteriaList([_counter(phase, ids)])


def _counter(phase: phases.Phase, stop_ids: list[int]) -> Any:
    import torch
    from transformers import StoppingCriteria

    class TokenCount(StoppingCriteria):
        """Called by ``generate`` after each step with the ids so far (the new token last in each row)."""

        def __init__(self) -> None:
            self.finished: torch.Tensor | None = None
            self.stops: torch.Tensor | None = None
            self.width = -1  # the ids' length at the last step

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> bool:
            last = input_ids[:, -1]
            if self.finished is None or input_ids.shape[1] != self.width + 1:  # a new generate call's first step
                self.finished = torch.zeros(last.shape[0], dtype=torch.bool, device=last.device)
                self.stops = torch.tensor(stop_ids, dtype=last.dtype, device=last.device)
            self.width = input_ids.shape[1]
            phase.generated(int((~self.finished).sum()))
            self.finished |= torch.isin(last, self.stops)
            return False  # never stops a row: generate's own criteria do

    return TokenCount()

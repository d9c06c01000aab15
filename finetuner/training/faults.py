"""Fault injection for tests: make a run fail the way real runs fail, at a chosen step.

``FINETUNER_FAULT="KILL@5"`` sends the process SIGKILL right after optimizer step 5 (a crash,
a closed laptop lid); ``INT@3`` / ``TERM@3`` send SIGINT / SIGTERM (the user's Ctrl-C, or the
web UI's stop button); ``OOM@3`` raises an out-of-memory error in step 3 after its first
micro-batch (``OOM@3*2``: in two attempts at it; ``OOM@3*inf``: in every attempt).
Several faults are separated by commas. Unset in normal use; read once per run.
"""

from __future__ import annotations

import os
import signal

ENV = "FINETUNER_FAULT"


class FaultPlan:
    def __init__(self, spec: str | None = None):
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.signals: dict[int, int] = {}
        self.ooms: dict[int, float] = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, _, where = item.partition("@")
            step, _, times = where.partition("*")
            if name.upper() == "OOM":
                self.ooms[int(step)] = float(times or 1)
            else:
                self.signals[int(step)] = getattr(signal, f"SIG{name.upper()}")

    def after_step(self, step: int) -> None:
        if step in self.signals:
            os.kill(os.getpid(), self.signals[step])

    def in_step(self, step: int) -> None:
        """Raise a simulated out-of-memory error if one is planned for this (1-based) step."""
        left = self.ooms.get(step, 0)
        if left > 0:
            self.ooms[step] = left - 1
            import torch

            raise torch.OutOfMemoryError(f"simulated out-of-memory error in step {step} ({ENV})")

"""Fault injection for tests: make a run fail the way real runs fail, at a chosen step.

``FINETUNER_FAULT="KILL@5"`` sends the process SIGKILL right after optimizer step 5 (a crash,
a closed laptop lid); ``INT@3`` / ``TERM@3`` send SIGINT / SIGTERM (the user's Ctrl-C, or the
web UI's stop button). Unset in normal use; read once per run.
"""

from __future__ import annotations

import os
import signal

ENV = "FINETUNER_FAULT"


class FaultPlan:
    def __init__(self, spec: str | None = None):
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.signal, self.step = None, None
        if spec:
            name, _, step = spec.partition("@")
            self.signal = getattr(signal, f"SIG{name.strip().upper()}")
            self.step = int(step)

    def after_step(self, step: int) -> None:
        if self.signal is not None and step == self.step:
            os.kill(os.getpid(), self.signal)

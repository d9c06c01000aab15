"""Fault injection for tests: make a run fail the way real runs fail, at a chosen step.

``FINETUNER_FAULT="KILL@5"`` sends the process SIGKILL right after optimizer step 5 (a crash,
a closed laptop lid); ``INT@3`` / ``TERM@3`` send SIGINT / SIGTERM (the user's Ctrl-C, or the
web UI's stop button); ``OOM@3`` raises an out-of-memory error in step 3 after its first
micro-batch (``OOM@3*2``: in two attempts at it; ``OOM@3*inf``: in every attempt).

Two fault points sit inside the writes a crash could cut short: ``KILL@save:4`` kills the
process in the middle of writing the checkpoint of step 4 (the adapter written, the optimizer
state and the rename not), ``KILL@events:5`` halfway through appending the ``step`` event of
step 5 to ``events.jsonl`` (half a line on disk).

``HOLD@4`` holds the run after optimizer step 4 (its events written) for as long as the file
named by ``FINETUNER_HOLD_FILE`` exists, or until a stop is asked for: a test that must see a
run mid-way (a status, a page reloaded during training, a stop) creates the file, looks, then
deletes it or stops the run, however fast the machine. ``HOLD@merge``, ``HOLD@export`` and ``HOLD@adapter`` hold
the same way inside a write, once its staging exists (:func:`finetuner.fileio.hold`): a merge's folder made, a GGUF file's header
written, a run's final adapter folder made, the rest not written yet; a test then fills the disk under it, or
sends the process a signal, at that point of the write however fast the machine.

In a multi-process run every fault applies to every rank unless a rank follows it:
``OOM@3:1`` is "in step 3 on rank 1 only", ``KILL@save:4:0`` "inside the save of step 4 on rank 0".
Several faults are separated by commas. Unset in normal use; read once per process.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

from finetuner.fileio import FAULT_ENV as ENV, HOLD_ENV, HOLD_POINTS  # HOLD_ENV: the gate file of HOLD@STEP and HOLD@POINT

#: the points inside a write that ``KILL@POINT:STEP`` can name
WRITE_POINTS = ("save", "events")


def _parse(spec: str):
    """``(name, point, step, times, rank)`` for each fault of ``spec``; a malformed one raises ValueError."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, at, where = item.partition("@")
        parts = where.split(":")
        point = parts.pop(0).lower() if parts and parts[0].isalpha() else None
        if name.upper() == "HOLD" and point in HOLD_POINTS and not parts:
            out.append(("HOLD", point, 0, 1.0, None))
            continue
        try:
            if not at or point not in (None, *WRITE_POINTS) or len(parts) not in (1, 2):
                raise ValueError
            step, _, times = parts[0].partition("*")
            rank = int(parts[1]) if len(parts) == 2 else None
            out.append((name.upper(), point, int(step), float(times or 1), rank))
            if name.upper() not in ("OOM", "HOLD"):
                getattr(signal, f"SIG{name.upper()}")
            if point and name.upper() != "KILL":
                raise ValueError
        except (ValueError, AttributeError):
            raise ValueError(
                f"{ENV}: cannot read {item!r}; write NAME@STEP[*TIMES][:RANK] (NAME: KILL, INT, TERM, OOM or HOLD), "
                f"KILL@save:STEP[:RANK] / KILL@events:STEP[:RANK] or HOLD@{'/HOLD@'.join(HOLD_POINTS)}"
            ) from None
    return out


class FaultPlan:
    def __init__(self, spec: str | None = None):
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.signals: dict[tuple[int, int | None], int] = {}
        self.ooms: dict[tuple[int, int | None], float] = {}
        self.kills_in: dict[str, set[tuple[int, int | None]]] = {p: set() for p in WRITE_POINTS}
        self.holds: set[tuple[int, int | None]] = set()
        self.hold_points: set[str] = set()
        self.gate = os.environ.get(HOLD_ENV, "")
        for name, point, step, times, rank in _parse(spec):
            if name == "HOLD" and not self.gate:
                raise ValueError(f"{ENV}: HOLD@{point or step} needs {HOLD_ENV}, the file whose presence holds the run")
            if name == "HOLD" and point:
                self.hold_points.add(point)
            elif point:
                self.kills_in[point].add((step, rank))
            elif name == "HOLD":
                self.holds.add((step, rank))
            elif name == "OOM":
                self.ooms[(step, rank)] = times
            else:
                self.signals[(step, rank)] = getattr(signal, f"SIG{name}")

    @staticmethod
    def _find(table, step: int, rank: int):
        """The key of ``table`` (a dict or a set) that applies to ``step`` on ``rank`` (rank-qualified first), or None."""
        return next((key for key in ((step, rank), (step, None)) if key in table), None)

    def after_step(self, step: int, rank: int = 0, stopping: Callable[[], bool] = lambda: False,
                   agree: Callable[[bool], bool] = lambda end: end) -> None:
        """Hold (``HOLD@``) until the gate file is gone or ``stopping()`` is true, then send a planned signal.
        ``agree`` turns this process's "end the hold" into the answer every process of the run shares (one
        collective call a round under several processes): each rank sees the gate go at its own moment, and a rank
        that left the hold a round before another would match that one's next call with a different collective."""
        if self._find(self.holds, step, rank) is not None:
            while not agree(not os.path.exists(self.gate) or stopping()):
                time.sleep(0.05)
        key = self._find(self.signals, step, rank)
        if key is not None:
            os.kill(os.getpid(), self.signals[key])

    def in_step(self, step: int, rank: int = 0) -> None:
        """Raise a simulated out-of-memory error if one is planned for this (1-based) step on this rank."""
        key = self._find(self.ooms, step, rank)
        if key is not None and self.ooms[key] > 0:
            self.ooms[key] -= 1
            import torch

            where = f" on rank {rank}" if key[1] is not None else ""
            raise torch.OutOfMemoryError(f"simulated out-of-memory error in step {step}{where} ({ENV})")

    def wants_kill_in(self, point: str) -> bool:
        """Whether a ``KILL@point:…`` fault is planned (the writer then calls :meth:`in_write`)."""
        return bool(self.kills_in[point])

    def in_write(self, point: str, step: int, rank: int = 0) -> None:
        """SIGKILL this process if a kill is planned inside this write (``save``/``events``) of ``step``."""
        if self._find(self.kills_in[point], step, rank) is not None:
            os.kill(os.getpid(), signal.SIGKILL)


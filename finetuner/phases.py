"""The phases of a run or a command that are not training steps, as progress: a count, the time spent, an ETA.

Measuring the machine's speed, loading the model, tokenizing, the base model's replay answers, the general probe, evaluations, checkpoints, the
sample answers, merges and exports each open a :class:`Phase`. A phase hands its progress to a *sink* (a function
of one dict): a run's sink writes the ``phase`` event of ``events.jsonl`` (:mod:`finetuner.runs.schema`), which the
CLI's progress printer, the web UI and a notebook's bar show; a command that writes no events (``merge``,
``export``) gives the console's printer directly. Each record has the fields of that event:

``phase`` (a key of :data:`PHASES`), ``label`` (its words), ``state`` (``start``, ``progress``, ``end``), ``done`` and
``total`` (a count in ``unit``; ``total`` None when not known), ``tokens`` (the tokens a generation in the phase
made so far, counted at each decoding step: :mod:`finetuner.token_progress`; None in a phase that generates nothing),
``elapsed_s``, ``eta_s`` (None when it cannot say), ``eta_from``: ``measured`` (the items done so far: ``elapsed /
done x (total - done)``), ``planned`` (the phase's predicted seconds less the time spent, before the first item or
for a phase with no count) or ``past_plan`` (that plan's seconds spent and no item done: ``eta_s`` None, the lines
say "slower than planned"), and ``planned_s`` (the phase's predicted seconds; None without a plan).

Code deep inside a phase (a ``datasets.map`` function, a generation loop) reports with the module functions
:func:`advance` and :func:`expect`, which act on the phase this thread opened last, and do nothing outside one, in
another thread or in a worker process (a ``datasets`` worker is forked with this module's state); a generation
counts its tokens with :meth:`Phase.generated` (from the thread ``generate`` runs in, on the phase its caller's
thread opened). A phase whose one call blocks (a model's load, a checkpoint's write) gets a line anyway: a
heartbeat thread repeats the record every ``heartbeat_s`` seconds when nothing else was said, so nothing runs for
long without a line.

No torch, no finetuner module but :mod:`finetuner.units` (its times written by ``clock_text``): any layer may
open a phase.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from finetuner.units import clock_text, duration_text

Sink = Callable[[dict[str, Any]], Any]

#: The phases, in the order a run meets them, with the words the console and the UI show.
PHASES: dict[str, str] = {
    "measure": "measuring the data",
    "calibrate": "measuring this machine's speed",
    "tokenize": "tokenizing the data",
    "load": "loading the model",
    "replay": "the base model's replay answers",
    "eval": "evaluation",
    "checkpoint": "writing a checkpoint",
    "save": "saving the adapter",
    "probe": "general probe",
    "tool_calls": "held-out tool calls",
    "samples": "sample answers",
    "merge": "merging the adapter",
    "write": "writing the model files",
    "verify": "checking the written model",
    "export": "writing the GGUF file",
    "quantize": "quantizing with llama.cpp",
    "readback": "reading the GGUF file back",
    "answers": "exact-match answers",
}
#: A record's ``state``.
STATES = ("start", "progress", "end")
#: Where a record's ``eta_s`` comes from (see the module doc); None: it cannot say.
ETA_FROM = ("measured", "planned", "past_plan")

#: Seconds between two ``progress`` records of a phase (the last item's always goes out).
EVERY_S = 2.0
#: Seconds of silence after which the heartbeat repeats a phase's record.
HEARTBEAT_S = 10.0

_local = threading.local()


class Phase:
    """One phase's progress (see the module doc). Use it as a context manager::

        with Phase("replay", sink, total=len(prompts), unit="answers", predicted_s=40.0) as p:
            for batch in batches:
                ...
                p.advance(len(batch))
    """

    def __init__(self, name: str, sink: Sink, total: int | None = None, unit: str = "", predicted_s: float | None = None,
                 every_s: float = EVERY_S, heartbeat_s: float | None = HEARTBEAT_S, label: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; one of {', '.join(PHASES)}")
        self.name, self.sink, self.total, self.unit = name, sink, total, unit
        self.label = label or PHASES[name]
        self.predicted_s = predicted_s
        self.every_s, self.heartbeat_s, self.clock = every_s, heartbeat_s, clock
        self.done = 0
        self.tokens: int | None = None  # generated tokens, once a generation counts them (generated)
        self.began = self.last_said = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._pid = os.getpid()
        self._outer: Phase | None = None

    # ------------------------------------------------------------------ what it says
    def eta(self, now: float) -> tuple[float | None, str | None]:
        """Seconds left and where the figure comes from (see the module doc)."""
        elapsed = now - self.began
        if self.total is not None and self.done > 0:
            return elapsed / self.done * max(0, self.total - self.done), "measured"
        if self.predicted_s is not None:
            left = self.predicted_s - elapsed
            return (left, "planned") if left >= 0 else (None, "past_plan")
        return None, None

    def record(self, state: str, now: float) -> dict[str, Any]:
        eta, eta_from = (0.0, "measured") if state == "end" else self.eta(now)
        return {"phase": self.name, "label": self.label, "state": state, "done": self.done, "total": self.total,
                "unit": self.unit, "tokens": self.tokens, "elapsed_s": round(now - self.began, 3),
                "eta_s": None if eta is None else round(eta, 1), "eta_from": eta_from,
                "planned_s": None if self.predicted_s is None else round(self.predicted_s, 1)}

    def _say(self, state: str) -> None:
        with self._lock:
            now = self.clock()
            self.last_said = now
            self.sink(self.record(state, now))

    # ------------------------------------------------------------------ what the work tells it
    def advance(self, n: int = 1) -> None:
        """``n`` more items done; a ``progress`` record when ``every_s`` has passed since the last, or at the last item."""
        self.done += n
        now = self.clock()
        if now - self.last_said >= self.every_s or (self.total is not None and self.done >= self.total):
            self._say("progress")

    def expect(self, n: int) -> None:
        """``n`` more items to do than the total said so far (a total learnt as the work goes)."""
        self.total = (self.total or 0) + n

    def generated(self, n: int) -> None:
        """``n`` more tokens generated (a decoding step of a batch: one per row still answering); a ``progress``
        record when ``every_s`` has passed since the last, so that a batch's count moves before its answers are
        done. Safe from another thread (a streamed generation runs in its own)."""
        with self._lock:
            self.tokens = (self.tokens or 0) + n
        if self.clock() - self.last_said >= self.every_s:
            self._say("progress")

    # ------------------------------------------------------------------ open and close
    def __enter__(self) -> Phase:
        self.began = self.clock()
        self._outer = getattr(_local, "phase", None)
        _local.phase = self
        self._say("start")
        if self.heartbeat_s:
            self._beat = threading.Thread(target=self._heartbeat, name=f"finetuner-phase-{self.name}", daemon=True)
            self._beat.start()
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        _local.phase = self._outer
        if kind is None:  # a phase cut short by an error says nothing more: the error is what the user reads
            if self.total is None:
                self.total = self.done
            self.done = self.total  # what worker processes did too (their counts are not seen here)
            self._say("end")

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 4):
            if self.clock() - self.last_said >= self.heartbeat_s:
                try:
                    self._say("progress")
                except Exception:  # noqa: BLE001 - a line that cannot be written must not stop the work
                    return


# ---------------------------------------------------------------------- how a record is said
def eta_text(rec: dict[str, Any]) -> str:
    """A record's ETA as the bar and the lines say it: ``0:00:12``, ``0:00:40 (planned)``, ``-``; past its plan
    ``- (slower than the planned 9.4 s)``."""
    if rec.get("eta_from") == "past_plan":
        return f"- (slower than the planned {duration_text(rec.get('planned_s'))})"
    if rec.get("eta_s") is None:
        return "-"
    return clock_text(rec["eta_s"]) + (" (planned)" if rec.get("eta_from") == "planned" else "")


def tokens_text(rec: dict[str, Any]) -> str:
    """The tokens a record's generation made, as the bar and the lines add them: `` (1,204 tokens)``; "" when it
    counts none."""
    return "" if rec.get("tokens") is None else f" ({rec['tokens']:,} tokens)"


def line(rec: dict[str, Any]) -> str:
    """A record as one line (the console off a terminal, the web UI's status): ``the base model's replay answers:
    32/64 answers (2,048 tokens), 0:00:41 so far, ETA 0:00:40``; past its plan ``...: 0/12 answers (1,204 tokens),
    slower than planned: 0:06:02 so far, planned 9.4 s``; at its end ``... done, 64 answers in 0:01:21``."""
    unit = f" {rec['unit']}" if rec.get("unit") else ""
    tokens = tokens_text(rec)
    if rec["state"] == "end":
        count = f"{rec['done']:,}{unit}{tokens} " if unit else ""
        return f"{rec['label']}: done, {count}in {clock_text(rec['elapsed_s'])}"
    if rec.get("total") is not None:
        count = f"{rec['done']:,}/{rec['total']:,}{unit}{tokens}, "
    else:
        count = f"{rec['done']:,}{unit}{tokens}, " if unit and (rec["done"] or tokens) else ""
    if rec.get("eta_from") == "past_plan":
        return (f"{rec['label']}: {count}slower than planned: {clock_text(rec['elapsed_s'])} so far, "
                f"planned {duration_text(rec.get('planned_s'))}")
    return f"{rec['label']}: {count}{clock_text(rec['elapsed_s'])} so far, ETA {eta_text(rec)}"


# ---------------------------------------------------------------------- a command's phases
class reporting:  # noqa: N801 - used as a statement: ``with phases.reporting(printer):``
    """Where :func:`phase` sends the records of phases this thread opens (a command's front: the CLI's printer, the
    web UI's export worker), until the ``with`` block ends; without it they go nowhere."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self._outer: Sink | None = None

    def __enter__(self) -> reporting:
        self._outer = getattr(_local, "sink", None)
        _local.sink = self.sink
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.sink = self._outer


def _nowhere(rec: dict[str, Any]) -> None:
    return None


def phase(name: str, total: int | None = None, unit: str = "", predicted_s: float | None = None,
          label: str | None = None) -> Phase:
    """A :class:`Phase` whose records go where :class:`reporting` says for this thread (nowhere without it): what
    a library function (a merge, an export) opens, for whichever front called it; ``label``: other words than
    the name's (the same phase of another file)."""
    sink = getattr(_local, "sink", None)
    return Phase(name, sink or _nowhere, total=total, unit=unit, predicted_s=predicted_s, label=label,
                 heartbeat_s=HEARTBEAT_S if sink else None)


def current() -> Phase | None:
    """The phase this thread opened last and has not closed, in this process; None outside one."""
    p = getattr(_local, "phase", None)
    return p if p is not None and p._pid == os.getpid() else None


def advance(n: int = 1) -> None:
    """:meth:`Phase.advance` of the :func:`current` phase; nothing outside one."""
    p = current()
    if p is not None:
        p.advance(n)


class Advance:
    """:func:`advance` as an object that pickles by name, for a function whose code ``datasets`` hashes (it cannot
    pickle this module's thread-local state, which a plain reference to :func:`advance` reaches)."""

    def __call__(self, n: int = 1) -> None:
        advance(n)

    def __reduce__(self) -> tuple[Any, ...]:
        return Advance, ()


def expect(n: int) -> None:
    """:meth:`Phase.expect` of the :func:`current` phase; nothing outside one."""
    p = current()
    if p is not None:
        p.expect(n)

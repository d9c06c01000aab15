"""One protocol for finetuner's worker processes: a training job, a chat model, a merge or an export.

A worker reports to the process that started it (the web UI, the Python API) in JSON lines, one
message a line, each an object with ``kind``:

- ``started``: it is ready (a chat model is loaded), with what it has to say about itself;
- ``progress``: a piece of the work (a chat reply's next text piece);
- ``phase``: how far a phase of the work has come (a merge's or an export's loading, writing, checking): the
  fields of a :mod:`finetuner.phases` record (``phase``, ``label``, ``state``, ``done``, ``total``, ...), which
  the caller shows (:func:`finetuner.phases.line`) while it waits;
- ``error``: it failed: ``message``, ``hint`` (or null), ``type`` (the exception's class) and
  ``user_error`` (true when the input or the machine is at fault and ``message`` says what to do;
  false for a bug), the fields of a run's ``error`` event (docs/events.md) plus the hint; for a full
  disk also ``disk_full`` (the write, what comes next and the space it needs), so that the caller
  says it with the space free when it reports it;
- ``done``: the work is finished, with its result.

A message about one request of several carries the request's ``id``. The channel is the worker's
stdout, a pipe (:func:`take_stdout`: library output printed in the worker goes to stderr instead, so it
cannot corrupt the stream), or, for a training job that outlives the process that started it, the
run's ``events.jsonl`` (``start``, ``step``, then ``error``, ``done`` or ``stopped``, the same
meanings) and a report file (:data:`REPORT_ENV`) for a failure that may not be written into the run
folder. :func:`error_message` turns an exception into an ``error`` message and :func:`error_of`
turns it back, in the caller, into the same :class:`~finetuner.errors.UserError` (message and hint as
raised) or a :class:`RuntimeError` for a bug: one place decides how a failure crosses a process.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from pathlib import Path
from typing import IO, Any, NoReturn

from finetuner.errors import OutOfMemory, UserError
from finetuner.fileio import DiskFull

KINDS: tuple[str, ...] = ("started", "progress", "phase", "error", "done")

#: For a training job (``finetuner run``): the file the process appends its ``error`` message to when it
#: fails, set by the job runner (:mod:`finetuner.runs.jobs`); read when the run folder has no event saying so.
REPORT_ENV = "FINETUNER_WORKER_REPORT"


def message(kind: str, **fields: Any) -> dict[str, Any]:
    """A protocol message of ``kind`` (one of :data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown worker message kind {kind!r}; one of {', '.join(KINDS)}")
    return {"kind": kind, **fields}


def error_fields(exc: BaseException) -> dict[str, Any]:
    """What an exception says to the user: ``message``, ``hint``, ``type``, ``user_error``. A
    :class:`UserError`'s message and hint as raised; anything else (a bug) as ``Type: text``."""
    if isinstance(exc, DiskFull):  # and what it was made of: said again where the space is measured later (error_of)
        return {"message": exc.message, "hint": exc.hint, "type": type(exc).__name__, "user_error": True, "disk_full": exc.fields()}
    if isinstance(exc, UserError):
        return {"message": exc.message, "hint": exc.hint, "type": type(exc).__name__, "user_error": True}
    if isinstance(exc, KeyboardInterrupt):
        return {"message": "interrupted", "hint": None, "type": "KeyboardInterrupt", "user_error": True}
    return {"message": f"{type(exc).__name__}: {exc}", "hint": None, "type": type(exc).__name__, "user_error": False}


def event_fields(exc: BaseException) -> dict[str, Any]:
    """The fields of a run's ``error`` event for ``exc``: ``message`` (with the hint on its next line:
    the text the CLI prints), ``type``, ``user_error``."""
    f = error_fields(exc)
    return {"message": error_text(f), "type": f["type"], "user_error": f["user_error"]}


def error_message(exc: BaseException, **fields: Any) -> dict[str, Any]:
    """The ``error`` message for ``exc`` (:func:`error_fields`), with ``fields`` (e.g. the request's ``id``)."""
    return message("error", **fields, **error_fields(exc))


def error_text(msg: dict[str, Any]) -> str:
    """An ``error`` message as one text: its message, then its hint on the next line (as the CLI prints them)."""
    return msg.get("message", "") + (f"\n{msg['hint']}" if msg.get("hint") else "")


def error_of(msg: dict[str, Any]) -> Exception:
    """In the caller: the error the worker's ``error`` message reports, a :class:`UserError` with its message
    and hint (an :class:`~finetuner.errors.OutOfMemory` as such, a full disk as a :class:`DiskFull` that says
    how much is free now), or a :class:`RuntimeError` (a bug in the worker)."""
    if msg.get("disk_full"):
        return DiskFull(**msg["disk_full"])
    if msg.get("user_error"):
        kind = OutOfMemory if msg.get("type") == OutOfMemory.__name__ else UserError
        return kind(msg.get("message", ""), hint=msg.get("hint"))
    return RuntimeError(msg.get("message", "the worker failed"))


def raise_error(msg: dict[str, Any]) -> NoReturn:
    """In the caller: raise what the worker's ``error`` message reports (:func:`error_of`)."""
    raise error_of(msg)


def encode(msg: dict[str, Any]) -> str:
    """One line of the protocol (ends with a newline)."""
    return json.dumps(msg, ensure_ascii=False, default=str) + "\n"


def decode(line: str | bytes) -> dict[str, Any] | None:
    """The message on ``line``, or None when the line is not one (not JSON, or no known ``kind``)."""
    try:
        msg = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return msg if isinstance(msg, dict) and msg.get("kind") in KINDS else None


# --------------------------------------------------------------------------- the worker's side
class Sender:
    """Writes protocol messages to a text stream, a line each, flushed at once."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self._lock = threading.Lock()

    def send(self, kind: str, **fields: Any) -> None:
        line = encode(message(kind, **fields))
        with self._lock:
            self.stream.write(line)
            self.stream.flush()

    def error(self, exc: BaseException, **fields: Any) -> None:
        """Report ``exc`` (:func:`error_message`)."""
        self.send("error", **fields, **error_fields(exc))


def take_stdout() -> Sender:
    """In a worker process: a :class:`Sender` on the real stdout, and ``sys.stdout`` pointed at stderr, so
    that what libraries print cannot corrupt the protocol stream."""
    out = sys.stdout
    sys.stdout = sys.stderr
    return Sender(out)


def report_failure(exc: BaseException, path: str | Path | None) -> bool:
    """Append the ``error`` message for ``exc`` to the report file ``path`` (a training job's,
    :data:`REPORT_ENV`); nothing without a path. Returns whether it was written (a full disk is no
    reason to hide the error being reported: it is then only printed)."""
    if not path:
        return False
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(encode(error_message(exc)))
    except OSError:
        return False
    return True


def read_report(path: str | Path) -> list[dict[str, Any]]:
    """The complete messages in a report file (none when there is no file)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [m for line in f if line.endswith("\n") and (m := decode(line)) is not None]
    except OSError:
        return []


# --------------------------------------------------------------------------- the caller's side
class Receiver:
    """Reads a worker's messages from a stream (its stdout) in a thread of its own; :meth:`get` takes
    them in order, None once the stream has ended (the worker exited). Lines that are not messages are
    skipped."""

    def __init__(self, stream: IO[str]):
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                msg = decode(line)
                if msg is not None:
                    self._q.put(msg)
        except (OSError, ValueError):  # the stream was closed under the reader
            pass
        self._q.put(None)

    def get(self, timeout: float) -> dict[str, Any] | None:
        """The next message; None when the worker's stream ended. Raises :class:`queue.Empty` after
        ``timeout`` seconds without one."""
        return self._q.get(timeout=timeout)


def last_message(output: str) -> dict[str, Any] | None:
    """The last protocol message in a finished worker's whole output (its stdout), or None."""
    msgs = [m for line in output.splitlines() if (m := decode(line)) is not None]
    return msgs[-1] if msgs else None

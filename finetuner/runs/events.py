"""The run's structured progress stream, ``events.jsonl``: writing it, reading it, following it.

One JSON object per line, appended and flushed as it happens, so any process (the CLI's
progress bar, the web UI, a notebook) can follow a run without scraping logs. The kinds of event
and their fields, and the states of a run, are defined in :mod:`finetuner.runs.schema` and
described in ``docs/events.md``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import finetuner.device as dev
from finetuner.runs.schema import SCHEMA_VERSION, EventSchemaError, RunStateTracker, clean_value, validate_event

log = logging.getLogger(__name__)

Callback = Callable[[dict[str, Any]], None]

#: Set to 1 (the test suite does) and an event that breaks the schema raises instead of being written with a warning.
STRICT_ENV = "FINETUNER_STRICT_EVENTS"


def strict_events() -> bool:
    """Whether event writers raise on an event that breaks the schema (``FINETUNER_STRICT_EVENTS=1``)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


class EventWriter:
    """Appends events to ``events.jsonl`` and hands each to the callbacks.

    Every event is checked against :mod:`finetuner.runs.schema` (``start`` gets ``schema_version``).
    An unknown kind, a missing field or a value of the wrong type is a bug in the writer: with
    ``strict`` (default: :func:`strict_events`) it raises :class:`EventSchemaError`, as do fields
    the schema does not list; otherwise the event is written anyway and a warning logged once per
    kind, so a user's run never fails over its progress stream.
    """

    def __init__(self, path: Path, callbacks: list[Callback] | None = None, strict: bool | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut_short = _ends_mid_line(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        if cut_short:  # a process killed while writing left half a line: end it, so it stays one bad line
            self._f.write("\n")
        self.callbacks = list(callbacks or [])
        self.strict = strict_events() if strict is None else strict
        self._warned: set[str] = set()
        #: a phase's heartbeat (:mod:`finetuner.phases`) writes from its own thread: one line at a time
        self._lock = threading.Lock()
        #: fault injection (:mod:`finetuner.training.faults`): called with each record once half its line is on disk
        self.midway: Callable[[dict[str, Any]], Any] | None = None

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            return self._emit(event, fields)

    def _emit(self, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        if event == "start":
            fields = {"schema_version": SCHEMA_VERSION, **fields}
        record = {"event": event, "time": round(time.time(), 3), **{k: clean_value(v) for k, v in fields.items()}}
        problems = validate_event(record, allow_extra=not self.strict)
        if problems:
            if self.strict:
                raise EventSchemaError("; ".join(problems))
            if event not in self._warned:
                self._warned.add(event)
                log.warning("Event %r does not follow the events schema: %s", event, "; ".join(problems))
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        if self.midway is not None:
            self._f.write(line[: len(line) // 2])
            self._f.flush()
            os.fsync(self._f.fileno())
            self.midway(record)
            line = line[len(line) // 2 :]
        self._f.write(line)
        self._f.flush()
        os.fsync(self._f.fileno())
        for cb in self.callbacks:
            cb(record)
        return record

    def error(self, exc: BaseException) -> dict[str, Any]:
        """Write the ``error`` event for ``exc``: its message as the CLI prints it (hint included), its
        class, and whether the user's input or machine is at fault (:func:`~finetuner.worker_protocol.error_fields`)."""
        from finetuner.worker_protocol import event_fields

        f = event_fields(exc)
        return self.emit("error", message=f["message"], type=f["type"], user_error=f["user_error"])

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _ends_mid_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def read_events(path: Path) -> list[dict[str, Any]]:
    """All complete events in a file; a partly written last line is ignored."""
    return list(iter_events(path))


def iter_events(path: Path) -> Iterator[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return


def run_folder_busy(run_dir: Path) -> bool:
    """Whether a process holds the run folder's lock (see :class:`finetuner.runs.folder.RunLock`)."""
    import fcntl

    try:
        fd = os.open(Path(run_dir) / ".lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the descriptor also drops a shared lock just taken
    return False


def run_folder_holder(run_dir: Path) -> int | None:
    """The pid of the process that holds the run folder's lock (it writes it there), or None if none does."""
    if not run_folder_busy(run_dir):
        return None
    try:
        return int((Path(run_dir) / ".lock").read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None


def follow(
    run_dir: str | Path,
    poll: float = 0.5,
    timeout: float | None = None,
    *,
    offset: int = 0,
    stop: threading.Event | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield a run's events as they are written, from the first one (e.g. in a second notebook cell).

    Waits for ``events.jsonl`` to appear (``run_dir`` may also be the file itself), yields every
    complete line as it is appended, and ends once the run has finished: a terminal event
    (:data:`~finetuner.runs.schema.TERMINAL_EVENTS`) has been read and no process holds the run
    folder any more (so the ``samples`` written after ``done`` are not missed). With ``timeout``, it
    also ends after that many seconds without a new event; with ``stop``, once that is set (after
    reading what has been written by then). ``offset``: the byte position to start reading at.

    Example::

        >>> for ev in finetuner.follow("runs/demo_cpu"):      # doctest: +SKIP
        ...     if ev["event"] == "step":
        ...         print(ev["step"], ev["loss"])
    """
    run_dir = Path(run_dir)
    path = run_dir if run_dir.suffix == ".jsonl" else run_dir / "events.jsonl"
    run_dir = path.parent
    buf = b""
    tracker = RunStateTracker()
    last_new = time.monotonic()
    while True:
        stopping = stop is not None and stop.is_set()  # read once more after it is set, then end
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        if chunk:
            offset += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(ev, dict):
                    continue
                last_new = time.monotonic()
                tracker.feed(ev)
                yield ev
        if stopping:
            return
        if tracker.ended and not buf and not run_folder_busy(run_dir):
            return
        if timeout is not None and time.monotonic() - last_new > timeout:
            return
        if stop is not None:
            stop.wait(poll)
        else:
            time.sleep(poll)


def device_memory(device: str) -> dict[str, int]:
    """Memory now, in bytes: the CUDA caching allocator's counters, or the process RSS on CPU."""
    if dev.platform_of(device).allocator_counters:
        return {f"mem_{k}": v for k, v in dev.memory_stats(device).items()}
    import resource

    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mem_allocated": int(rss), "mem_reserved": int(rss), "mem_peak": int(max(peak, rss))}

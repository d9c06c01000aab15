"""The run's structured progress stream, ``events.jsonl``.

One JSON object per line, appended and flushed as it happens, so any process (the CLI's
progress bar, the web UI, a notebook) can follow a run without scraping logs. Every event has
``event`` and ``time`` (Unix seconds). The kinds and their fields:

- ``start``: run_dir, resumed_from_step, max_steps, device, dtypes, trainable/total params, data stats
- ``step``: step, max_steps, epoch, loss, lr, grad_norm, tokens, tokens_per_s, elapsed_s, eta_s,
  mem_allocated, mem_reserved, mem_peak (bytes; on CPU the process RSS and its peak)
- ``eval``: step, eval_loss, eval_ppl
- ``checkpoint``: step, path
- ``stopped``: step (a stop was requested; a checkpoint was saved)
- ``done``: step, final metrics, adapter path
- ``error``: message, type, user_error
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Callback = Callable[[dict[str, Any]], None]


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


class EventWriter:
    """Appends events to ``events.jsonl`` and hands each to the callbacks."""

    def __init__(self, path: Path, callbacks: list[Callback] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self.callbacks = list(callbacks or [])

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": round(time.time(), 3), **{k: _clean(v) for k, v in fields.items()}}
        self._f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        for cb in self.callbacks:
            cb(record)
        return record

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


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


#: Events after which a run's process writes nothing more (once it has let go of the run folder).
END_EVENTS = ("done", "stopped", "error")


def run_folder_busy(run_dir: Path) -> bool:
    """Whether a process holds the run folder's lock (see :class:`finetuner.runs.folder.RunLock`)."""
    import fcntl

    try:
        fd = os.open(run_dir / ".lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the descriptor also drops a shared lock just taken
    return False


def follow(run_dir: str | Path, poll: float = 0.5, timeout: float | None = None) -> Iterator[dict[str, Any]]:
    """Yield a run's events as they are written, from the first one (e.g. in a second notebook cell).

    Waits for ``events.jsonl`` to appear, yields every complete line, and ends once the run has
    finished: an end event (``done``, ``stopped``, ``error``) has been read and no process holds
    the run folder any more (so the ``samples`` written after ``done`` are not missed). With
    ``timeout``, it also ends after that many seconds without a new event.

    Example::

        >>> for ev in finetuner.follow("runs/demo_cpu"):      # doctest: +SKIP
        ...     if ev["event"] == "step":
        ...         print(ev["step"], ev["loss"])
    """
    run_dir = Path(run_dir)
    path = run_dir if run_dir.suffix == ".jsonl" else run_dir / "events.jsonl"
    run_dir = path.parent
    offset, buf, ended = 0, b"", False
    last_new = time.monotonic()
    while True:
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
                last_new = time.monotonic()
                if ev.get("event") in END_EVENTS:
                    ended = True
                elif ev.get("event") == "start":  # a resumed run goes on
                    ended = False
                yield ev
        if ended and not buf and not run_folder_busy(run_dir):
            return
        if timeout is not None and time.monotonic() - last_new > timeout:
            return
        time.sleep(poll)


def device_memory(device: str) -> dict[str, int]:
    """Memory now, in bytes: the CUDA caching allocator's counters, or the process RSS on CPU."""
    if device.startswith("cuda"):
        import torch

        return {
            "mem_allocated": int(torch.cuda.memory_allocated(device)),
            "mem_reserved": int(torch.cuda.memory_reserved(device)),
            "mem_peak": int(torch.cuda.max_memory_allocated(device)),
        }
    import resource

    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mem_allocated": int(rss), "mem_reserved": int(rss), "mem_peak": int(max(peak, rss))}

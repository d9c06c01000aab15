"""The ranks' output, as the launcher of a multi-process run keeps it: torchrun's standard output and error
(every rank's), read from a pipe, written to ``<run>/distributed/launch.log``, and the ranks' failure reports
picked out of it.

torchrun writes to the launcher, not into the file itself, because the file is on the run folder's disk, which
may be full: a rank that printed to a file there would fail at its next line (and its report of why the run
stopped would be lost), and the log would end where the disk filled up. Through the pipe the ranks never meet
the disk; the launcher writes each line to the log, and when the run folder's disk refuses it, goes on in a
folder of its own under the system's temporary folder (:func:`tempfile.mkdtemp`: only this user can enter
it; it is kept, and :attr:`RankOutput.moved` says where it is). The last lines stay in memory in any case,
to be shown on the console when no file could take them.

A rank reports its failure as one line of :mod:`finetuner.worker_protocol` (an ``error`` message with
its ``rank``, :func:`report_failure`): the launcher reads it here, so the rank's own message reaches the user
whether or not rank 0 could write the run's ``error`` event.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import finetuner.worker_protocol as protocol


#: lines of the ranks' output kept in memory, for the console
TAIL_LINES = 30
#: how long the launcher waits, after torchrun has ended, for the rest of the ranks' output (a process that
#: inherited the pipe and outlives torchrun would keep it open for ever)
DRAIN_S = 10.0


def report_failure(error: BaseException, rank: int) -> None:
    """In a rank: report ``error`` to the launcher as one protocol line on standard output (one ``write``: a
    line under the pipe's atomic size, 4 KiB, never mixes with another rank's). A launcher already gone is
    no reason to hide the error itself."""
    try:
        protocol.Sender(sys.stdout).error(error, rank=rank)
    except (OSError, ValueError):
        pass


class RankOutput:
    """Reads the ranks' output from ``stream`` in a thread of its own (:meth:`start`), until it ends."""

    def __init__(self, log_path: Path):
        self.log_path = Path(log_path)
        #: where the log went on when the run folder's disk refused it (None while it did not, or if no file took it)
        self.moved: Path | None = None
        #: whether some of the output could not be written to any file (it is in :attr:`tail` only)
        self.lost = False
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        #: the ranks' ``error`` messages (:func:`report_failure`), in the order they came
        self.reports: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        try:
            self._fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError:  # not even an empty file fits there
            self._move()

    def start(self, stream: IO[bytes]) -> None:
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def join(self, timeout: float = DRAIN_S) -> None:
        """Wait for the end of the output (``timeout`` at most: after it, what comes is still written, and the
        log closed at its end, but not waited for)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                self.tail.append(line.rstrip("\n"))
                msg = protocol.decode(line)
                if msg is not None and msg["kind"] == "error":
                    self.reports.append(msg)
                self._write(raw)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _write(self, data: bytes) -> None:
        while data and self._fd is not None:
            try:
                data = data[os.write(self._fd, data):]
            except OSError:  # the disk is full (or gone): go on somewhere else, with the rest of this line
                self._move()

    def _move(self) -> None:
        """Go on writing the log in a folder of its own under the temporary folder, or, if that cannot be
        written either, in memory only (:attr:`tail`)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.moved is not None:  # the temporary folder's disk is full too
            self.lost = True
            return
        try:
            self.moved = Path(tempfile.mkdtemp(prefix="finetuner-launch-")) / self.log_path.name
            self._fd = os.open(self.moved, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(self._fd, f"(the start of this log is in {self.log_path}, whose disk was full from here on)\n".encode())
        except OSError:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self.lost = True

    def where(self) -> str:
        """Where the ranks' output is, for the user: the file, and its last lines."""
        return (self.note() or f"The output of every rank is in {self.log_path}.") + " Its end:\n" + "\n".join(self.tail)

    def note(self) -> str | None:
        """Where the ranks' output went when the run folder's disk refused it; None while it did not."""
        if self.lost:
            return (f"The ranks' output could not all be written: the disk of {self.log_path} is full"
                    f"{' and so is that of ' + str(self.moved) if self.moved else ', and no temporary folder could be made'}.")
        if self.moved is not None:
            return f"The ranks' output is in {self.log_path} up to where its disk was full, then in {self.moved}."
        return None

    def report(self) -> dict[str, Any] | None:
        """The ranks' report of why the run stopped: a user error (the input or the machine, a full disk) before
        a bug, which can follow from it (a rank that lost its peer), and the lowest rank's of those."""
        if not self.reports:
            return None
        return min(self.reports, key=lambda m: (not m.get("user_error"), m.get("rank", 0)))

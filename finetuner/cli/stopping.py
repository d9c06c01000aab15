"""Stop signals for commands that write one output and end (``merge``, ``export``, the export worker): SIGTERM
(``kill``, a service manager, a container's stop) is taken as Ctrl-C is, an exception raised where the process
is, so that the write's own clean-up runs (its staging files and folders removed) before the process exits with
the usual one line (``aborted.``, 128 + the signal's number). Python's default for SIGTERM ends the process at
once, leaving a half-written staging folder (gigabytes on a real model) behind.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

#: the signals that stop such a command
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM) that aborts the command. The process exits with the shell's
    status for the first signal it got, 128 + its number: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_signals_abort() -> Iterator[None]:
    """For the block: the first SIGINT or SIGTERM raises :class:`Interrupted` in the main thread; any later one
    is ignored, so that it cannot cut the clean-up the first one started short. The handlers before it are put
    back after the block."""
    got: list[int] = []

    def _on_signal(signum, _frame):
        if got:  # already stopping: the clean-up runs
            return
        got.append(signum)
        raise Interrupted(signum)

    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, _on_signal)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)

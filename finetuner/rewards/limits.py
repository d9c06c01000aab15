"""Limits around one call of a reward function: a time limit (``grpo.reward_timeout_s``) and the run's stop.

A reward function is the user's code: it may wait on a server that never answers. Python cannot stop a thread,
so the call runs in the training process's main thread under a repeating ``SIGALRM`` timer (every
:data:`POLL_S`) whose handler raises into the function when its time is up (:class:`RewardTimedOut`) or the run
was asked to stop (:class:`RewardStopped`: the first Ctrl-C, the web UI's Stop). Both derive from
``BaseException``, so a function's own ``except Exception`` does not swallow them. Python runs a signal handler
between bytecodes, also while ``time.sleep`` or a socket waits (PEP 475); a call stuck inside C code that never
returns to the interpreter is beyond it. Off the main thread (a notebook's worker thread), or where the platform
has no ``setitimer``, the call runs without these limits. The timer that was set before (pytest-timeout's, say)
is put back, less the time the call took.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator

#: seconds between two looks at the clock and the stop request while a reward function runs
POLL_S = 0.2


class RewardTimedOut(BaseException):
    """A reward function's call ran past its time limit (raised into the function)."""


class RewardStopped(BaseException):
    """The run was asked to stop while a reward function ran: the step is abandoned, the run stops after the
    checkpoint of its last finished step (raised into the function)."""


@contextlib.contextmanager
def reward_limits(timeout_s: float | None, stop: Callable[[], bool] | None) -> Iterator[None]:
    """Run the body under the time limit ``timeout_s`` (None: none) and the stop request ``stop()``."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or (timeout_s is None and stop is None):
        yield
        return
    began = time.monotonic()
    deadline = began + timeout_s if timeout_s is not None else None

    def on_alarm(_signum, _frame):
        if stop is not None and stop():
            raise RewardStopped()
        if deadline is not None and time.monotonic() >= deadline:
            raise RewardTimedOut()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, POLL_S, POLL_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - began), 1e-3), old_interval)

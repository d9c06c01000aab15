"""The command line of every Python process finetuner starts: a module run so that the working folder is never
on ``sys.path``.

``python -m MODULE`` puts the working folder first on ``sys.path``. The web UI started and resumed a job inside
its run folder (now in finetuner's own working folder, :mod:`finetuner.workdir`), and a user may run ``finetuner``
inside a folder they received: a ``yaml.py`` or ``torch/``
planted there would be imported instead of the library, and run, without any opt-in (issue 35). Python 3.11's
``-P`` leaves it off (and ``PYTHONSAFEPATH``, set in :func:`safe_env`, does the same for the processes those
start: torchrun's workers, datasets' tokenization pool). On Python 3.10, which has neither, the module is run by
a two-line bootstrap that removes the working folder from ``sys.path`` before it imports anything.

And how a command that writes one output and ends (``merge``, ``export``, the export worker the web UI starts)
takes a stop: :func:`stop_signals_abort` makes SIGTERM (``kill``, a service manager, a container's stop) what
Ctrl-C is, an exception raised where the process is, so that the write's own clean-up runs (its staging files and
folders removed) before the process exits with the usual one line (``aborted.``, 128 + the signal's number).
Python's default for SIGTERM ends the process at once, leaving a half-written staging folder (gigabytes on a real
model) behind.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Mapping

#: Python 3.11 and later know ``-P`` and ``PYTHONSAFEPATH``
HAS_SAFE_PATH = sys.version_info >= (3, 11)
#: ``python -c`` puts '' (the working folder) at sys.path[0]: removed before the module (argv[1]) is imported
BOOTSTRAP = "import sys; del sys.path[0]; m = sys.argv.pop(1); import runpy; runpy.run_module(m, run_name='__main__', alter_sys=True)"


def module_args(module: str, *args: str, unbuffered: bool = False, safe_path: bool = HAS_SAFE_PATH) -> list[str]:
    """The interpreter's arguments that run ``module`` with ``args``, the working folder off ``sys.path``."""
    flags = ["-u"] if unbuffered else []
    if safe_path:
        return [*flags, "-P", "-m", module, *args]
    return [*flags, "-c", BOOTSTRAP, module, *args]


#: The command that stands for ``python`` in the Python processes finetuner starts (web UI jobs, the ranks of a
#: multi-process run, chat and export workers; split as a shell splits it). Default: this interpreter. A wrapper
#: command may go here, which must run a Python interpreter with the arguments that follow it; finetuner's tests
#: fork those processes from one that has imported torch already (tests/zygote_child.py).
PYTHON_ENV = "FINETUNER_PYTHON"


def python_command() -> list[str]:
    """``$FINETUNER_PYTHON`` (:data:`PYTHON_ENV`) split into words, or ``[sys.executable]``."""
    return shlex.split(os.environ.get(PYTHON_ENV, "")) or [sys.executable]


def module_command(module: str, *args: str, unbuffered: bool = False) -> list[str]:
    """:func:`python_command` (this interpreter) with :func:`module_args`."""
    return [*python_command(), *module_args(module, *args, unbuffered=unbuffered)]


def safe_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``PYTHONSAFEPATH=1``, for the Python processes a child starts."""
    return {**(os.environ if env is None else env), "PYTHONSAFEPATH": "1"}


def stop_signals_as_in_a_terminal() -> None:
    """In a child before exec (``preexec_fn``: training/launch.py's torchrun launcher): Ctrl-C (SIGINT) as in a
    terminal, Python's KeyboardInterrupt. :func:`spawn_job` does the same without Python code in the child,
    which a process with threads needs (see there)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Spawned:
    """A process :func:`spawn_job` started: ``pid``, and ``poll()`` / ``returncode`` as :class:`subprocess.Popen`'s."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it has ended, how is not known
                self.returncode = -1
                return self.returncode
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def spawn_job(cmd: list[str], cwd: str, env: Mapping[str, str], out_fd: int) -> Spawned:
    """Start ``cmd`` in ``cwd`` in a new session, standard input empty, output and errors to ``out_fd``, with
    Ctrl-C (SIGINT) as in a terminal.

    A process that a non-interactive shell starts in the background (``finetuner ui &`` in a script, CI's
    runners) ignores SIGINT, and every process it starts inherits that: a job asked to stop while it is still
    importing, before it installs its own handler, would never hear it and train on. ``posix_spawn`` resets it
    in the child without running Python code there (a ``preexec_fn`` is not safe in a process with threads,
    such as the web UI's server: a job started from it crashed between fork and exec). ``/bin/sh`` changes to
    ``cwd`` (``posix_spawn`` cannot) and becomes ``cmd`` (``exec``: the same process id).
    """
    argv = ["/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", cwd, *cmd]
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, out_fd, 1),
               (os.POSIX_SPAWN_DUP2, out_fd, 2)]
    return Spawned(os.posix_spawn("/bin/sh", argv, dict(env), file_actions=actions, setsid=True,
                                  setsigdef=(signal.SIGINT,)))


#: the signals that stop a command under :func:`stop_signals_abort`
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

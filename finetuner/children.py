"""The command line of every Python process finetuner starts: a module run so that the working folder is never
on ``sys.path``.

``python -m MODULE`` puts the working folder first on ``sys.path``. The web UI starts and resumes a job inside
its run folder, and a user may run ``finetuner`` inside a folder they received: a ``yaml.py`` or ``torch/``
planted there would be imported instead of the library, and run, without any opt-in (issue 35). Python 3.11's
``-P`` leaves it off (and ``PYTHONSAFEPATH``, set in :func:`safe_env`, does the same for the processes those
start: torchrun's workers, datasets' tokenization pool). On Python 3.10, which has neither, the module is run by
a two-line bootstrap that removes the working folder from ``sys.path`` before it imports anything.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

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


def module_command(module: str, *args: str, unbuffered: bool = False) -> list[str]:
    """``[sys.executable, ...]``: :func:`module_args` run by this interpreter."""
    return [sys.executable, *module_args(module, *args, unbuffered=unbuffered)]


def safe_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``PYTHONSAFEPATH=1``, for the Python processes a child starts."""
    return {**(os.environ if env is None else env), "PYTHONSAFEPATH": "1"}


def stop_signals_as_in_a_terminal() -> None:
    """In a child before exec (``preexec_fn``): Ctrl-C (SIGINT) as in a terminal, Python's KeyboardInterrupt.

    A process that a non-interactive shell starts in the background (``finetuner ui &`` in a script, CI's
    runners) ignores SIGINT, and every process it starts inherits that. A job asked to stop while it is still
    importing, before it installs its own handler, would then never hear it and train on.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)

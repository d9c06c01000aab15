"""Where a message will be read: on the command line (``cli``, the default) or in the web UI (``ui``).

A message that tells the user what to do names the controls of the place it is read in: ``-o`` and
``--overwrite`` on the command line, the "Output folder" box and the "overwrite" checkbox in the web
UI. The code that raises a :class:`~finetuner.errors.UserError` (or writes a plan's reason) words it
once for each surface with :func:`say`; the caller says where its messages are shown with
:func:`shown_in` (the web UI's handlers do). A worker process started by the UI inherits the
surface through :data:`ENV` (:func:`child_env`).

>>> say(cli="pass --overwrite", ui="tick “overwrite”")
'pass --overwrite'
>>> with shown_in("ui"):
...     say(cli="pass --overwrite", ui="tick “overwrite”")
'tick “overwrite”'
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

SURFACES = ("cli", "ui")
#: the environment variable that carries the surface into a worker process
ENV = "FINETUNER_SURFACE"

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("finetuner_surface", default=None)


def current() -> str:
    """The surface messages are worded for now: the innermost :func:`shown_in`, else :data:`ENV`, else ``cli``."""
    value = _current.get() or os.environ.get(ENV, "")
    return value if value in SURFACES else "cli"


@contextlib.contextmanager
def shown_in(surface: str) -> Iterator[None]:
    """Word the messages raised inside this block for ``surface`` (``cli`` or ``ui``)."""
    if surface not in SURFACES:
        raise ValueError(f"surface {surface!r}: one of {', '.join(SURFACES)}")
    token = _current.set(surface)
    try:
        yield
    finally:
        _current.reset(token)


def say(*, cli: str, ui: str) -> str:
    """The wording for the surface the message will be read on (:func:`current`)."""
    return ui if current() == "ui" else cli


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with :data:`ENV` set to :func:`current`, for a
    worker process whose messages are shown where this one's are."""
    return {**(os.environ if env is None else env), ENV: current()}

"""User-facing errors.

A :class:`UserError` is a mistake the user can fix (a bad recipe key, a malformed data row,
a missing file). The CLI prints its message without a traceback and exits non-zero;
anything else is a bug and shows a traceback with ``--debug``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """An error caused by the user's input, with a message that says what to do."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if not hint else f"{message}\n{hint}")


class OutOfMemory(UserError):
    """Training could not fit on the device even after backing off."""

    exit_code = 3


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The closest valid spelling of ``word`` among ``choices``, if any is close enough."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ``" Did you mean 'x'?"`` suffix, or a list of valid choices when nothing is close."""
    choices = sorted(set(choices))
    best = closest(word, choices)
    if best:
        return f" Did you mean '{best}'?"
    return f" Valid choices: {', '.join(choices)}."


def interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (``KeyboardInterrupt``) that ``error`` was raised while handling, if any: a library's
    clean-up can replace it with an error of its own (``datasets.map`` with worker processes raises
    a ``TimeoutError`` from its ``finally``), which must still stop the program as a Ctrl-C does."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def first_line(text: str, limit: int = 200) -> str:
    """The first line of a library's error text, at most ``limit`` characters, cut between words
    (with "…") and never inside one."""
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:") + "…"

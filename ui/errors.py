"""Errors as text on the page, where they happen: what is wrong and what to do (a
:class:`~finetuner.errors.UserError`'s message and hint, as the library raised them)."""

from __future__ import annotations

import contextlib
import functools
import html
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from finetuner.data.scope import within
from finetuner.errors import UserError
from finetuner.surface import shown_in
from ui import warm


def error_md(e: Exception) -> str:
    """An error as a block of text on the page: what is wrong and what to do."""
    if isinstance(e, UserError):
        hint = e.hint_for("ui")  # settings as the UI takes them, never a command-line flag
        text = e.message + (f"\n{hint}" if hint else "")
    elif isinstance(e, gr.Error):
        text = str(e.message)
    else:
        text = f"Unexpected error: {type(e).__name__}: {e}"
    return f'<div class="ft-error" role="alert">✕ {html.escape(text, quote=False)}</div>'


@contextlib.contextmanager
def on_page(owner: Any = None) -> Iterator[None]:
    """What a handler of ``owner`` (a :class:`ui.handlers.Handlers`) runs in: messages worded for the web UI
    (:func:`finetuner.surface.shown_in`), and files read only within the owner's ``scope`` when it has one
    (:func:`finetuner.data.scope.within`: a UI that serves other machines), once the imports the launch began in
    the background are done (:func:`ui.warm.wait`)."""
    warm.wait()
    with shown_in("ui"), within(getattr(owner, "scope", None)):
        yield


def steps_in_ui(gen: Iterator, owner: Any = None) -> Iterator:
    """The items of a handler's generator, each step run :func:`on_page` of ``owner``: gradio may resume a
    generator in another thread or context, so the surface and scope are set for each step, not once around
    the loop."""
    while True:
        with on_page(owner):
            try:
                item = next(gen)
            except StopIteration:
                return
        yield item


def shows_errors(status: int, outputs: int) -> Callable[[Callable], Callable]:
    """A handler whose errors are shown as text in its output number ``status`` (of ``outputs``),
    the other outputs keeping what they showed: the reason is on the page (a raised error would
    turn every output into a bare "Error" badge, and its toast goes away). Engine errors become a
    message, never a traceback. The handler (a method: its first argument is its owner) runs
    :func:`on_page`: the library words its messages for the web UI (they name the page's controls,
    not the CLI's options) and reads files only within the owner's scope."""

    def failed(e: Exception):
        if outputs == 1:
            return error_md(e)
        out = [gr.skip()] * outputs
        out[status] = error_md(e)
        return tuple(out)

    def wrap(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen_wrapper(*args, **kwargs):
                try:
                    yield from steps_in_ui(fn(*args, **kwargs), args[0] if args else None)
                except Exception as e:  # noqa: BLE001
                    yield failed(e)

            return gen_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                with on_page(args[0] if args else None):
                    return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                return failed(e)

        return wrapper

    return wrap

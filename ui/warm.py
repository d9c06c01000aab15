"""Transformers' auto classes imported once, in the background, while ``finetuner ui`` already serves: the address
is printed as soon as the server listens, and the page's first handlers wait here until the imports are done
(:func:`wait`, called by :func:`ui.errors.on_page`, which every handler that reads a model runs in).

Why they are imported once, before any handler imports them: transformers resolves its names lazily, and without
this the first page of a server whose last run is a picture run left every later ``from transformers import
AutoConfig`` in the server failing ("cannot import name 'AutoConfig' from 'transformers'", the model card shown as
an error; tests/ui/test_ui_browser.py's pictures test, 2 of 2 without this, 0 of 4 with it)."""

from __future__ import annotations

import threading

_done = threading.Event()
_started = False
_lock = threading.Lock()


def warm_imports() -> None:
    """Import transformers' auto classes (the modules the handlers' first imports reach)."""
    import transformers
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,  # noqa: F401
                              AutoTokenizer)

    for module in ("configuration_auto", "modeling_auto", "processing_auto", "image_processing_auto", "tokenization_auto"):
        __import__(f"transformers.models.auto.{module}")
    del transformers


def _run() -> None:
    try:
        warm_imports()
    finally:  # a failed import is the handler's own to report, when it imports it again
        _done.set()


def start() -> None:
    """Start the imports in a thread of their own (once per process)."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    threading.Thread(target=_run, name="finetuner-ui-warm-imports", daemon=True).start()


def wait() -> None:
    """Return once the imports :func:`start` began are done (at once when none were started: the UI built without
    :func:`ui.app.launch`, as the tests' in-process clients do)."""
    if _started:
        _done.wait()

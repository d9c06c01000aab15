"""The finetuner web UI: model → data → plan → train → chat → export, in that order.

Thin by design: every action calls finetuner's Python API (:mod:`ui.handlers`) and shows its
``UserError`` where it happened. Training, chat and merging run in processes of their own; the
Train tab follows the run's ``events.jsonl``, so closing or reloading the page loses nothing, and
what it shows comes from disk, not from the browser session.

``build_app(runs_dir=...)`` returns the ``gr.Blocks`` (:mod:`ui.layout` builds the page,
:mod:`ui.handlers` holds what each control does); :func:`launch` serves it (``finetuner ui``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gradio as gr

from ui.handlers import Handlers
from ui.layout import build_blocks
from ui.style import CSS, JS


def build_app(runs_dir: str | Path | None = None, upload_dir: str | Path | None = None) -> gr.Blocks:
    """The app. ``runs_dir``: where runs and the job registry live (default ``runs/`` of the
    checkout); ``upload_dir``: where uploaded data files are stored (default ``data/uploads/``)."""
    handlers = Handlers(runs_dir, upload_dir)
    app = build_blocks(handlers)
    app.handlers = handlers  # for tests
    app.chat_pool = handlers.chat_pool  # for tests and shutdown
    app.runs_dir = handlers.runs
    return app


def launch(
    runs_dir: str | Path | None = None,
    upload_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 7860,
    auth: tuple[str, str] | None = None,
    block: bool = True,
    quiet: bool = False,
) -> gr.Blocks:
    """Build and serve the app (``finetuner ui``); with ``block=False`` return once it serves."""
    app = build_app(runs_dir, upload_dir)
    theme = gr.themes.Soft(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate")
    app.queue(default_concurrency_limit=8)
    app.launch(
        server_name=host, server_port=port, auth=auth, prevent_thread_lock=not block, quiet=quiet,
        theme=theme, css=CSS, js=JS, show_error=True, footer_links=[], ssr_mode=False,
        allowed_paths=[str(Path(tempfile.gettempdir()) / "finetuner-ui")],
    )
    return app

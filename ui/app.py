"""The finetuner web UI: model → data → plan → train → chat → export, in that order.

Thin by design: every action calls finetuner's Python API (:mod:`ui.handlers`) and shows its
``UserError`` where it happened. Training, chat and merging run in processes of their own; the
Train tab follows the run's ``events.jsonl``, so closing or reloading the page loses nothing, and
what it shows comes from disk, not from the browser session.

``build_app(runs_dir=...)`` returns the ``gr.Blocks`` (:mod:`ui.layout` builds the page,
:mod:`ui.handlers` holds what each control does); :func:`launch` serves it (``finetuner ui``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import gradio as gr

from finetuner.fileio import private_temp_dir
from finetuner.runs import jobs
from ui import warm
from ui.access import Access, GuardedApp, no_forwarded_headers
from ui.handlers import Handlers
from ui.paths import LOOPBACK
from ui.layout import build_blocks
from ui.style import CSS, JS


def build_app(runs_dir: str | Path | None = None, upload_dir: str | Path | None = None,
              max_upload_bytes: int | None = None, data_dirs: list[str | Path] | None = None) -> gr.Blocks:
    """The app. ``runs_dir``: where runs and the job registry live (default ``runs/`` of the
    checkout); ``upload_dir``: where uploaded data files are stored (default ``data/uploads/``);
    ``max_upload_bytes``: the largest upload taken (default :data:`ui.paths.MAX_UPLOAD_BYTES`).
    Each app has a temp folder of its own (``app.temp_dir``, mode 0700), removed with it. ``data_dirs``:
    data files are read only there (and from ``data/``, the uploads and the runs); None: anywhere."""
    handlers = Handlers(runs_dir, upload_dir, max_upload_bytes=max_upload_bytes, data_dirs=data_dirs)
    app = build_blocks(handlers)
    app.handlers = handlers  # for tests
    app.chat_pool = handlers.chat_pool  # for tests and shutdown
    app.runs_dir = handlers.runs
    app.temp_dir = handlers.temp_dir
    return app


#: the GRADIO_TEMP_DIR :func:`private_gradio_cache` set (not one the user set)
_OWN_CACHE: str | None = None


def private_gradio_cache() -> None:
    """Gradio's own file cache (uploads, and the copies of the files the app hands out, which it
    serves) in a private folder of this process (mode 0700) instead of the ``gradio`` folder every
    gradio app on the machine shares and serves; a ``GRADIO_TEMP_DIR`` the user set is kept."""
    global _OWN_CACHE
    if os.environ.get("GRADIO_TEMP_DIR") and os.environ["GRADIO_TEMP_DIR"] != _OWN_CACHE:
        return
    _OWN_CACHE = os.environ["GRADIO_TEMP_DIR"] = str(private_temp_dir("finetuner-ui-gradio-"))


def share_asked_by_env() -> bool:
    """Whether ``GRADIO_SHARE`` asks gradio for a public share link (which :func:`launch` never makes)."""
    return os.environ.get("GRADIO_SHARE", "").strip().lower() in ("true", "1", "yes", "on")


def launch(
    runs_dir: str | Path | None = None,
    upload_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 7860,
    auth: tuple[str, str] | None = None,
    block: bool = True,
    quiet: bool = False,
    max_upload_bytes: int | None = None,
    data_dirs: list[str | Path] | None = None,
    access: Access | None = None,
) -> gr.Blocks:
    """Build and serve the app (``finetuner ui``); with ``block=False`` return once it serves.
    ``data_dirs``: see :func:`build_app`; a host other than this machine's loopback always limits data
    files to those folders (none given: ``data/``, the uploads and the runs), so that whoever reaches
    the page reads no other file of this machine.

    It listens on ``host`` only and never makes a public share link (``share=False`` whatever
    ``GRADIO_SHARE`` says: a warning says it is ignored). The only folder it serves files from is
    its own temp folder (``app.temp_dir``; ``GRADIO_ALLOWED_PATHS`` is not read) and gradio's cache,
    which is private to this process too (:func:`private_gradio_cache`); it takes uploads up to
    ``max_upload_bytes``.

    Who it answers is :class:`ui.access.Access`'s (``access``; default: made here, ``app.access``): without
    ``auth``, only the account that started it (or, where a connection's account cannot be told, a client
    with the launch's token: ``app.access.address(host, port)`` is the address to open); with ``auth``,
    whoever logs in, with wrong passwords rate-limited and nothing of the app shown before the login. It
    takes no static-file workers (``GRADIO_NUM_WORKERS`` is not read: they would serve files outside it)."""
    private_gradio_cache()
    if data_dirs is None and host not in LOOPBACK:
        data_dirs = []
    app = build_app(runs_dir, upload_dir, max_upload_bytes, data_dirs)
    if share_asked_by_env():
        print("warning: GRADIO_SHARE is set; ignored: finetuner ui never makes a public share link "
              f"(it serves on {host}:{port} only).", file=sys.stderr, flush=True)
    theme = gr.themes.Soft(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate")
    app.queue(default_concurrency_limit=8)
    access = access or Access(password=auth is not None)
    if access.password != (auth is not None):
        raise ValueError("launch(access=...): Access(password=True) goes with auth=(USER, PASS), and only with it.")
    access.port = port
    app.access = access
    if block:  # launch returns only when the server stops: the imports begin beside it
        warm.start()
    with no_forwarded_headers():
        app.launch(
            server_name=host, server_port=port, auth=auth, prevent_thread_lock=not block, quiet=quiet,
            theme=theme, css=CSS, js=JS, show_error=True, footer_links=[], ssr_mode=False,
            share=False, mcp_server=False, allowed_paths=[str(app.temp_dir)],
            max_file_size=app.handlers.max_upload_bytes, num_workers=0, _app=GuardedApp(access),
            auth_message=(f"{access.limiter.free} wrong passwords lock a client out for a while, longer each time."
                          if auth is not None else None),
        )
    warm.start()  # once the server listens: the page's handlers wait for it (ui.warm.wait)
    return app


def serve_until_interrupted(app: gr.Blocks) -> str:
    """Serve ``app`` (launched with ``block=False``) until Ctrl-C (SIGINT), then :func:`shutdown` it; returns what
    :func:`shutdown` says. SIGINT stops it even when it was started with SIGINT ignored (as a shell starts a command
    with ``&``: ``kill -INT`` then stops it too)."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while app.is_running:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    return shutdown(app)


def shutdown(app: gr.Blocks) -> str:
    """Stop serving at once, without waiting for the open pages' connections (each page holds one open: a graceful
    stop waited for them), close the chat processes, remove this process's temp folders (the app's and gradio's
    cache), and say what happens to the training jobs: they run in processes of their own and go on; a ``finetuner
    ui`` started again on the runs folder shows them and stops them."""
    import logging
    import shutil

    server = getattr(app, "server", None)
    if server is not None:
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)  # the open pages' requests, cut: not errors
        server.force_exit = True  # uvicorn: do not wait for open connections and their tasks
        server.should_exit = True
    app.chat_pool.close()
    if server is not None:
        server.thread.join(timeout=5)
    for folder in (app.temp_dir, _OWN_CACHE):  # this process's own folders (removed at exit otherwise)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    app.is_running = False
    running = jobs.running_jobs(app.runs_dir)
    if not running:
        return "finetuner UI stopped."
    told = "; ".join(f"{j.name} (pid {j.pid}, its output in {j.log})" for j in running)
    return (f"finetuner UI stopped. Training goes on in its own process: {told}. Run `finetuner ui` again "
            f"(--runs-dir {app.runs_dir}) to follow or stop it.")

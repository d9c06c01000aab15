"""What the two browser tests share: ``finetuner ui`` started as a user starts it, headless
Debian Chromium driven by Playwright, and the small steps a user takes on the page.

Needs ``playwright`` (the ``test`` extra) and ``/usr/bin/chromium`` (scripts/_setup.sh installs
Debian's package); never ``playwright install``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

CHROMIUM = os.environ.get("FINETUNER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage",
]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; scripts/_setup.sh does it)", allow_module_level=True)


def ui_server(tmp_path_factory) -> Iterator[dict]:
    """``finetuner ui`` on a free port with fresh runs and uploads folders, run from outside the
    checkout (paths must not depend on it); yields its url and folders, then stops it and its jobs."""
    runs = tmp_path_factory.mktemp("runs")
    uploads = tmp_path_factory.mktemp("uploads")
    port = free_port()
    log = open(runs.parent / "ui-server.log", "w")
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetuner", "ui", "--port", str(port), "--runs-dir", str(runs), "--upload-dir", str(uploads)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(runs.parent),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"finetuner ui exited: {Path(log.name).read_text()}")
            time.sleep(0.3)
    yield {"url": f"http://127.0.0.1:{port}/", "runs": runs, "uploads": uploads, "proc": proc}
    proc.terminate()
    proc.wait(timeout=20)
    log.close()
    from finetuner.runs import jobs

    for job in jobs.running_jobs(runs):
        jobs.stop_job(job, runs, wait=30)


def browser_page(width: int, height: int) -> Iterator:
    """A page of headless Chromium with a 60 s default timeout."""
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": width, "height": height})
        pg.set_default_timeout(60_000)
        yield pg
        browser.close()


def tab(page, label: str) -> None:
    page.get_by_role("tab", name=label).click()


def pick(page, elem_id: str, value: str) -> None:
    """Choose ``value`` in a gradio dropdown."""
    box = page.locator(f"#{elem_id} input")
    box.click()
    box.fill(value)
    page.get_by_role("option", name=value, exact=True).click()


def type_in(page, elem_id: str, value: str) -> None:
    """Type a value of one's own into a gradio dropdown (one that allows it)."""
    box = page.locator(f"#{elem_id} input")
    box.click()
    box.fill(value)
    box.press("Enter")
    sync_api.expect(box).to_have_value(value)


def wait_text(page, selector: str, pattern: str, timeout: float = 60_000, flags: int = 0) -> str:
    """Wait until ``selector`` contains text matching ``pattern``; returns its text."""
    loc = page.locator(selector)
    sync_api.expect(loc).to_contain_text(re.compile(pattern, flags), timeout=timeout)
    return loc.inner_text()

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

from tests.conftest import free_port, HANG_GUARD_S

#: Playwright counts in milliseconds: the hang guard for a wait on the page (a job starting, training, answering)
HANG_MS = HANG_GUARD_S * 1000
CHROMIUM = os.environ.get("FINETUNER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage",
]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; scripts/_setup.sh does it)", allow_module_level=True)


def ui_server(tmp_path_factory, hold_at: int | None = None) -> Iterator[dict]:
    """``finetuner ui`` on a free port with fresh runs and uploads folders, run from outside the
    checkout (paths must not depend on it); yields its url and folders, then stops it and its jobs.

    With ``hold_at``, every run the server starts holds after that optimizer step while the file
    ``server["hold"]`` exists (``FINETUNER_FAULT=HOLD@N``): create it to see a run mid-way on any
    machine, delete it to let the run go on. It is deleted at the end whatever happened."""
    runs = tmp_path_factory.mktemp("runs")
    uploads = tmp_path_factory.mktemp("uploads")
    hold = runs.parent / "hold-gate"
    port = free_port()
    log = open(runs.parent / "ui-server.log", "w")
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if hold_at is not None:
        env.update(FINETUNER_FAULT=f"HOLD@{hold_at}", FINETUNER_HOLD_FILE=str(hold))
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetuner", "ui", "--port", str(port), "--runs-dir", str(runs), "--upload-dir", str(uploads)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(runs.parent),
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"finetuner ui exited: {Path(log.name).read_text()}")
            time.sleep(0.3)
    try:
        yield {"url": f"http://127.0.0.1:{port}/", "runs": runs, "uploads": uploads, "proc": proc, "hold": hold}
    finally:
        hold.unlink(missing_ok=True)  # no run is left held
    proc.terminate()
    proc.wait(timeout=HANG_GUARD_S)
    log.close()
    from finetuner.runs import jobs

    for job in jobs.running_jobs(runs):
        jobs.stop_job(job, runs, wait=30)


def browser_page(width: int, height: int) -> Iterator:
    """A page of headless Chromium whose waits default to the suite's hang guard."""
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": width, "height": height})
        pg.set_default_timeout(HANG_MS)
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


def fill_until_held(box, value: str, commit: str = "Tab", held=None) -> None:
    """Type ``value`` into ``box`` and commit it with the key ``commit``, again until ``held`` (default the
    box itself; a slider's range for its number box) holds it: an entry typed while its row or accordion
    was still rendering can be dropped before the box listens (seen in CI), so it is typed up to 3 times."""
    held = box if held is None else held
    for _attempt in range(3):
        box.fill(value)
        box.press(commit)
        try:
            sync_api.expect(held).to_have_value(value, timeout=5_000)
            return
        except AssertionError:
            continue
    sync_api.expect(held).to_have_value(value, timeout=5_000)


def type_in(page, elem_id: str, value: str) -> None:
    """Type a value of one's own into a gradio dropdown (one that allows it)."""
    box = page.locator(f"#{elem_id} input")
    box.click()
    box.fill(value)
    box.press("Enter")
    sync_api.expect(box).to_have_value(value)


def wait_text(page, selector: str, pattern: str, timeout: float = HANG_MS, flags: int = 0) -> str:
    """Wait until ``selector`` contains text matching ``pattern``; returns its text."""
    loc = page.locator(selector)
    sync_api.expect(loc).to_contain_text(re.compile(pattern, flags), timeout=timeout)
    return loc.inner_text()


#: what is cut off: text in a box that clips it, a table wider than its scroll box, a chart label
#: shortened with "…"
CUT_OFF_JS = """() => { const out = [];
  for (const el of document.querySelectorAll('body *')) {
    const r = el.getBoundingClientRect(); if (!r.width || !r.height) continue;
    if (el.closest('.sr-only')) continue;
    const cs = getComputedStyle(el); if (cs.visibility === 'hidden') continue;
    if (![...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim())) continue;
    const clips = cs.textOverflow === 'ellipsis' || ['hidden', 'clip'].includes(cs.overflowX);
    if (clips && el.scrollWidth > el.clientWidth + 1) out.push(el.tagName + ': ' + el.textContent.trim().slice(0, 60));
  }
  for (const t of document.querySelectorAll('table')) {
    if (!t.getBoundingClientRect().width) continue;
    let p = t.parentElement; while (p && !['auto', 'scroll', 'hidden'].includes(getComputedStyle(p).overflowX)) p = p.parentElement;
    if (p && p.scrollWidth > p.clientWidth + 1) out.push('table: ' + t.innerText.slice(0, 60));
  }
  for (const t of document.querySelectorAll('svg text')) if (t.textContent.endsWith('…')) out.push('chart: ' + t.textContent);
  for (const s of document.querySelectorAll('svg.marks')) { const b = s.getBoundingClientRect(); if (!b.width) continue;
    for (const t of s.querySelectorAll('text')) { const r = t.getBoundingClientRect();
      if (r.width && (r.left < b.left - 1 || r.right > b.right + 1)) out.push('chart text outside its chart: ' + t.textContent); } }
  return out; }"""


#: every chart shown is as wide as its block (charts re-fit when the window or the tab changes)
CHARTS_FITTED_JS = """() => [...document.querySelectorAll('.altair')].filter(a => a.getBoundingClientRect().width > 0)
  .every(a => { const s = a.querySelector('svg.marks');
                return s && Math.abs(s.getBoundingClientRect().width - a.getBoundingClientRect().width) < 2; })"""


def assert_nothing_cut_off(page, where: str, timeout: float = 10_000) -> None:
    """Nothing on the page is cut off (:data:`CUT_OFF_JS`) once its charts have settled: a chart
    re-laid out after a resize or a tab change has ``timeout`` ms to fit again (the length
    histogram, a gradio BarPlot, is not among the charts CHARTS_FITTED_JS waits for); what is still
    cut off then fails, listed."""
    try:
        page.wait_for_function(f"() => ({CUT_OFF_JS})().length === 0", timeout=timeout)
    except sync_api.TimeoutError:
        pass
    assert page.evaluate(CUT_OFF_JS) == [], f"cut off {where}"

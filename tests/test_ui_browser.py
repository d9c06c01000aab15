"""The web UI in a real browser: Playwright driving Debian's Chromium, headless.

The whole flow on the shipped tiny model and sample data: pick model and data, see the plan and
its memory chart, start a short training run, watch the progress and the loss curve move,
reload the page mid-run (the run goes on and is shown again), see it finish, chat with the
result next to the base model, and export (adapter zip, merge). A screenshot of each stage goes
to ``.cache/ui-screenshots/`` (git-ignored) for a person to look at.

Needs ``playwright`` (the ``test`` extra) and ``/usr/bin/chromium`` (scripts/_setup.sh installs
Debian's package); never ``playwright install``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("FINETUNER_CHROMIUM", "/usr/bin/chromium")
SHOTS = ROOT / ".cache" / "ui-screenshots"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage",
]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
pytest.importorskip("gradio", reason="gradio is not installed (pip install -e '.[ui]')")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; scripts/_setup.sh does it)", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``finetuner ui`` as a user starts it, on a free port, with a fresh runs folder."""
    runs = tmp_path_factory.mktemp("runs")
    port = free_port()
    log = open(runs.parent / "ui-server.log", "w")
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetuner", "ui", "--port", str(port), "--runs-dir", str(runs)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(runs.parent),  # not the checkout: paths must not depend on it
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"finetuner ui exited: {Path(log.name).read_text()}")
            time.sleep(0.3)
    yield {"url": url, "runs": runs, "proc": proc}
    proc.terminate()
    proc.wait(timeout=20)
    log.close()
    from finetuner import jobs

    for job in jobs.running_jobs(runs):
        jobs.stop_job(job, runs, wait=30)


@pytest.fixture(scope="module")
def page(server):
    if SHOTS.exists():
        shutil.rmtree(SHOTS)
    SHOTS.mkdir(parents=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1360, "height": 1000})
        pg.set_default_timeout(60_000)
        yield pg
        browser.close()


def shot(page, name: str) -> None:
    page.wait_for_timeout(400)  # let charts finish their transition
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def tab(page, label: str) -> None:
    page.get_by_role("tab", name=label).click()


def pick(page, elem_id: str, value: str) -> None:
    """Choose ``value`` in a gradio dropdown."""
    box = page.locator(f"#{elem_id} input")
    box.click()
    box.fill(value)
    page.get_by_role("option", name=value, exact=True).click()


def wait_text(page, selector: str, pattern: str, timeout: float = 60_000) -> str:
    loc = page.locator(selector)
    sync_api.expect(loc).to_contain_text(re.compile(pattern), timeout=timeout)
    return loc.inner_text()


def status_step(page) -> int:
    m = re.search(r"step (\d+)", page.locator("#train-status").inner_text())
    return int(m.group(1)) if m else -1


def test_whole_flow_in_browser(server, page):
    t0 = time.monotonic()
    page.goto(server["url"])
    # 1. model and card: the shipped tiny model on this machine's CPU
    wait_text(page, "#model-card", r"demo_model.*parameters")
    wait_text(page, "#model-card", r"cpu")
    shot(page, "01-model")

    # 2. data: the sample set, its detected format, the preview with trained tokens, the lengths
    tab(page, "2 · Data")
    wait_text(page, "#data-summary", r"Format:.*alpaca")
    sync_api.expect(page.locator("#data-preview")).to_contain_text("Tern here", timeout=60_000)
    sync_api.expect(page.locator("#data-preview")).to_contain_text("trained")
    sync_api.expect(page.locator("#length-hist canvas, #length-hist svg").first).to_be_visible()
    shot(page, "02-data")

    # 3. plan: the planner's recipe, its memory chart against the card, the reasons
    page.get_by_role("button", name="Next: the plan →").click()
    wait_text(page, "#plan-summary", r"LORA")
    wait_text(page, "#estimate", r"Fits")
    sync_api.expect(page.locator("#memory-chart svg.marks")).to_be_visible()
    assert "model:" in page.locator("#recipe-yaml").inner_text()
    shot(page, "03-plan")

    # a short run of the shipped demo recipe: load it, then edit advanced fields (estimate follows)
    pick(page, "shipped-recipe", "recipes/demo_cpu.yaml")
    page.get_by_role("button", name="Load recipe", exact=True).click()
    wait_text(page, "#recipe-yaml", r"demo_cpu")
    for label, value in (("max steps (0 = epochs)", "16"), ("log every (steps)", "2"), ("eval every (0 = at the end)", "4")):
        field = page.get_by_label(label, exact=True)
        field.fill(value)
        field.press("Tab")
    wait_text(page, "#recipe-yaml", r"max_steps: 16")
    wait_text(page, "#recipe-yaml", r"eval_every: 4")
    shot(page, "04-recipe")

    # 4. train: start; progress and the loss curve move
    tab(page, "4 · Train")
    page.locator("#start-btn").click()
    wait_text(page, "#train-status", r"training", timeout=120_000)
    run_name = page.locator("#train-status .ft-run").inner_text()
    page.wait_for_function("() => /step [1-9]/.test(document.querySelector('#train-status').innerText)", timeout=180_000)
    first = status_step(page)
    shot(page, "05-training")

    # a reload mid-run: the run goes on, and the page shows it again
    page.reload()
    tab(page, "4 · Train")
    wait_text(page, "#train-status", re.escape(run_name))
    wait_text(page, "#train-status", r"training|finishing|finished")
    # the run went on: a later step, or (a fast machine, a run already at its last step) finished
    page.wait_for_function(
        "() => { const t = document.querySelector('#train-status').innerText; const m = t.match(/step (\\d+) \\/ (\\d+)/);"
        f" return m && (+m[1] > {first} || (+m[1] === +m[2] && /finished/.test(t))); }}",
        timeout=180_000,
    )
    shot(page, "06-after-reload")

    wait_text(page, "#train-status", r"finished", timeout=300_000)
    sync_api.expect(page.locator("#loss-plot svg.marks")).to_be_visible()
    wait_text(page, "#train-memory", r"predicted peak .* measured")
    assert "step 16 / 16" in page.locator("#train-status").inner_text()
    sync_api.expect(page.locator("#runs-table")).to_contain_text(run_name, timeout=15_000)
    shot(page, "07-trained")

    # 5. chat: the fine-tuned run next to the base model, streamed
    tab(page, "5 · Chat")
    sync_api.expect(page.locator("#chat-run input")).to_have_value(run_name, timeout=15_000)
    page.locator("#chat-input textarea").fill("What should I pack for a day hike?")
    page.locator("#chat-send").click()
    wait_text(page, "#chat-status", r"Answered in", timeout=300_000)
    for lane in ("#chat-tuned", "#chat-base"):
        text = page.locator(lane).inner_text()
        assert "day hike" in text and "…" not in text and "(no answer)" not in text, text
        answer = text.replace("What should I pack for a day hike?", "").strip()
        assert len(answer) >= 5, f"{lane} shows the question but no answer: {text!r}"
    shot(page, "08-chat")

    # 6. export: the adapter as a zip, and a merged model
    tab(page, "6 · Export")
    sync_api.expect(page.locator("#export-run input")).to_have_value(run_name, timeout=15_000)
    page.locator("#zip-btn").click()
    sync_api.expect(page.locator("#adapter-zip a[href*=\"adapter.zip\"]")).to_be_visible(timeout=60_000)
    page.locator("#merge-btn").click()
    wait_text(page, "#export-status", r"Merged model saved", timeout=300_000)
    shot(page, "09-export")
    merged = server["runs"] / run_name / "merged"
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))
    print(f"\nbrowser flow: {time.monotonic() - t0:.0f} s; screenshots in {SHOTS}")

"""``finetuner ui`` start and stop: seconds from launching it to its address printed, to the first page showing the
model card (the imports the launch leaves to the background are done by then), and from SIGINT (Ctrl-C) to its exit
with that page still open (each open page holds a connection that a graceful stop waited for).

Each of ``--runs`` starts uses a fresh runs folder; the page is headless Chromium through Playwright (the test
extra, Debian's /usr/bin/chromium). ``--checkout`` measures another checkout of finetuner (e.g. an older commit
exported with ``git archive``) with this interpreter, for a before/after on one machine; the load average is
printed with each start, since a busy machine stretches every figure.

Usage:
  python -m scripts.bench.ui_startup --runs 3
  python -m scripts.bench.ui_startup --runs 3 --checkout /tmp/finetuner-before
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("FINETUNER_CHROMIUM", "/usr/bin/chromium")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(checkout: Path, browser) -> dict[str, float]:
    port, folder = free_port(), Path(tempfile.mkdtemp(prefix="ui-bench-"))
    env = dict(os.environ, PYTHONPATH=str(checkout), GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "finetuner", "ui", "--port", str(port), "--runs-dir", str(folder / "runs"),
                             "--upload-dir", str(folder / "uploads")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=folder)
    for line in proc.stdout:
        if "http://" in line:
            break
    address = time.monotonic() - t0
    page = browser.new_page()
    page.set_default_timeout(600_000)
    page.goto(f"http://127.0.0.1:{port}/")
    page.locator("#model-card").get_by_text("parameters").first.wait_for()
    card = time.monotonic() - t0
    page.get_by_role("tab", name="4 · Train").click()
    page.wait_for_timeout(3000)  # the Train tab polls the run: a page as a user leaves it open
    t1 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=120)
        stop = time.monotonic() - t1
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        stop = float("inf")
    page.close()
    return {"load": load, "address_s": address, "card_s": card, "stop_s": stop}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--checkout", type=Path, default=REPO, help="the finetuner checkout to measure (default this one)")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    rows = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        for i in range(args.runs):
            r = one_start(args.checkout.resolve(), browser)
            rows.append(r)
            print(f"start {i + 1}: load {r['load']:.1f} · address {r['address_s']:.1f} s · model card {r['card_s']:.1f} s · "
                  f"SIGINT to exit {r['stop_s']:.1f} s", flush=True)
        browser.close()
    for key, what in (("address_s", "address printed"), ("card_s", "model card shown"), ("stop_s", "SIGINT to exit")):
        print(f"median {what}: {statistics.median(r[key] for r in rows):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The web UI beside a run trained in a terminal, in a real browser (headless Chromium, Playwright), as a user meets
it (issue 68's UI frictions), on one page of one ``finetuner ui``:

- a ``finetuner run`` started in a terminal, training in the runs folder: the Train tab says where it was started and
  where to stop it, Stop is not offered for it, and Start is refused naming it and the terminal;
- a run this page started and saw finish is what the Chat and Export tabs then show, though another run changed
  later;
- the Export tab shows a long run name whole;
- the Chat tab offers no picture upload for a text model, and its status line reads as a sentence (no Python repr);
- Ctrl-C (SIGINT) stops the server with the page still open, and it says that its training job goes on (the job's
  process is still alive after it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import HANG_GUARD_S, demo_run_folder, wait_until_done
from tests.ui.support import HANG_MS, browser_page, pick, sync_api, tab, ui_server, wait_text

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "alpaca_sample.json"
SHOTS = ROOT / ".cache" / "ui-screenshots"
#: a run name longer than the Export tab's menu was wide (80 characters, the longest a run folder's name gets)
LONG = "ferry-desk-answers-in-marlow-s-voice-held-out-chats-smollm2-lora-r16-seq512-v3b"


def recipe(name: str, steps: int) -> dict:
    return {"name": name, "model": {"name": str(ROOT / "data" / "demo_model")}, "method": "lora",
            "data": {"path": str(SAMPLE), "max_seq_len": 64, "val_size": 0},
            "training": {"max_steps": steps, "micro_batch_size": 2, "lr": 1e-3}, "logging": {"tensorboard": False},
            "device": "cpu"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``finetuner ui`` whose jobs hold after step 1 while ``server["hold"]`` exists; two finished runs in its runs
    folder (``fresh`` and one with a long name), and a ``finetuner run`` of its own started as in a terminal
    (``server["terminal"]``), held after step 1 while ``server["terminal_hold"]`` exists."""
    for s in ui_server(tmp_path_factory, hold_at=1):
        runs = s["runs"]
        demo_run_folder(runs, "fresh", adapter=True)
        demo_run_folder(runs, LONG, adapter=True)
        gate = runs.parent / "terminal-gate"
        gate.touch()
        path = runs.parent / "terminal.yaml"
        path.write_text(yaml.safe_dump(recipe("from-terminal", 3)), encoding="utf-8")
        env = dict(os.environ, FINETUNER_FAULT="HOLD@1", FINETUNER_HOLD_FILE=str(gate), HF_HUB_OFFLINE="1")
        with open(runs.parent / "terminal.log", "w") as log:
            term = subprocess.Popen([sys.executable, "-m", "finetuner", "run", str(path), "-o", str(runs / "from-terminal")],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(runs.parent))
        try:
            yield dict(s, terminal=term, terminal_hold=gate)
        finally:
            gate.unlink(missing_ok=True)
            term.wait(timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def page(server):
    yield from browser_page(1280, 900)


def set_yaml(page, text: str) -> None:
    """The recipe ``text`` in the Plan tab's editor (once the plan the tab makes when first opened is in it), then
    back to the Train tab."""
    tab(page, "3 · Plan")
    wait_text(page, "#recipe-yaml", r"name: ", timeout=HANG_MS)
    page.locator("#recipe-yaml .cm-content").click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(text)
    wait_text(page, "#recipe-yaml", re.escape(f"name: {yaml.safe_load(text)['name']}"))
    tab(page, "4 · Train")


def wait_for_step(runs: Path, name: str, step: int):
    from finetuner.runs import jobs

    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        if (runs / name).is_dir():
            st = jobs.run_status(runs / name, runs)
            assert st.state != "error", st.error
            if st.running and st.step >= step:
                return st
        time.sleep(0.5)
    raise AssertionError(f"{name} never reached step {step}")


def test_ui_beside_a_terminal_run(server, page):
    try:
        beside_a_terminal_run(server, page)
    except Exception:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "frictions-failed-here.png"), full_page=True)  # the page as the failure left it
        raise


def beside_a_terminal_run(server, page):
    runs = server["runs"]
    terminal = wait_for_step(runs, "from-terminal", 1)
    page.goto(server["url"])

    # (a) the terminal's run: where it was started and where to stop it; no Stop here; Start refused, naming it
    tab(page, "4 · Train")
    pick(page, "run-pick", "from-terminal")
    note = wait_text(page, "#train-status .ft-terminal", r"in a terminal")
    assert f"from-terminal was started outside the web UI, by `finetuner run` in a terminal (pid {terminal.pid})" in note, note
    assert "Ctrl-C" in note, note
    sync_api.expect(page.locator("#stop-btn")).to_be_disabled()
    set_yaml(page, yaml.safe_dump(recipe("mine", 2)))
    page.locator("#start-btn").click()
    refused = wait_text(page, "#train-message", r"already running on this device")
    assert "from-terminal" in refused and f"pid {terminal.pid}" in refused and "in a terminal" in refused, refused
    assert not (runs / "mine").exists()

    # (b) the terminal's run ends; this page's own run trains to the end, then another run changes later
    server["terminal_hold"].unlink()
    wait_until_done(runs, "from-terminal")
    page.locator("#start-btn").click()
    wait_text(page, "#train-message", r"Training started: mine")
    sync_api.expect(page.locator("#train-status .ft-status[data-state='done'] .ft-run")).to_have_text("mine", timeout=HANG_MS)
    os.utime(runs / LONG)  # another run, changed after this page's: the newest of the runs folder
    tab(page, "5 · Chat")
    sync_api.expect(page.locator("#chat-run input")).to_have_value("mine")
    tab(page, "6 · Export")
    sync_api.expect(page.locator("#export-run input")).to_have_value("mine")

    # (c) a long run name is shown whole in the Export tab
    pick(page, "export-run", LONG)
    box = page.locator("#export-run input")
    sync_api.expect(box).to_have_value(LONG)
    assert box.evaluate("e => e.scrollWidth <= e.clientWidth"), "the run's name is cut off"

    # (d, e) a text model: no picture upload; the status line is a sentence, not a Python repr
    tab(page, "5 · Chat")
    pick(page, "chat-run", "fresh")
    sync_api.expect(page.locator("#chat-picture")).to_be_hidden()
    page.locator("#chat-input textarea").fill("What should I pack for a day hike?")
    page.locator("#chat-send").click()
    status = wait_text(page, "#chat-status", r"Answered in", timeout=HANG_MS)
    assert "ChatModel(" not in status and "its adapter on, on cpu, up to" in status and "tokens of context" in status, status

    # (g) Ctrl-C with the page open and a job of this page training: the server stops, says the job goes on
    server["hold"].touch()
    set_yaml(page, yaml.safe_dump(recipe("goes-on", 4)))
    page.locator("#start-btn").click()
    wait_text(page, "#train-message", r"Training started: goes-on")
    job = wait_for_step(runs, "goes-on", 1)
    proc = server["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    log = (runs.parent / "ui-server.log").read_text()
    assert "finetuner UI stopped. Training goes on in its own process: goes-on (pid" in log, log[-2000:]
    assert "Traceback" not in log, log[-4000:]
    os.kill(job.pid, 0)  # the job's process is still there

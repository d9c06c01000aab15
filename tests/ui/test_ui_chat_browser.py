"""The Chat tab on a freshly trained run, in a real browser (headless Chromium, Playwright), as a user meets it
(issue 55: the tab had stayed on "Loading the model…" with no answer).

The shipped demo recipe trained as shipped (``demo_run``, the session's one training) is copied into the runs folder
of a ``finetuner ui`` served over HTTP: asked a question, the tab counts the seconds while the chat worker loads
the model, then answers, and the loading text is gone. The same run with its adapter file cut in half (a copy
interrupted, a disk that filled) is one error line naming the file, never a page left loading.
"""

from __future__ import annotations

import re
import shutil

import pytest

from tests.ui.support import HANG_MS, browser_page, pick, sync_api, tab, ui_server, wait_text

QUESTION = "What should I pack for a day hike?"


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_run):
    """``finetuner ui`` with two runs: ``fresh`` (the demo run as training left it) and ``damaged`` (its adapter
    file truncated to half its bytes)."""
    for s in ui_server(tmp_path_factory):
        shutil.copytree(demo_run, s["runs"] / "fresh")
        shutil.copytree(demo_run, s["runs"] / "damaged")
        weights = s["runs"] / "damaged" / "adapter" / "adapter_model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        yield s


@pytest.fixture(scope="module")
def page(server):
    yield from browser_page(1360, 1000)


def ask(page, run: str) -> None:
    tab(page, "5 · Chat")
    pick(page, "chat-run", run)
    page.locator("#chat-input textarea").fill(QUESTION)
    page.locator("#chat-send").click()


def test_chat_answers_on_a_freshly_trained_run(server, page):
    page.goto(server["url"])
    ask(page, "fresh")
    wait_text(page, "#chat-status", r"Loading the model… \d+ s|Answering…|Answered in")  # loading is seen, then
    status = wait_text(page, "#chat-status", r"Answered in", timeout=HANG_MS)
    assert "Loading the model" not in status and "Answering" not in status, status
    assert re.search(r"demo_model.*adapter on", status), status
    for lane in ("#chat-tuned", "#chat-base"):  # the fine-tune, and the base model beside it
        text = page.locator(lane).inner_text()
        answer = text.replace(QUESTION, "").strip()
        assert "…" not in text and "(no answer)" not in text and len(answer) >= 5, f"{lane}: {text!r}"


def test_chat_on_a_damaged_adapter_says_so_in_one_line(server, page):
    page.goto(server["url"])
    ask(page, "damaged")
    status = wait_text(page, "#chat-status", r"adapter_model\.safetensors is truncated or corrupt", timeout=HANG_MS)
    first, *rest = status.strip().splitlines()
    assert first.startswith("✕ Could not load") and "damaged/adapter/adapter_model.safetensors" in first, status
    assert "Loading the model" not in status and "Traceback" not in status and len(rest) <= 1, status
    # the question is given back to ask again, and the conversation holds no half answer
    sync_api.expect(page.locator("#chat-input textarea")).to_have_value(QUESTION)
    assert "…" not in page.locator("#chat-tuned").inner_text()

"""The web UI in a real browser: Playwright driving Debian's Chromium, headless.

The whole flow on the shipped tiny model and a data file of the user's own: upload it (it is
listed, and the same file again is the same file), reload (the choice is remembered), see the
plan and its memory chart, check an edited YAML (a bad key is one message; a good one says so),
start a short training run on the upload, watch the progress and the loss curve move, reload the
page mid-run (the run goes on and is shown again), see it finish; Start refuses a recipe that
does not fit the card unless confirmed, and a name already taken; the chosen run is remembered
over a reload; chat with the result next to the base model (a bad run name says why), and export
(the adapter zip in one click, a merge refused in the merge's own words, then a merge). Every error
is text on the page, never a bare "Error" badge. And a DPO run: the shipped pairs side by side in
the Data tab, the objective planned from the data (a wrong one refused in the planner's words), a
few steps, and the reward-accuracy chart beside the loss. A screenshot of each stage goes to
``.cache/ui-screenshots/`` (git-ignored) for a person to look at; on a failure, the page as it
was goes there as ``failed-here.png``. The flows also take the screenshots the documentation site
shows (docs/ui.md), at 1280×800, into a temporary folder (``FINETUNER_DOCS_SCREENSHOTS=docs/img/ui``:
into the docs), and check them (tests/ui/docs_screenshots.py).

Needs ``playwright`` (the ``test`` extra) and ``/usr/bin/chromium`` (scripts/_setup.sh installs
Debian's package); never ``playwright install``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import alpaca_rows
from tests.ui import docs_screenshots
from tests.ui.support import CHARTS_FITTED_JS, assert_nothing_cut_off, browser_page, fill_until_held, pick, sync_api, tab, type_in, ui_server, wait_text, HANG_MS

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / ".cache" / "ui-screenshots"

#: the whole flow's first run holds after this step until the test lets it go: a 16-step run on the
#: tiny model can end between two of the page's polls, and "mid-run" must be mid-run on any machine
HOLD_STEP = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``finetuner ui`` as a user starts it, on a free port, with a fresh runs folder; its runs hold
    after step 4 while ``server["hold"]`` exists (the whole flow's reload mid-run)."""
    yield from ui_server(tmp_path_factory, hold_at=HOLD_STEP)


@pytest.fixture(scope="module")
def page(server):
    if SHOTS.exists():
        shutil.rmtree(SHOTS)
    SHOTS.mkdir(parents=True)
    yield from browser_page(1360, 1000)


def shot(page, name: str) -> None:
    page.wait_for_timeout(400)  # let charts finish their transition
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def docs_shots(tmp_path_factory) -> docs_screenshots.Screenshots:
    """The documentation site's screenshots, taken by this module's flows (a temporary folder unless
    ``FINETUNER_DOCS_SCREENSHOTS`` names the docs' own)."""
    return docs_screenshots.Screenshots(docs_screenshots.folder(tmp_path_factory))


def docs_shot(shots: docs_screenshots.Screenshots, page, name: str, top: str | None = None) -> None:
    """One of the docs' screenshots at 1280×800 (the element ``top`` at the window's top), its charts fitted to it."""
    shots.take(page, name, top, settle=lambda pg: pg.wait_for_function(CHARTS_FITTED_JS))




#: records the text of each toast the page shows (window.ftToasts), from the start of each page load
TOASTS_JS = """window.ftToasts = []; new MutationObserver(ms => { for (const m of ms) for (const n of m.addedNodes) {
  if (n.nodeType !== 1) continue;
  for (const t of [n, ...n.querySelectorAll('.toast-body')]) if (t.matches('.toast-body'))
    window.ftToasts.push(t.querySelector('.toast-text, .toast-details')?.innerText ?? t.innerText); } })
  .observe(document, {subtree: true, childList: true});"""


#: a toast's title and close button, in its text when it was recorded before its body was filled in
TOAST_CHROME = {"Info", "Warning", "Error", "×"}


def toasts(page) -> list[str]:
    """The texts of the toasts shown since the page loaded, without their title and close button."""
    return ["\n".join(line for line in t.strip().splitlines() if line.strip() not in TOAST_CHROME).strip()
            for t in page.evaluate("() => window.ftToasts")]


def no_bare_errors(page) -> None:
    """Errors are text on the page: no component shows gradio's bare "Error" badge (nor its toast)."""
    sync_api.expect(page.get_by_text("Error", exact=True)).to_have_count(0)


def yaml_text(page) -> str:
    return page.locator("#recipe-yaml .cm-content").inner_text()


def set_yaml(page, text: str) -> None:
    """Replace the recipe in the editor, as pasting it would (no auto-indent)."""
    page.locator("#recipe-yaml .cm-content").click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(text)


def set_field(page, label: str, value: str) -> None:
    field = page.get_by_label(label, exact=True)
    field.fill(value)
    field.press("Tab")



def test_whole_flow_in_browser(server, page, tmp_path, docs_shots, request):
    try:
        whole_flow(server, page, tmp_path, docs_shots)
    except Exception:
        page.screenshot(path=str(SHOTS / "failed-here.png"), full_page=True)  # the page as the failure left it
        raise
    docs_shots.check(request.node.name)


def whole_flow(server, page, tmp_path, docs_shots):
    t0 = time.monotonic()
    runs, uploads = server["runs"], server["uploads"]
    mine = tmp_path / "my hikes.jsonl"  # the user's own file, outside the checkout
    mine.write_text("".join(json.dumps(r) + "\n" for r in alpaca_rows(37)), encoding="utf-8")
    stored = str(uploads / "my_hikes.jsonl")

    page.add_init_script(TOASTS_JS)  # counts the toasts each page load shows
    page.goto(server["url"])
    # 1. model and card: the shipped tiny model on this machine's CPU
    wait_text(page, "#model-card", r"demo_model.*parameters")
    wait_text(page, "#model-card", r"cpu")
    shot(page, "01-model")
    docs_shot(docs_shots, page, "model.png")

    # 2. data: upload a file of one's own; it is stored, listed, chosen and analysed
    tab(page, "2 · Data")
    wait_text(page, "#data-summary", r"Format:.*alpaca")  # the shipped sample, before any upload
    # one upload, one toast (it showed twice); uploading the same content again is on_upload's
    # (tests/ui/test_ui_api.py::test_the_same_content_uploaded_again_is_the_stored_file)
    with page.expect_file_chooser() as chooser:
        page.locator("#upload-btn").click()
    chooser.value.set_files(str(mine))
    sync_api.expect(page.locator("#data-file input")).to_have_value(stored)
    wait_text(page, "#data-summary", r"Format:.*alpaca.*\b37\b examples")
    assert sorted(p.name for p in uploads.iterdir()) == ["my_hikes.jsonl"]
    page.wait_for_timeout(1000)  # time for a duplicate toast to show, were there one
    assert [t for t in toasts(page) if "Saved as" in t] == [f"Saved as {stored}"]
    sync_api.expect(page.locator("#column-menus")).to_be_visible()  # the file's columns, each as detected
    sync_api.expect(page.locator("#column-prompt input")).to_have_value("— as detected —")
    page.locator("#data-file input").click()
    sync_api.expect(page.get_by_role("option", name=stored, exact=True)).to_be_visible()  # listed with data/*
    page.keyboard.press("Escape")
    sync_api.expect(page.locator("#data-preview")).to_contain_text("Tern here", timeout=HANG_MS)
    sync_api.expect(page.locator("#data-preview")).to_contain_text("trained")
    sync_api.expect(page.locator("#length-hist canvas, #length-hist svg").first).to_be_visible()
    shot(page, "02-data")
    docs_shot(docs_shots, page, "data.png", top="#data-summary")

    # a reload (or a new session in this browser) keeps the upload as the data
    page.reload()
    tab(page, "2 · Data")
    sync_api.expect(page.locator("#data-file input")).to_have_value(stored)
    wait_text(page, "#data-summary", r"\b37\b examples")

    # 3. plan: the planner's recipe for the upload, its memory chart against the card, the reasons
    page.get_by_role("button", name="Next: the plan →").click()
    wait_text(page, "#plan-summary", r"LORA")
    wait_text(page, "#estimate", r"Fits")
    sync_api.expect(page.locator("#memory-chart svg.marks")).to_be_visible()
    sync_api.expect(page.locator("#recipe-yaml")).to_contain_text(stored)
    shot(page, "03-plan")
    docs_shot(docs_shots, page, "plan.png")

    # a bad key in the YAML: one message naming it; the advanced fields keep their values
    micro = page.get_by_label("micro-batch", exact=True).input_value()
    planned = yaml_text(page)
    set_yaml(page, "bogus_key: 1\n" + planned)
    page.locator("#check-yaml").click()
    wait_text(page, "#yaml-status", r"bogus_key: unknown key.*Valid choices")
    no_bare_errors(page)
    shot(page, "03b-yaml-error")
    assert page.get_by_label("micro-batch", exact=True).input_value() == micro
    set_yaml(page, planned)  # fixed: Check says so, and the stale error goes
    page.locator("#check-yaml").click()
    wait_text(page, "#yaml-status", r"✓ The recipe is valid.*fits")
    assert "bogus_key" not in page.locator("#yaml-status").inner_text()

    # a short run: edit advanced fields (the estimate follows)
    for label, value in (("micro-batch", "4"), ("gradient accumulation", "1"), ("max steps (0 = epochs)", "16"),
                         ("log every (steps)", "2"), ("eval every (0 = at the end)", "4")):
        set_field(page, label, value)
    wait_text(page, "#recipe-yaml", r"max_steps: 16")
    wait_text(page, "#recipe-yaml", r"eval_every: 4")
    run_name = yaml.safe_load(yaml_text(page))["name"]
    shot(page, "04-recipe")

    # 4. train: start; the run is named as in the YAML, on the upload; progress and the loss curve move.
    # The run holds after step HOLD_STEP while the gate file exists, so the page sees it mid-run.
    tab(page, "4 · Train")
    server["hold"].touch()
    page.locator("#start-btn").click()
    wait_text(page, "#train-message", rf"Training started: {re.escape(run_name)}\b")
    wait_text(page, "#train-status", r"training", timeout=HANG_MS)
    assert page.locator("#train-status .ft-run").inner_text() == run_name
    assert yaml.safe_load((runs / run_name / "recipe.yaml").read_text())["data"]["path"] == stored
    wait_text(page, "#train-status", rf"training.*step {HOLD_STEP} / 16", timeout=HANG_MS, flags=re.S)
    shot(page, "05-training")

    # a reload mid-run: the page shows the run again, still training; let go, it goes on to the end
    page.reload()
    tab(page, "4 · Train")
    wait_text(page, "#train-status", re.escape(run_name))
    wait_text(page, "#train-status", rf"training.*step {HOLD_STEP} / 16", flags=re.S)
    shot(page, "06-after-reload")
    tab(page, "3 · Plan")  # the recipe planned and edited is still in the editor (under a free name: the run has its name)
    wait_text(page, "#recipe-yaml", r"max_steps: 16")
    assert yaml.safe_load(yaml_text(page))["name"] not in ("", run_name)
    tab(page, "4 · Train")
    server["hold"].unlink()
    page.wait_for_function(
        "() => { const m = document.querySelector('#train-status').innerText.match(/step (\\d+) \\//);"
        f" return m && +m[1] > {HOLD_STEP}; }}",
        timeout=HANG_MS,
    )

    wait_text(page, "#train-status", r"finished", timeout=HANG_MS)
    sync_api.expect(page.locator("#train-message")).not_to_contain_text("Training started")  # gone with the run
    sync_api.expect(page.locator("#loss-plot svg.marks")).to_be_visible()
    wait_text(page, "#train-memory", r"predicted peak .* measured")
    assert "step 16 / 16" in page.locator("#train-status").inner_text()
    sync_api.expect(page.locator("#runs-table")).to_contain_text(run_name, timeout=HANG_MS)
    shot(page, "07-trained")
    docs_shot(docs_shots, page, "train.png", top="#train-status")

    # after the reload the editor holds the recipe it had, under a free name (a run has its name now)
    tab(page, "3 · Plan")
    sync_api.expect(page.locator("#recipe-yaml")).to_contain_text(stored)
    set_field(page, "max steps (0 = epochs)", "2")
    wait_text(page, "#recipe-yaml", r"max_steps: 2\b")
    replanned = yaml_text(page)
    assert yaml.safe_load(replanned)["name"] != run_name
    set_yaml(page, re.sub(r"(?m)^name: .*$", f"name: {run_name}", replanned))  # a name already taken

    # Start refuses a recipe predicted not to fit the card, with the reason, unless confirmed
    tab(page, "1 · Model & card")
    type_in(page, "card", "1GB")
    wait_text(page, "#model-card", r"1GB")
    tab(page, "4 · Train")
    page.locator("#start-btn").click()
    wait_text(page, "#train-message", r"Not started: .* more than 1GB .*tick “Start even if it does not fit”", flags=re.S)
    no_bare_errors(page)
    shot(page, "07b-does-not-fit")
    page.get_by_label("Start even if it does not fit").check()
    page.locator("#start-btn").click()  # confirmed, but the name is taken: refused, nothing renamed
    wait_text(page, "#train-message", rf"A run named '{re.escape(run_name)}' already exists")
    no_bare_errors(page)
    assert sorted(p.name for p in runs.iterdir() if not p.name.startswith(".")) == [run_name]
    tab(page, "3 · Plan")
    set_yaml(page, re.sub(r"(?m)^name: .*$", "name: my-second-run", replanned))
    tab(page, "4 · Train")
    page.locator("#start-btn").click()
    wait_text(page, "#train-message", r"Training started: my-second-run .*predicted not to fit")
    wait_text(page, "#train-status", r"my-second-run")
    wait_text(page, "#train-status", r"finished", timeout=HANG_MS)
    assert (runs / "my-second-run" / "adapter").is_dir()  # the folder is the name as typed
    shot(page, "08-second-run")

    # the chosen run (the first, not the newest) is remembered over a reload, with the data and card
    remembered = page.evaluate("() => localStorage.getItem('finetuner-ui')")
    pick(page, "run-pick", run_name)
    wait_text(page, "#train-status", re.escape(run_name))
    page.wait_for_function("(before) => localStorage.getItem('finetuner-ui') !== before", arg=remembered)
    page.reload()
    tab(page, "4 · Train")
    sync_api.expect(page.locator("#run-pick input")).to_have_value(run_name)
    wait_text(page, "#train-status", re.escape(run_name))
    tab(page, "2 · Data")
    sync_api.expect(page.locator("#data-file input")).to_have_value(stored)
    tab(page, "1 · Model & card")
    sync_api.expect(page.locator("#card input")).to_have_value("1GB")

    # 5. chat: a run name that does not exist says so; then the fine-tuned run next to the base model
    tab(page, "5 · Chat")
    sync_api.expect(page.locator("#chat-run input")).to_have_value(run_name, timeout=HANG_MS)
    type_in(page, "chat-run", "no-such-run")
    page.locator("#chat-input textarea").fill("What should I pack for a day hike?")
    page.locator("#chat-send").click()
    wait_text(page, "#chat-status", r"No run named no-such-run")
    no_bare_errors(page)
    shot(page, "09a-chat-error")
    sync_api.expect(page.locator("#chat-input textarea")).to_have_value("What should I pack for a day hike?")
    pick(page, "chat-run", run_name)
    page.locator("#chat-send").click()
    wait_text(page, "#chat-status", r"Answered in", timeout=HANG_MS)
    for lane in ("#chat-tuned", "#chat-base"):
        text = page.locator(lane).inner_text()
        assert "day hike" in text and "…" not in text and "(no answer)" not in text, text
        answer = text.replace("What should I pack for a day hike?", "").strip()
        assert len(answer) >= 5, f"{lane} shows the question but no answer: {text!r}"
    shot(page, "09-chat")
    docs_shot(docs_shots, page, "chat.png")

    # 6. export: the adapter zip in one click; a non-empty folder is refused in the merge's words; a merge
    tab(page, "6 · Export")
    sync_api.expect(page.locator("#export-run input")).to_have_value(run_name, timeout=HANG_MS)
    sync_api.expect(page.locator("#zip-btn")).to_be_enabled()
    with page.expect_download() as download:
        page.locator("#zip-btn").click()
    assert download.value.suggested_filename == f"{run_name}-adapter.zip"
    assert "adapter_config.json" in zipfile.ZipFile(download.value.path()).namelist()
    page.locator("#out-dir textarea, #out-dir input").first.fill(str(tmp_path))  # holds the user's file
    page.locator("#merge-btn").click()
    wait_text(page, "#export-status", r"is not empty; finetuner will not write into it: it holds my hikes.jsonl.*Choose a new output folder", flags=re.S)
    assert "Merging" not in page.locator("#export-status").inner_text()
    no_bare_errors(page)
    shot(page, "10a-export-error")
    assert mine.is_file() and sorted(p.name for p in tmp_path.iterdir()) == [mine.name]
    page.locator("#out-dir textarea, #out-dir input").first.fill("")
    page.locator("#merge-btn").click()
    wait_text(page, "#export-status", r"Merged model saved", timeout=HANG_MS)
    shot(page, "10-export")
    docs_shot(docs_shots, page, "export.png")
    merged = runs / run_name / "merged"
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))

    # a new session in another browser (nothing remembered there) starts from the newest run's data
    other = page.context.browser.new_context(viewport={"width": 1360, "height": 1000})
    try:
        fresh = other.new_page()
        fresh.goto(server["url"])
        tab(fresh, "2 · Data")
        sync_api.expect(fresh.locator("#data-file input")).to_have_value(stored, timeout=HANG_MS)
        wait_text(fresh, "#data-summary", r"\b37\b examples")
    finally:
        other.close()
    print(f"\nbrowser flow: {time.monotonic() - t0:.0f} s; screenshots in {SHOTS}")


# --------------------------------------------------------------------------- preference tuning
PAIRS = "data/preference_sample.jsonl"
#: the line of the reward chart (its accuracy): the number of points on it
REWARD_LINE_JS = """() => { const s = document.querySelector('#reward-plot svg.marks'); if (!s) return 0;
  return Math.max(0, ...[...s.querySelectorAll('.mark-line path')].map(p => (p.getAttribute('d') || '').split(/[ML]/).length - 1)); }"""


def test_dpo_run_in_browser(server, page, docs_shots, request):
    """In a browser of its own (nothing remembered from another test): pairs side by side, a DPO
    plan, a few steps, and the reward accuracy beside the loss."""
    browser = page.context.browser.new_context(viewport={"width": 1360, "height": 1000})
    pg = browser.new_page()
    pg.set_default_timeout(60_000)
    try:
        dpo_flow(server, pg, docs_shots)
    except Exception:
        pg.screenshot(path=str(SHOTS / "dpo-failed-here.png"), full_page=True)
        raise
    finally:
        browser.close()
    docs_shots.check(request.node.name)


def dpo_flow(server, page, docs_shots):
    first = json.loads((ROOT / PAIRS).read_text(encoding="utf-8").splitlines()[0])
    page.goto(server["url"])
    wait_text(page, "#model-card", r"demo_model.*parameters")
    wait_text(page, "#model-card", r"cpu")

    # the Data tab: the pairs side by side, read as training reads them, and what the file fits
    tab(page, "2 · Data")
    wait_text(page, "#data-summary", r"Format|Holds")  # the start-up analysis is done before another file is picked
    pick(page, "data-file", PAIRS)
    wait_text(page, "#data-summary", r"preference pairs .*\b400\b pairs")
    wait_text(page, "#data-summary", r"Fits objective dpo, orpo or simpo")
    table = page.locator("#pair-preview table.ft-pairs")
    sync_api.expect(table).to_be_visible()
    sync_api.expect(page.locator("#data-preview")).to_be_hidden()  # the token view gives way to the pairs
    assert [h.inner_text() for h in table.locator("th").all()] == ["prompt", "chosen ✓", "rejected ✕"]
    cells = table.locator("tbody tr").first.locator("td")
    assert cells.nth(1).inner_text() == first["chosen"]["value"] and cells.nth(2).inner_text() == first["rejected"]["value"]
    boxes = [cells.nth(i).bounding_box() for i in range(3)]
    assert boxes[0]["x"] < boxes[1]["x"] < boxes[2]["x"] and len({round(b["y"]) for b in boxes}) == 1  # side by side
    sync_api.expect(page.locator("#length-hist canvas, #length-hist svg").first).to_be_visible()
    assert_nothing_cut_off(page, "in the Data tab's pairs")
    shot(page, "dpo-01-pairs")

    # the Plan tab: auto plans DPO for pairs; an objective the file does not fit is refused, naming it
    tab(page, "3 · Plan")
    wait_text(page, "#plan-summary", r"DPO · LORA")
    wait_text(page, "#recipe-yaml", r"objective: dpo")
    sync_api.expect(page.locator("#recipe-yaml")).to_contain_text(PAIRS)
    pick(page, "plan-objective", "kto")
    page.get_by_role("button", name="Make the plan").click()
    wait_text(page, "#plan-summary", r"this file holds preference pairs.*fits objective dpo, orpo or simpo, not 'kto'")
    no_bare_errors(page)
    pick(page, "plan-objective", "dpo")
    page.get_by_role("button", name="Make the plan").click()
    wait_text(page, "#plan-summary", r"DPO · LORA")
    wait_text(page, "#estimate", r"Fits")
    for label, value in (("micro-batch", "2"), ("gradient accumulation", "1"), ("max steps (0 = epochs)", "4"),
                         ("log every (steps)", "1"), ("eval every (0 = at the end)", "2")):
        set_field(page, label, value)
    wait_text(page, "#recipe-yaml", r"max_steps: 4")
    wait_text(page, "#recipe-yaml", r"eval_every: 2")
    wait_text(page, "#recipe-yaml", r"micro_batch_size: 2")
    recipe = yaml.safe_load(yaml_text(page))
    assert recipe["objective"] == "dpo" and recipe["training"]["max_steps"] == 4
    shot(page, "dpo-02-plan")

    # the Train tab: no reward chart before a preference run; then the reward accuracy beside the loss
    tab(page, "4 · Train")
    sync_api.expect(page.locator("#reward-column")).to_be_hidden()
    page.locator("#start-btn").click()
    wait_text(page, "#train-message", rf"Training started: {re.escape(recipe['name'])}\b")
    wait_text(page, "#train-status", re.escape(recipe["name"]))
    sync_api.expect(page.locator("#reward-column")).to_be_visible(timeout=HANG_MS)
    wait_text(page, "#train-status", r"reward accuracy \d+%", timeout=HANG_MS)
    page.wait_for_function(f"() => ({REWARD_LINE_JS})() >= 2", timeout=HANG_MS)  # a line from two steps on
    shot(page, "dpo-03-training")
    wait_text(page, "#train-status", r"finished", timeout=HANG_MS)
    status = page.locator("#train-status").inner_text()
    assert "step 4 / 4" in status and re.search(r"eval reward accuracy \d+%", status), status
    page.wait_for_function(f"() => ({REWARD_LINE_JS})() === 4", timeout=HANG_MS)  # every step drawn
    wait_text(page, "#reward-plot", r"Reward accuracy — \d+% at step 4")
    sync_api.expect(page.locator("#loss-plot svg.marks")).to_be_visible()
    loss, rewards = page.locator("#loss-plot").bounding_box(), page.locator("#reward-plot").bounding_box()
    assert loss["x"] + loss["width"] <= rewards["x"] and abs(loss["y"] - rewards["y"]) < 40  # beside the loss chart
    from finetuner.runs import jobs

    st = jobs.run_status(server["runs"] / recipe["name"], server["runs"])
    assert st.objective == "dpo" and [s for s, _ in st.rewards["reward_accuracy"]] == [1, 2, 3, 4]
    assert f"reward accuracy {st.rewards['reward_accuracy'][-1][1]:.0%}" in status.split("eval reward")[0]  # the latest step's
    no_bare_errors(page)
    shot(page, "dpo-04-trained")
    docs_shot(docs_shots, page, "dpo-train.png", top="#train-status")
    # the pairs and the reward chart at common window sizes: nothing cut off, charts as wide as their blocks
    for w, h in ((1280, 800), (1920, 1080)):
        page.set_viewport_size({"width": w, "height": h})
        for label in ("2 · Data", "4 · Train"):
            tab(page, label)
            page.wait_for_function(CHARTS_FITTED_JS)
            assert_nothing_cut_off(page, f"at {w}x{h} on {label}")
            shot(page, f"dpo-05-{w}x{h}-{label.split(' ')[0]}")


# --------------------------------------------------------------------------- GRPO
SAMPLE = "data/alpaca_sample.json"
WHISTLE = "recipes/rewards_demo.py:mentions_whistle"


def test_grpo_plan_in_browser(server, page, tmp_path):
    """In a browser of its own: a file of prompts alone is shown as prompts in the Data tab; objective grpo
    shows the reward settings, a plan without a reward is refused in the planner's words, and a reward
    file of the checkout with a smaller group plans a GRPO recipe with that reward and the plan's GRPO
    room among its reasons."""
    in_own_browser(page, "grpo", grpo_flow, server, tmp_path)


def in_own_browser(page, name: str, flow, *args) -> None:
    """``flow(new_page, *args)`` in a browser context of its own (no state of the other tests' page); on a failure
    the page as it was goes to ``<name>-failed-here.png``."""
    browser = page.context.browser.new_context(viewport={"width": 1360, "height": 1000})
    pg = browser.new_page()
    pg.set_default_timeout(60_000)
    try:
        flow(pg, *args)
    except Exception:
        pg.screenshot(path=str(SHOTS / f"{name}-failed-here.png"), full_page=True)
        raise
    finally:
        browser.close()


def fill_shown(page, selector: str, value: str) -> None:
    """Type ``value`` into a box that has just been shown: an entry typed while its row was still
    rendering can be dropped before the box listens (as the chat's generation settings were), so it
    is typed again until the box holds it; a number is committed by leaving the box."""
    box = page.locator(selector)
    sync_api.expect(box).to_be_visible(timeout=HANG_MS)
    fill_until_held(box, value)


def grpo_flow(page, server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Which path leads to hut {i}?", "answer": f"path {i}"}) + "\n"
                               for i in range(5)), encoding="utf-8")
    page.goto(server["url"])
    wait_text(page, "#model-card", r"demo_model.*parameters")
    tab(page, "2 · Data")
    wait_text(page, "#data-summary", r"Format|Holds")  # the start-up analysis is done before another file is picked
    type_in(page, "data-file", str(prompts))  # prompts alone: shown as GRPO reads them
    wait_text(page, "#data-summary", r"Holds prompts .*\b5\b prompts.*Fits objective grpo", flags=re.S)
    table = page.locator("#pair-preview table.ft-pairs")
    sync_api.expect(table).to_be_visible()
    sync_api.expect(table).to_contain_text("Which path leads to hut 0?")
    sync_api.expect(page.locator("#data-preview")).to_be_hidden()
    assert_nothing_cut_off(page, "in the Data tab's prompts")
    shot(page, "grpo-00-prompts")
    pick(page, "data-file", SAMPLE)
    wait_text(page, "#data-summary", r"alpaca.*\b300\b examples")

    # the Plan tab: the reward settings are there for objective grpo only
    tab(page, "3 · Plan")
    wait_text(page, "#plan-summary", r"LORA")  # the plan of the empty editor
    sync_api.expect(page.locator("#grpo-settings")).to_be_hidden()
    pick(page, "plan-objective", "grpo")
    sync_api.expect(page.locator("#grpo-settings")).to_be_visible()
    sync_api.expect(page.locator("#plan-num-generations input")).to_have_value("4")  # the recipe's defaults
    sync_api.expect(page.locator("#plan-max-new-tokens input")).to_have_value("64")
    page.get_by_role("button", name="Make the plan").click()  # no reward named: the planner's words, for the page
    wait_text(page, "#plan-summary", r"GRPO trains on rewards, and none is named\.\s*Name one in Rewards: FILE\.py:FUNCTION")
    no_bare_errors(page)

    fill_shown(page, "#plan-rewards textarea", WHISTLE)
    fill_shown(page, "#plan-num-generations input", "2")
    fill_shown(page, "#plan-max-new-tokens input", "16")
    page.get_by_role("button", name="Make the plan").click()
    wait_text(page, "#plan-summary", r"GRPO · LORA")
    wait_text(page, "#plan-summary", r"GRPO room on this choice: 2 generations of up to 16 new tokens")
    wait_text(page, "#estimate", r"Fits")
    wait_text(page, "#recipe-yaml", r"objective: grpo")
    recipe = yaml.safe_load(yaml_text(page))
    assert recipe["objective"] == "grpo" and recipe["data"]["path"] == str(ROOT / SAMPLE)
    assert recipe["grpo"]["rewards"] == [{"function": "mentions_whistle", "file": str(ROOT / "recipes" / "rewards_demo.py")}]
    assert (recipe["grpo"]["num_generations"], recipe["grpo"]["max_new_tokens"]) == (2, 16)
    no_bare_errors(page)
    shot(page, "grpo-01-plan")

    pick(page, "plan-objective", "auto")  # another objective: the reward settings go
    sync_api.expect(page.locator("#grpo-settings")).to_be_hidden()


def test_pictures_in_browser(server, page, tiny_vlm_dir, tmp_path):
    """In a browser of its own: the picture demo's model and file show the file's first pictures as thumbnails (each
    one loaded) and count their image tokens; a run trained on pictures answers a message sent with an uploaded
    picture, and the status line says which picture went with it."""
    from tests.conftest import cli_in_process, write_picture_chats, write_recipe

    data = write_picture_chats(tmp_path, 8)
    recipe = write_recipe(tmp_path / "recipe.yaml", {
        "name": "eyes", "model": {"name": str(tiny_vlm_dir)}, "method": "lora",
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 0},
        "training": {"max_steps": 2, "micro_batch_size": 2, "lr": 1e-3}, "logging": {"tensorboard": False}, "device": "cpu"})
    out = cli_in_process("run", str(recipe), "-o", str(server["runs"] / "eyes"), "--quiet", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    in_own_browser(page, "pictures", pictures_flow, server, data)


def pictures_flow(page, server, data):
    page.goto(server["url"])
    wait_text(page, "#model-card", r"parameters", timeout=120_000)
    type_in(page, "model-name", str(ROOT / "data" / "demo_vlm"))
    wait_text(page, "#model-card", r"demo_vlm", timeout=120_000)
    tab(page, "2 · Data")
    wait_text(page, "#data-summary", r"Format|Holds")
    type_in(page, "data-file", str(ROOT / "data" / "pictures" / "shapes.jsonl"))
    wait_text(page, "#data-summary", r"48\*?\*? pictures · 16 image tokens a picture")
    thumbs = page.locator("#pair-preview img")
    sync_api.expect(thumbs.first).to_be_visible(timeout=HANG_MS)
    assert thumbs.evaluate_all("els => els.map(e => e.getAttribute('alt'))")[:3] == ["train-000.png", "train-001.png",
                                                                                   "train-002.png"]
    assert all(w == 48 for w in thumbs.evaluate_all("els => els.map(e => e.naturalWidth)"))  # each picture loaded
    assert_nothing_cut_off(page, "in the Data tab's pictures")
    shot(page, "pictures-01-data")

    tab(page, "5 · Chat")
    type_in(page, "chat-run", "eyes")
    sync_api.expect(page.locator("#chat-picture")).to_be_visible()  # a run whose model reads pictures: the upload is offered
    page.locator("#chat-picture input[type=file]").set_input_files(str(data.parent / "img" / "001.png"))
    sync_api.expect(page.locator("#chat-picture img").first).to_be_visible(timeout=HANG_MS)
    page.locator("#chat-input textarea").fill("What colour is this?")
    page.locator("#chat-send").click()
    wait_text(page, "#chat-status", r"Answered in .*with the picture 001\.png", timeout=HANG_MS)
    sync_api.expect(page.locator("#chat-tuned")).to_contain_text("What colour is this?")
    no_bare_errors(page)
    shot(page, "pictures-02-chat")

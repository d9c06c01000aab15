"""The event stream's schema (finetuner/runs/schema.py), its writer and follower, the run states,
and docs/events.md: what the code emits, what the schema defines and what the docs describe agree."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import finetuner
from tests.conftest import HANG_GUARD_S
from finetuner.config.recipe import Recipe
from finetuner.runs import jobs
from finetuner.runs.events import EventWriter, follow, read_events
from finetuner.runs.folder import RunLock
from finetuner.runs.schema import (
    EVENT_TYPES,
    RUN_STATES,
    SCHEMA_VERSION,
    TERMINAL_EVENTS,
    EventSchemaError,
    fields,
    run_state,
    validate_event,
)

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "events.md"
COMMON = {"event", "time"}
MEMORY = {"mem_allocated", "mem_reserved", "mem_peak"}  # what ``**device_memory(...)`` adds


# --------------------------------------------------------------------------- code ↔ schema ↔ docs
def emit_calls() -> list[tuple[str, str, set[str], bool]]:
    """Every ``<x>.emit("kind", ...)`` in finetuner/ and ui/: (where, kind, keywords, has a ``**`` splat)."""
    out = []
    for pkg in ("finetuner", "ui"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit"
                        and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    kws = {k.arg for k in node.keywords if k.arg is not None}
                    splat = any(k.arg is None for k in node.keywords)
                    out.append((f"{path.relative_to(REPO)}:{node.lineno}", node.args[0].value, kws, splat))
    return out


def test_every_emitted_kind_and_field_is_in_the_schema():
    calls = emit_calls()
    assert len(calls) >= 13
    emitted = {kind for _, kind, _, _ in calls}
    assert emitted == set(EVENT_TYPES), (emitted ^ set(EVENT_TYPES))  # nothing undefined, nothing stale
    for where, kind, kws, splat in calls:
        spec = fields(kind)
        assert kws <= set(spec), f"{where}: {kind} fields not in the schema: {kws - set(spec)}"
        missing = {f for f, (_, required) in spec.items() if required} - COMMON - {"schema_version"} - kws
        assert not missing or (splat and missing <= MEMORY), f"{where}: {kind} lacks {missing}"


def doc_sections() -> dict[str, str]:
    text = DOCS.read_text(encoding="utf-8")
    parts = re.split(r"^### `([a-z_]+)`\n", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def test_docs_describe_every_kind_and_field():
    sections = doc_sections()
    assert list(sections) == list(EVENT_TYPES)  # every kind, in the schema's order, nothing else
    text = DOCS.read_text(encoding="utf-8")
    for f in COMMON:
        assert f"| `{f}` |" in text
    for kind, body in sections.items():
        rows = set(re.findall(r"^\| `([a-z_]+)` \|", body, flags=re.M))
        assert rows == set(fields(kind)) - COMMON, (kind, rows ^ (set(fields(kind)) - COMMON))
        if kind in TERMINAL_EVENTS:
            assert "Terminal." in body, kind
    states = re.search(r"^## The states of a run\n(.*)", text, flags=re.M | re.S).group(1)
    assert re.findall(r"^\| `([a-z]+)` \|", states, flags=re.M) == list(RUN_STATES)
    assert f"now **{SCHEMA_VERSION}**" in text


def test_every_state_has_a_label_in_the_web_ui():
    from ui.views import STATE_LABELS

    assert set(STATE_LABELS) == set(RUN_STATES)


# --------------------------------------------------------------------------- the writer
def test_writer_checks_events_and_stamps_the_version(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path, strict=True)
    with pytest.raises(EventSchemaError, match="unknown event kind 'stpe'"):
        w.emit("stpe", step=1)
    with pytest.raises(EventSchemaError, match="checkpoint: missing field 'path'"):
        w.emit("checkpoint", step=1)
    with pytest.raises(EventSchemaError, match="checkpoint: field 'step' is '1', not int"):
        w.emit("checkpoint", step="1", path="p")
    with pytest.raises(EventSchemaError, match="fields not in the schema: extra"):
        w.emit("checkpoint", step=1, path="p", extra=2)
    ev = w.emit("eval", step=2, eval_loss=float("nan"), eval_ppl=float("inf"))
    assert ev["eval_loss"] is None and ev["eval_ppl"] == "inf"
    ev = w.emit("done", step=2, adapter_dir="a", metrics={"eval_loss": float("nan"), "curve": [float("-inf")]})
    assert ev["metrics"] == {"eval_loss": None, "curve": ["-inf"]}
    w.close()
    assert [e["event"] for e in read_events(path)] == ["eval", "done"]  # nothing invalid was written

    # a user's run: never broken over its progress stream; the event is kept, a warning logged once per kind
    w = EventWriter(path, strict=False)
    with caplog.at_level(logging.WARNING, logger="finetuner.runs.events"):
        w.emit("checkpoint", step=3)
        w.emit("checkpoint", step=4)
        w.emit("checkpoint", step=5, path="p", extra=1)  # an extra field is fine
    w.close()
    assert [r.getMessage() for r in caplog.records] == [
        "Event 'checkpoint' does not follow the events schema: checkpoint: missing field 'path'"]
    assert [e["step"] for e in read_events(path) if e["event"] == "checkpoint"] == [3, 4, 5]


def test_a_real_run_writes_valid_events_that_the_docs_example_follows(recipe_dict, tmp_path):
    """A short run in a thread while the docs' example follows it: every event valid, the version in start."""
    run_dir = tmp_path / "run"
    recipe = Recipe.from_dict(recipe_dict, overrides=["training.max_steps=4", "training.eval_every=2", "data.val_size=8",
                                                      "samples.prompts=['What should I bring?']", "samples.max_new_tokens=4"])
    code = re.search(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S).group(1)
    assert code.count('"runs/demo_cpu"') == 2
    code = code.replace('"runs/demo_cpu"', repr(str(run_dir)))
    result = {}
    trainer = threading.Thread(target=lambda: result.update(r=finetuner.train(recipe)))
    out = io.StringIO()
    trainer.start()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(DOCS), "exec"), {})
    finally:
        trainer.join(300)
    assert result["r"].metrics["steps"] == 4
    printed = out.getvalue().splitlines()
    assert printed[0] == "test: 4 steps on cpu"
    assert [ln.split()[1] for ln in printed[1:5]] == ["1/4", "2/4", "3/4", "4/4"] and "loss" in printed[1]
    assert printed[-1] == "state: done"

    events = read_events(run_dir / "events.jsonl")
    kinds = [e["event"] for e in events if e["event"] != "phase"]
    assert kinds[0] == "start" and kinds[-2:] == ["done", "samples"] and {"step", "eval", "checkpoint"} <= set(kinds)
    # every phase between the steps said, each ended, in the order the run meets them (finetuner.phases)
    said = [(e["phase"], e["state"]) for e in events if e["event"] == "phase" and e["state"] != "progress"]
    order = [p for p, state in said if state == "start"]
    assert order[:2] == ["tokenize", "load"] and order[-2:] == ["probe", "samples"] if "probe" in order else order[-1] == "samples"
    assert {"eval", "checkpoint", "save"} <= set(order)
    assert all(said[i + 1] == (p, "end") for i, (p, state) in enumerate(said) if state == "start")  # none nested
    first = next(e for e in events if e["event"] == "phase" and e["phase"] == "tokenize" and e["state"] == "end")
    data = events[[e["event"] for e in events].index("start")]["data"]
    assert first["done"] == first["total"] == data["rows"] > 0 and first["unit"] == "rows"  # every row the file has
    evals = [e for e in events if e["event"] == "phase" and e["phase"] == "eval" and e["state"] == "end"]
    assert [e["done"] for e in evals] == [8, 8]  # the 8 held-out rows, at step 2 and at the end
    # the generations' tokens counted as they came (finetuner.token_progress): the one sample prompt answered by the
    # fine-tune and the base, at most samples.max_new_tokens (4) each; a phase that generates nothing counts none
    samples = next(e for e in events if e["event"] == "phase" and e["phase"] == "samples" and e["state"] == "end")
    assert 2 <= samples["tokens"] <= 2 * 4
    assert first["tokens"] is None
    for ev in events:
        assert validate_event(ev, allow_extra=False) == [], ev
    assert data is not None and next(e for e in events if e["event"] == "start")["schema_version"] == SCHEMA_VERSION
    assert run_state(events, busy=False) == "done"
    assert finetuner.load_run(run_dir).status == "done" == jobs.run_status(run_dir).state


# --------------------------------------------------------------------------- the states
def E(*kinds: str) -> list[dict]:
    return [{"event": k} for k in kinds]


STATE_CASES = [
    # events, state when no process holds the folder, state while one does
    (E(), "new", "starting"),
    (E("plan"), "interrupted", "starting"),
    (E("plan", "checkpoint_invalid", "start", "step"), "interrupted", "running"),
    (E("start", "step", "done"), "done", "finishing"),
    (E("start", "step", "done", "samples"), "done", "finishing"),
    (E("start", "step", "stopped"), "stopped", "finishing"),
    (E("start", "step", "error"), "error", "finishing"),
    (E("error"), "error", "finishing"),  # failed before training began
    (E("start", "done", "error"), "error", "finishing"),  # the samples after done failed
    (E("start", "stopped", "plan"), "interrupted", "starting"),  # a resume began, no start yet
    (E("start", "stopped", "start", "step"), "interrupted", "running"),
    (E("start", "stopped", "start", "step", "done"), "done", "finishing"),
]


@pytest.mark.parametrize("events, idle, busy", STATE_CASES)
def test_run_state(events, idle, busy):
    assert run_state(events, busy=False) == idle
    assert run_state(events, busy=True) == busy
    assert {idle, busy} <= set(RUN_STATES)


def test_the_run_folder_readers_agree_on_the_state(tmp_path):
    """``Run.status`` and the web UI's ``run_status`` give the same state for the same folder, idle and locked."""
    for i, (events, idle, busy) in enumerate(STATE_CASES):
        rd = tmp_path / f"r{i}"
        rd.mkdir()
        (rd / "recipe.yaml").write_text("name: r\n")
        (rd / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        assert finetuner.load_run(rd).status == jobs.run_status(rd, tmp_path).state == idle, events
        lock = RunLock(rd).acquire()
        try:
            st = jobs.run_status(rd, tmp_path)
            assert finetuner.load_run(rd).status == st.state == busy, events
            assert st.running and not st.resumable
        finally:
            lock.release()


def test_stop_a_run_started_outside_the_ui(tmp_path):
    """A process holding the run folder without a job (``finetuner run`` in a terminal) shows as running and stops on request."""
    rd = tmp_path / "runs" / "cli-run"
    rd.mkdir(parents=True)
    script = (
        "import signal, sys, time\n"
        "from finetuner.runs.folder import RunLock\n"
        f"lock = RunLock({str(rd)!r}).acquire()\n"
        "signal.signal(signal.SIGINT, lambda *a: sys.exit(130))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "ready"
        st = jobs.run_status(rd, tmp_path / "runs")
        assert (st.state, st.running, st.pid) == ("starting", True, proc.pid)
        assert jobs.stop_job(rd, tmp_path / "runs", wait=10)
        assert proc.wait(HANG_GUARD_S) == 130
        assert jobs.run_status(rd, tmp_path / "runs").state == "new"
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- following
def test_follow_a_file_that_grows_while_it_is_read(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    events = [{"event": "start", "n": 0}] + [{"event": "step", "step": i} for i in range(1, 30)] + [{"event": "done"}]
    late = {"event": "samples", "samples": []}
    lock = RunLock(rd).acquire()
    seen: list[dict] = []
    reader = threading.Thread(target=lambda: seen.extend(follow(rd, poll=0.005)), daemon=True)
    reader.start()  # before the file exists
    time.sleep(0.05)
    with open(rd / "events.jsonl", "w", encoding="utf-8") as f:
        for ev in events:
            line = json.dumps(ev) + "\n"
            f.write(line[:7])  # a line arrives in pieces: never yielded half-written
            f.flush()
            time.sleep(0.002)
            f.write(line[7:])
            f.flush()
        time.sleep(0.1)  # after done, the process still holds the folder: the follower waits
        assert reader.is_alive()
        f.write(json.dumps(late) + "\n")
    lock.release()
    reader.join(10)
    assert not reader.is_alive()
    assert seen == events + [late]


def test_follow_from_an_offset_until_stopped(tmp_path):
    """How the multi-process launcher relays rank 0's events: from where this launch began, until it says stop."""
    rd = tmp_path / "run"
    rd.mkdir()
    path = rd / "events.jsonl"
    path.write_text(json.dumps({"event": "start"}) + "\n" + json.dumps({"event": "stopped"}) + "\n")
    offset = path.stat().st_size
    lock = RunLock(rd).acquire()  # the launcher holds the folder the whole time
    stop = threading.Event()
    seen: list[dict] = []
    reader = threading.Thread(target=lambda: seen.extend(follow(path, poll=0.01, offset=offset, stop=stop)), daemon=True)
    reader.start()
    with open(path, "a", encoding="utf-8") as f:
        for ev in ({"event": "plan"}, {"event": "start"}, {"event": "step", "step": 1}, {"event": "done"}):
            f.write(json.dumps(ev) + "\n")
            f.flush()
            time.sleep(0.02)
    time.sleep(0.1)
    assert reader.is_alive()  # the end was read, but the folder is held: it goes on until stopped
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "samples", "samples": []}) + "\n")
    stop.set()  # the last lines written before the stop are still read
    reader.join(5)
    lock.release()
    assert [e["event"] for e in seen] == ["plan", "start", "step", "done", "samples"]


def test_follow_gives_up_after_timeout(tmp_path):
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
    t0 = time.monotonic()
    assert [e["event"] for e in follow(tmp_path, poll=0.01, timeout=0.2)] == ["start"]
    assert time.monotonic() - t0 < 5


def test_the_schema_takes_the_runs_wait_by_part():
    """The done event's predicted and measured wait (finetuner.planning.wait, finetuner.training.prediction.measured_wait) and the
    samples event's time; a wait that is not an object is refused."""
    from finetuner.runs.schema import validate_event

    parts = {"load": 6.1, "steps": 24.0, "evaluations": 0.3, "checkpoints": 0.2, "samples": 0.0, "total": 31.0}
    done = {"event": "done", "time": 1.0, "step": 150, "adapter_dir": "a", "metrics": {}, "predicted_wait_s": {**parts, "download": 0.0},
            "measured_wait_s": parts}
    assert validate_event(done, allow_extra=False) == []
    assert validate_event({**done, "predicted_wait_s": None}, allow_extra=False) == []
    assert validate_event({**done, "measured_wait_s": [1.0]}, allow_extra=False)
    samples = {"event": "samples", "time": 1.0, "samples": [], "samples_s": 1.2}
    assert validate_event(samples, allow_extra=False) == []


def test_the_ui_status_shows_the_phase_running_between_the_steps(tmp_path):
    """The web UI's status reads the running phase from the events (a line), and drops it once the phase ended."""
    from ui.run_views import status_html

    rd = tmp_path / "runs" / "r"
    rd.mkdir(parents=True)
    (rd / "recipe.yaml").write_text("name: r\n")
    load = {"event": "phase", "phase": "load", "label": "loading the model", "done": 0, "total": None, "unit": "",
            "eta_s": 30.0, "eta_from": "planned"}
    events = [{**load, "state": "start", "elapsed_s": 0.0}, {**load, "state": "progress", "elapsed_s": 12.0, "eta_s": 18.0}]
    (rd / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lock = RunLock(rd).acquire()
    try:
        st = jobs.run_status(rd, tmp_path / "runs")
        assert st.state == "starting" and st.phase == "loading the model: 0:00:12 so far, ETA 0:00:18 (planned)"
        assert st.phase in status_html(st)
        with open(rd / "events.jsonl", "a") as f:
            f.write(json.dumps({**load, "state": "end", "elapsed_s": 13.0, "eta_s": 0.0, "eta_from": "measured"}) + "\n")
        st = jobs.run_status(rd, tmp_path / "runs")
        assert st.phase is None and "loading the model" not in status_html(st)
    finally:
        lock.release()

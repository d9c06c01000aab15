"""How a failure crosses a process: the worker protocol (finetuner.worker_protocol), and where a run
that fails before it writes any event records its error (finetuner.runs.folder.record_early_failure)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import finetuner.worker_protocol as protocol
from finetuner.errors import OutOfMemory, UserError
from finetuner.runs.events import read_events
from finetuner.runs.folder import RunFolderRefused, RunLock, events_size, record_early_failure
from finetuner.run_marker import mark_run_folder
from finetuner.runs.schema import validate_event
from tests.conftest import HANG_GUARD_S


def test_an_error_crosses_the_process_as_it_was_raised():
    msg = protocol.error_message(UserError("data.path: file not found", hint="Check the path."), id=3)
    assert protocol.decode(protocol.encode(msg)) == msg
    assert msg == {"kind": "error", "id": 3, "message": "data.path: file not found", "hint": "Check the path.",
                   "type": "UserError", "user_error": True}
    with pytest.raises(UserError) as caught:
        protocol.raise_error(msg)
    assert (caught.value.message, caught.value.hint) == ("data.path: file not found", "Check the path.")
    assert protocol.error_fields(OutOfMemory("too big"))["type"] == "OutOfMemory"
    bug = protocol.error_message(ValueError("boom"))
    assert bug["user_error"] is False and bug["message"] == "ValueError: boom"
    with pytest.raises(RuntimeError, match="ValueError: boom"):
        protocol.raise_error(bug)
    assert protocol.error_text(msg) == "data.path: file not found\nCheck the path."
    for junk in ("not json", "[1, 2]", '{"kind": "chatter"}', '{"ready": true}'):
        assert protocol.decode(junk) is None
    with pytest.raises(ValueError, match="unknown worker message kind"):
        protocol.message("finished")


def test_a_full_disk_crosses_the_process_said_with_the_space_free_when_it_is_reported(small_disk):
    """A :class:`DiskFull` keeps what it was made of (the write, what comes next, the space that needs), and the
    caller says it again with what is free when it reports it (the launcher of a multi-process run, once it has
    removed the checkpoint its ranks were writing): on a real small disk (tests/small_disk.py), first full, then not."""
    from finetuner.fileio import DiskFull, size_text
    from tests.small_disk import PAGE, fill, free

    filler = fill(small_disk, leave=10 * PAGE)
    raised = DiskFull(small_disk / "run" / ".tmp-step-00000002", "resume", 20 * 2**20)
    assert raised.message == f"No space left on device while writing {small_disk}/run/.tmp-step-00000002 (40.0 KiB free)."
    msg = protocol.decode(protocol.encode(protocol.error_message(raised, rank=1)))
    assert msg["type"] == "DiskFull" and msg["user_error"] and msg["rank"] == 1
    filler.unlink()
    again = protocol.error_of(msg)
    assert isinstance(again, DiskFull)
    assert again.message == f"No space left on device while writing {small_disk}/run/.tmp-step-00000002 ({size_text(free(small_disk))} free)."
    assert again.hint == (f"Free at least {size_text(20 * 2**20 - free(small_disk))} more on that disk (20.0 MiB free in all), "
                          "then resume.")
    again.add_hint("The ranks' output is in X.")  # what the reporting side knows and the raising side did not
    assert again.hint.endswith("then resume.\nThe ranks' output is in X.") and str(again) == f"{again.message}\n{again.hint}"
    assert isinstance(protocol.error_of(protocol.error_message(OutOfMemory("too big"))), OutOfMemory)  # exit status 3


def test_a_worker_reports_on_stdout_and_library_prints_go_to_stderr():
    """The worker side (take_stdout, Sender) and the caller's (Receiver) over a real pipe: a print from
    a library inside the worker cannot corrupt the stream; the end of the stream is None."""
    script = (
        "import finetuner.worker_protocol as p\n"
        "out = p.take_stdout()\n"
        "print('a library chatting')\n"
        "out.send('started', describe='model')\n"
        "out.send('progress', id=1, token='Hel')\n"
        "out.error(ValueError('boom'), id=1)\n"
        "out.send('done', id=2)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    received = protocol.Receiver(proc.stdout)
    got = []
    while (msg := received.get(60)) is not None:
        got.append(msg)
    assert proc.wait(HANG_GUARD_S) == 0 and "a library chatting" in proc.stderr.read()
    assert [(m["kind"], m.get("id")) for m in got] == [("started", None), ("progress", 1), ("error", 1), ("done", 2)]
    assert got[2]["message"] == "ValueError: boom"


def test_a_report_file_holds_the_failures_of_a_job(tmp_path):
    report = tmp_path / "report.jsonl"
    assert protocol.read_report(report) == []
    assert protocol.report_failure(UserError("first"), report) and protocol.report_failure(UserError("second", hint="h"), report)
    assert not protocol.report_failure(UserError("nowhere"), None)
    with open(report, "a") as f:
        f.write('{"kind": "error", "message": "cut sh')  # a process killed mid-line: not a message
    assert [m["message"] for m in protocol.read_report(report)] == ["first", "second"]


def _run_folder(path):
    path.mkdir(parents=True)
    mark_run_folder(path)
    (path / "recipe.yaml").write_text("name: r\n")
    return path


def test_an_early_failure_is_recorded_in_the_run_folder(tmp_path):
    run = _run_folder(tmp_path / "run")
    before = events_size(run)
    assert record_early_failure(run, UserError("model.name: no config.json", hint="Give a model folder."), before)
    (event,) = read_events(run / "events.jsonl")
    assert validate_event(event) == []
    assert (event["event"], event["type"], event["user_error"]) == ("error", "UserError", True)
    assert event["message"] == "model.name: no config.json\nGive a model folder."  # the text the CLI prints
    assert not RunLock(run).acquire().release()  # the lock taken to write it is given back


def test_an_early_failure_is_not_written_where_it_does_not_belong(tmp_path):
    error = UserError("the planner refused")
    mine = tmp_path / "mine"  # a folder of the user's
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    missing = tmp_path / "not-made-yet"
    refused = _run_folder(tmp_path / "refused")
    finished = _run_folder(tmp_path / "finished")
    (finished / "adapter").mkdir()
    held = _run_folder(tmp_path / "held")
    moved_on = _run_folder(tmp_path / "moved-on")
    before = events_size(moved_on)
    (moved_on / "events.jsonl").write_text('{"event": "error", "time": 1, "message": "its own", "type": "UserError", "user_error": true}\n')
    lock = RunLock(held).acquire()  # another finetuner process holds it
    try:
        assert not record_early_failure(mine, error, 0)
        assert not record_early_failure(missing, error, 0)
        assert not record_early_failure(refused, RunFolderRefused("Another finetuner process is using it."), 0)
        assert not record_early_failure(finished, error, 0)  # a finished run is not marked failed by an attempt that never started
        assert not record_early_failure(held, error, 0)
        assert not record_early_failure(moved_on, error, before)  # the run wrote its events, its error among them
    finally:
        lock.release()
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and not missing.exists()
    for run in (refused, finished, held):
        assert not (run / "events.jsonl").exists()
    assert len(read_events(moved_on / "events.jsonl")) == 1


def test_a_run_whose_own_recipe_no_longer_loads_records_why(recipe_dict, alpaca_file, tmp_path):
    """``finetuner run RUN/recipe.yaml -o RUN`` (how the web UI resumes a job) on a stopped run whose data
    file has since been moved: the attempt fails before the recipe loads, and the run's events end with
    that error. Another recipe pointed at the run folder is not that run's attempt: nothing is written."""
    import json

    from finetuner.config.recipe import Recipe
    from tests.conftest import run_cli, write_recipe

    run = _run_folder(tmp_path / "runs" / "stopped")
    r = dict(recipe_dict, output_dir=str(run))
    Recipe.from_dict(r).save(run / "recipe.yaml")
    stopped = [{"event": "start", "time": 1.0, "max_steps": 8}, {"event": "stopped", "time": 2.0, "step": 4, "max_steps": 8}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in stopped))
    alpaca_file.rename(alpaca_file.with_name("moved.json"))
    other = write_recipe(tmp_path / "other.yaml", dict(r, data={"path": str(tmp_path / "nowhere.json")}))
    p = run_cli("run", str(other), "-o", str(run))
    assert p.returncode == 2 and "nowhere.json' does not exist" in p.stderr
    assert read_events(run / "events.jsonl") == stopped
    p = run_cli("run", str(run / "recipe.yaml"), "-o", str(run))
    assert p.returncode == 2 and "does not exist" in p.stderr, p.stderr
    *_, error = read_events(run / "events.jsonl")
    assert error["event"] == "error" and "does not exist" in error["message"] and validate_event(error) == []

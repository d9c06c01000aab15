"""finetuner.phases: the progress of what a run does between its steps, and how the console says it."""

from __future__ import annotations

import io
import os
import threading

import pytest
from rich.console import Console

from finetuner import phases
from finetuner.cli.progress import PhasePrinter, ProgressPrinter, command_phases


class Clock:
    """A clock the test moves (the heartbeat thread reads it too)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_counts_eta_and_the_records_a_phase_writes():
    clock, said = Clock(), []
    with phases.Phase("replay", said.append, total=8, unit="answers", predicted_s=40.0, heartbeat_s=None,
                      clock=clock) as p:
        clock.now += 5
        assert p.eta(clock.now) == (35.0, "planned")  # before the first item: the plan less the time spent
        p.advance(2)  # 5 s since the start record > every_s: said
        clock.now += 1
        p.advance(2)  # 1 s since the last record: not said
        clock.now += 2
        p.advance(2)  # 3 s since the last one: said; 6 done in 8 s, so 2 more take 8/6 x 2
    assert [(r["state"], r["done"]) for r in said] == [("start", 0), ("progress", 2), ("progress", 6), ("end", 8)]
    assert said[1]["eta_s"] == 15.0 and said[1]["eta_from"] == "measured"  # 5 s for 2, 6 left
    assert said[2]["eta_s"] == pytest.approx(8 / 6 * 2, abs=0.05) and said[2]["elapsed_s"] == 8.0
    assert said[-1] == {"phase": "replay", "label": "the base model's replay answers", "state": "end", "done": 8,
                        "total": 8, "unit": "answers", "tokens": None, "elapsed_s": 8.0, "eta_s": 0.0,
                        "eta_from": "measured", "planned_s": 40.0}
    assert phases.current() is None  # closed


def test_the_last_item_is_always_said_and_a_failed_phase_says_no_end():
    clock, said = Clock(), []
    with phases.Phase("probe", said.append, total=2, heartbeat_s=None, clock=clock) as p:
        p.advance(2)  # no time passed, but it is the last item
    assert [r["state"] for r in said] == ["start", "progress", "end"]
    said.clear()
    with pytest.raises(RuntimeError):
        with phases.Phase("eval", said.append, total=4, heartbeat_s=None, clock=clock):
            raise RuntimeError("boom")
    assert [r["state"] for r in said] == ["start"]  # the error is what the user reads


def test_deep_code_reports_to_the_phase_its_thread_opened():
    clock, said = Clock(), []
    phases.advance(3)  # outside any phase: nothing, no error
    with phases.Phase("tokenize", said.append, unit="rows", heartbeat_s=None, clock=clock):
        phases.expect(10)  # a total learnt as the work goes (datasets.map's rows)
        other = threading.Thread(target=phases.advance, args=(5,))  # another thread opened no phase
        other.start()
        other.join()
        clock.now += 3
        phases.Advance()(4)  # the picklable form a datasets.map function holds
        with phases.Phase("load", said.append, heartbeat_s=None, clock=clock):  # a phase inside a phase
            phases.advance(1)
        phases.advance(6)
    tokenize = [r for r in said if r["phase"] == "tokenize"]
    assert [(r["state"], r["done"], r["total"]) for r in tokenize] == [("start", 0, None), ("progress", 4, 10),
                                                                       ("progress", 10, 10), ("end", 10, 10)]
    assert [r["done"] for r in said if r["phase"] == "load"][-1] == 1


def test_a_forked_worker_reports_nothing(tmp_path):
    """A datasets worker process is forked with the phase's state: its counts must not reach the parent's sink."""
    out = tmp_path / "said"

    def sink(rec):
        with open(out, "a") as f:
            f.write(f"{os.getpid()} {rec['state']} {rec['done']}\n")

    clock = Clock()
    with phases.Phase("tokenize", sink, total=10, heartbeat_s=None, clock=clock):
        pid = os.fork()
        if pid == 0:  # the child: a worker's map function advancing
            clock.now += 10
            phases.advance(10)
            os._exit(0)
        os.waitpid(pid, 0)
    lines = out.read_text().splitlines()
    assert [ln.split()[1:] for ln in lines] == [["start", "0"], ["end", "10"]]
    assert {ln.split()[0] for ln in lines} == {str(os.getpid())}


def heard():
    """The records a phase says (``said``), an event set at its first progress record (``seen``), and the sink that
    keeps them."""
    said, seen = [], threading.Event()

    def sink(rec):
        said.append(rec)
        if rec["state"] == "progress":
            seen.set()

    return said, seen, sink


def test_a_blocking_call_gets_heartbeat_lines():
    """A model's load is one call: the heartbeat thread says the phase every heartbeat_s of silence."""
    clock, (said, seen, sink) = Clock(), heard()

    with phases.Phase("load", sink, predicted_s=30.0, heartbeat_s=0.05, clock=clock):
        clock.now += 12  # the blocking call has run 12 s
        assert seen.wait(10)  # the heartbeat thread noticed (it polls every heartbeat_s / 4 of real time)
    beat = next(r for r in said if r["state"] == "progress")
    assert beat["elapsed_s"] == 12.0 and beat["eta_s"] == 18.0 and beat["eta_from"] == "planned"
    assert said[-1]["state"] == "end"


def test_a_phase_past_its_plan_says_it_is_slower_than_planned():
    """The issue's replay: 12 answers in one batch, planned 9.4 s, still generating after 6 minutes. Its ETA is not
    0:00:00 (planned) but "slower than planned", with the plan's seconds; the tokens it generated meanwhile move."""
    clock, said = Clock(), []
    out = io.StringIO()
    printer = PhasePrinter(Console(file=out, width=200), None)

    def sink(rec):
        said.append(rec)
        printer(rec)

    with phases.Phase("replay", sink, total=12, unit="answers", predicted_s=9.4, heartbeat_s=None, clock=clock) as p:
        clock.now += 9.0
        assert p.eta(clock.now) == (pytest.approx(0.4), "planned")  # within its plan
        p.generated(12)  # a decoding step of the batch: one token for each of its 12 rows
        clock.now += 0.5
        assert p.eta(clock.now) == (None, "past_plan")  # 9.5 s of a planned 9.4
        clock.now += 352.5
        p.generated(11)  # 6 minutes in, one row has ended
        clock.now += 1
        p.generated(11)  # 1 s since the last record (< every_s): counted, not said
        assert p.tokens == 34
        clock.now += 20
        p.advance(12)
    late = said[2]
    assert (late["state"], late["done"], late["tokens"], late["elapsed_s"]) == ("progress", 0, 23, 362.0)
    assert late["eta_s"] is None and late["eta_from"] == "past_plan" and late["planned_s"] == 9.4
    assert phases.line(late) == ("the base model's replay answers: 0/12 answers (23 tokens), slower than planned: "
                                 "0:06:02 so far, planned 9.4 s")
    assert phases.eta_text(late) == "- (slower than the planned 9.4 s)"  # the bar's ETA column
    assert said[-1]["tokens"] == 34 and said[-1]["state"] == "end"  # the answers, then the end, carry the count
    assert out.getvalue().splitlines() == [
        "the base model's replay answers: 0/12 answers (12 tokens), 0:00:09 so far, ETA 0:00:00 (planned)",
        "the base model's replay answers: 0/12 answers (23 tokens), slower than planned: 0:06:02 so far, planned 9.4 s",
        "the base model's replay answers: 12/12 answers (34 tokens), 0:06:23 so far, ETA 0:00:00",
        "the base model's replay answers: done, 12 answers (34 tokens) in 0:06:23"]


def test_a_heartbeat_past_the_plan_says_so_too():
    """A blocking call past its plan (no count at all): the heartbeat's line says slower than planned, not ETA 0."""
    clock, (said, seen, sink) = Clock(), heard()

    with phases.Phase("load", sink, predicted_s=30.0, heartbeat_s=0.05, clock=clock):
        clock.now += 45
        assert seen.wait(10)
    beat = next(r for r in said if r["state"] == "progress")
    assert phases.line(beat) == "loading the model: slower than planned: 0:00:45 so far, planned 30 s"


def test_a_library_that_hides_its_stderr_does_not_hide_the_heartbeat(monkeypatch):
    """The GGUF check wraps transformers' loader in contextlib.redirect_stderr (its tqdm bar): a command's phase
    lines said meanwhile still reach the command's stderr (the console writes to the stderr it began with)."""
    import contextlib
    import time

    monkeypatch.setattr(phases, "HEARTBEAT_S", 0.05)
    command_err, hidden = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(command_err):  # the command's stderr (a pipe, a log)
        with command_phases() as printer:
            printer.QUIET_S = printer.EVERY_S = 0.0  # every heartbeat a line
            with phases.phase("verify", label="checking the GGUF file with transformers' loader"):
                with contextlib.redirect_stderr(hidden):  # the library's call
                    deadline = time.monotonic() + 10
                    while "so far" not in command_err.getvalue() and time.monotonic() < deadline:
                        time.sleep(0.01)
    assert "checking the GGUF file with transformers' loader: 0:00:00 so far" in command_err.getvalue()
    assert "so far" not in hidden.getvalue()


def test_lines_say_count_time_and_eta():
    rec = {"phase": "replay", "label": "the base model's replay answers", "state": "progress", "done": 32, "total": 64,
           "unit": "answers", "elapsed_s": 41.2, "eta_s": 40.0, "eta_from": "measured"}
    assert phases.line(rec) == "the base model's replay answers: 32/64 answers, 0:00:41 so far, ETA 0:00:40"
    assert phases.line({**rec, "state": "end", "done": 64, "elapsed_s": 81}) == \
        "the base model's replay answers: done, 64 answers in 0:01:21"
    load = {**rec, "label": "loading the model", "done": 0, "total": None, "unit": "", "eta_s": 18.0, "eta_from": "planned"}
    assert phases.line(load) == "loading the model: 0:00:41 so far, ETA 0:00:18 (planned)"
    assert phases.line({**load, "eta_s": None, "eta_from": None}).endswith("ETA -")


def test_off_a_terminal_short_phases_stay_silent_and_long_ones_say_a_line_every_ten_seconds():
    out = io.StringIO()
    printer = PhasePrinter(Console(file=out, width=200), None)
    base = {"phase": "load", "label": "loading the model", "total": None, "unit": "", "done": 0, "eta_s": None,
            "eta_from": None}
    printer({**base, "state": "start", "elapsed_s": 0.0})
    printer({**base, "state": "end", "elapsed_s": 1.0})  # a short phase: nothing
    assert out.getvalue() == ""
    printer({**base, "state": "start", "elapsed_s": 0.0})
    for t in (2.0, 4.0, 10.0, 14.0, 24.0):
        printer({**base, "state": "progress", "elapsed_s": t})
    printer({**base, "state": "end", "elapsed_s": 25.0})
    lines = out.getvalue().splitlines()
    assert lines == ["loading the model: 0:00:04 so far, ETA -", "loading the model: 0:00:14 so far, ETA -",
                     "loading the model: 0:00:24 so far, ETA -", "loading the model: done, in 0:00:25"]


def test_on_a_terminal_each_phase_is_a_bar_below_the_training_bar():
    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=200, color_system=None)
    rec = {"event": "phase", "phase": "eval", "label": "evaluation", "total": 20, "unit": "rows", "done": 0,
           "elapsed_s": 0.0, "eta_s": 4.0, "eta_from": "planned"}
    start = {"event": "start", "name": "n", "device": "cpu", "method": "lora", "trainable_params": 1,
             "total_params": 2, "max_steps": 10, "run_dir": "r"}
    with ProgressPrinter(con) as printer:
        printer(start)
        printer({**rec, "state": "start"})
        tasks = printer.progress.tasks
        assert [t.description for t in tasks] == ["train", "evaluation"]
        assert tasks[1].total == 20 and tasks[1].fields["eta"] == "0:00:04 (planned)"
        printer({**rec, "state": "progress", "done": 10, "elapsed_s": 1.0, "eta_s": 1.0, "eta_from": "measured"})
        assert tasks[1].completed == 10 and tasks[1].fields["eta"] == "0:00:01"
        printer({**rec, "state": "end", "done": 20, "elapsed_s": 2.0, "eta_s": 0.0, "eta_from": "measured"})
        assert [t.description for t in printer.progress.tasks] == ["train"]  # gone once done
    assert "evaluation" in out.getvalue()


def test_a_command_phase_goes_where_its_front_reports():
    said = []
    with phases.phase("merge", total=2, unit="tensors") as p:  # no front: nowhere, no heartbeat thread
        p.advance(2)
        assert p.heartbeat_s is None
    with phases.reporting(said.append):
        with phases.phase("export", total=3, unit="tensors"):
            phases.advance(3)
        seen = []
        with phases.reporting(seen.append), phases.phase("merge"):  # an inner front, then the outer one again
            pass
        with phases.phase("merge"):
            pass
    assert [(r["phase"], r["state"]) for r in said] == [("export", "start"), ("export", "progress"), ("export", "end"),
                                                        ("merge", "start"), ("merge", "end")]
    assert [r["state"] for r in seen] == ["start", "end"]


def test_measuring_a_data_file_is_a_phase_counting_its_rows():
    """The plan's and a run's auto values read the whole file first (tens of seconds for a large one): said too."""
    import json
    from pathlib import Path

    from finetuner.data.stats import profile_data

    repo = Path(__file__).resolve().parents[1]
    data = repo / "data" / "alpaca_sample.json"
    said = []
    with phases.reporting(said.append):
        profile = profile_data(str(data), str(repo / "data" / "demo_model"))
    ends = [r for r in said if r["phase"] == "measure" and r["state"] == "end"]
    assert len(ends) == 1 and ends[0]["done"] == len(json.loads(data.read_text())) == profile.rows

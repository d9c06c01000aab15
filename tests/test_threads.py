"""torch's threads chosen for the machine as it is (finetuner/threads.py): the rule in numbers (cores, load, the
environment, the recipe's value → threads and the reason), bad values refused in one line, the run queue read while
two busy-loop processes keep cores busy, and a run's start line, start event and metrics.json stating the choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import finetuner.threads as threads
from finetuner.errors import UserError
from finetuner.runs.events import read_events
from tests.conftest import cli_in_process, write_recipe

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """The choices these tests make set torch's threads in this process: put back after each."""
    before, chosen = torch.get_num_threads(), dict(threads._chosen)
    yield
    torch.set_num_threads(before)
    threads._chosen.clear()
    threads._chosen.update(chosen)


@pytest.mark.parametrize("cores, load, threads_, words", [
    (2, 0.0, 2, "load 0.0: the cores are free"),
    (2, 0.4, 2, "load 0.4: the cores are mostly free"),
    (2, 0.5, 1, "load 0.5: other processes keep 1 of the 2 cores busy"),  # a core busy half the time is taken
    (2, 1.0, 1, "load 1.0: other processes keep 1 of the 2 cores busy"),
    (2, 1.5, 1, "load 1.5: other processes keep the cores busy"),
    (2, 6.4, 1, "load 6.4: other processes keep the cores busy"),
    (1, 3.0, 1, "load 3.0: other processes keep the cores busy"),
    (8, 3.0, 5, "load 3.0: other processes keep 3 of the 8 cores busy"),
    (8, 2.6, 5, "load 2.6: other processes keep 3 of the 8 cores busy"),
    (8, 2.4, 6, "load 2.4: other processes keep 2 of the 8 cores busy"),
    (8, 20.0, 1, "load 20.0: other processes keep the cores busy"),
])
def test_auto_takes_the_cores_other_processes_leave_free(cores, load, threads_, words):
    c = threads.decide("auto", cores, load, env={})
    assert (c.threads, c.source, c.reason, c.auto_threads) == (threads_, "auto", words, threads_)
    assert c.line() == f"threads: {threads_} of {cores} core{'s' if cores > 1 else ''} ({words})"
    assert threads.decide(None, cores, load, env={}) == c  # no recipe value: auto


def test_the_recipe_then_omp_num_threads_win_over_auto_and_say_what_auto_would_take():
    c = threads.decide(2, 2, 6.4, env={"OMP_NUM_THREADS": "1"})  # the recipe's number first
    assert (c.threads, c.source, c.auto_threads) == (2, "training.threads", 1)
    assert c.line() == "threads: 2 of 2 cores (training.threads; at load 6.4 auto would take 1)"
    c = threads.decide("auto", 2, 6.4, env={"OMP_NUM_THREADS": "2"})
    assert (c.threads, c.source) == (2, "OMP_NUM_THREADS")
    assert c.reason == "OMP_NUM_THREADS=2; at load 6.4 auto would take 1"
    c = threads.decide("auto", 2, 0.0, env={"OMP_NUM_THREADS": "2,1"})  # nested levels: the first is torch's
    assert (c.threads, c.reason) == (2, "OMP_NUM_THREADS=2; load 0.0")
    assert threads.decide("auto", 2, 0.0, env={"OMP_NUM_THREADS": " "}).source == "auto"  # blank: unset
    assert c.to_dict() == {"threads": 2, "cores": 2, "load": 0.0, "source": "OMP_NUM_THREADS",
                           "reason": "OMP_NUM_THREADS=2; load 0.0", "auto_threads": 2}


def test_bad_values_are_refused_in_one_line(monkeypatch):
    with pytest.raises(UserError, match=r"^OMP_NUM_THREADS=many: not a number of threads\."):
        threads.decide("auto", 2, 0.0, env={"OMP_NUM_THREADS": "many"})
    with pytest.raises(UserError, match=r"^OMP_NUM_THREADS=0: "):
        threads.decide("auto", 2, 0.0, env={"OMP_NUM_THREADS": "0"})
    for bad in ("busy", "-1", "nan", "inf"):
        monkeypatch.setenv(threads.LOAD_ENV, bad)
        with pytest.raises(UserError, match=rf"^FINETUNER_LOAD={bad}: not a load"):
            threads.measured_load()
    monkeypatch.setenv(threads.LOAD_ENV, "2.5")
    assert threads.measured_load() == 2.5


@pytest.mark.parametrize("value, shown", [("0", "0"), ("two", "'two'"), ("1.5", "1.5"), ("-2", "-2")])
def test_the_recipe_key_is_validated(value, shown):
    r = cli_in_process("estimate", str(REPO / "recipes" / "demo_cpu.yaml"), "--set", f"training.threads={value}")
    assert r.returncode != 0
    assert f"- training.threads: must be a whole number ≥ 1 (or auto); got {shown}." in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_the_run_queue_counts_two_busy_loops_and_auto_leaves_their_cores(monkeypatch):
    """A real load: two processes that never wait keep two tasks in the run queue from the moment they start
    (the 1-minute load average would take a minute to show them)."""
    monkeypatch.delenv(threads.LOAD_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.2)  # started
        choice = threads.for_phase("train")
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()
    cores = threads.cores()
    assert choice.load >= 1.8, choice  # both loops, and whatever else the machine runs
    assert choice.threads == threads.auto_threads(cores, choice.load) <= max(1, cores - 2)
    assert torch.get_num_threads() == choice.threads and threads.current() == choice


def test_a_run_states_its_threads_in_its_start_line_event_and_metrics(recipe_dict, tmp_path, monkeypatch):
    cores = threads.cores()
    load = cores * 3.2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    recipe_dict["training"]["max_steps"] = 2
    recipe_dict["samples"] = {"prompts": ["Say hi."], "max_new_tokens": 4}
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict)
    r = cli_in_process("run", str(recipe), env={threads.LOAD_ENV: str(load)})
    assert r.returncode == 0, r.stderr
    line = f"threads: 1 of {cores} core{'s' if cores > 1 else ''} (load {load:.1f}: other processes keep the cores busy)"
    assert line in r.stdout, r.stdout
    run = Path(recipe_dict["output_dir"])
    start = next(e for e in read_events(run / "events.jsonl") if e["event"] == "start")
    assert start["threads"] == {"threads": 1, "cores": cores, "load": round(load, 2), "source": "auto",
                                "reason": f"load {load:.1f}: other processes keep the cores busy", "auto_threads": 1}
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["threads"]["train"] == start["threads"]
    assert metrics["threads"]["samples"]["threads"] == 1  # the samples chose theirs as they began (after done)
    # the load note counts the run's own thread with the other processes' load
    note = (start["predicted_speed"] or {}).get("load_note") or ""
    assert f"other processes {load:.1f}, this run's 1 thread" in note, note
    # the recipe's number wins, and the line says what auto would have taken
    r = cli_in_process("run", str(recipe), "-o", str(tmp_path / "two"), "--set", "training.threads=2",
                       env={threads.LOAD_ENV: str(load)})
    assert r.returncode == 0, r.stderr
    assert (f"threads: 2 of {cores} core{'s' if cores > 1 else ''} (training.threads; at load {load:.1f} auto would "
            "take 1)") in r.stdout, r.stdout


def test_a_slow_run_says_the_load_now_against_the_one_its_threads_were_chosen_for(monkeypatch):
    chosen_idle = threads.decide("auto", 2, 0.0, env={})
    forced = threads.decide(2, 2, 0.0, env={})
    monkeypatch.setenv(threads.LOAD_ENV, "6.4")  # busy since the start
    assert threads.slow_words(chosen_idle) == (" Other processes' load is 6.4 now; the run's threads (2) were chosen at load "
                                               "0.0 (auto). At this load 1 thread would be faster: the next run chooses again.")
    assert threads.slow_words(forced).endswith("(training.threads). At this load 1 thread would be faster: set "
                                               "training.threads: auto (or 1).")
    monkeypatch.setenv(threads.LOAD_ENV, "0")  # not the threads: nothing to change
    assert threads.slow_words(chosen_idle) == " Other processes' load is 0.0 now; the run's threads (2) were chosen at load 0.0 (auto)."


def test_the_benchmarks_page_shows_the_recorded_threads_table():
    """docs/benchmarks.md holds scripts/bench/threads.py's table of docs/bench_threads.json as recorded."""
    from scripts.bench.threads import CASES, table

    doc = json.loads((REPO / "docs" / "bench_threads.json").read_text(encoding="utf-8"))
    assert [(r["load"], r["threads_asked"]) for r in doc["rows"]] == list(CASES)
    assert table(doc["rows"]) in (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    auto = [r for r in doc["rows"] if r["threads_asked"] == "auto"]
    assert all(r["threads"] == threads.auto_threads(doc["cpus"], r["load_measured"]) for r in auto)  # the rule, as it ran

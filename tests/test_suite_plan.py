"""The test command's plan (tests/suite_plan.py, printed by ``./scripts/test.sh``), its recorded times
(tests/durations.json, ``--record-durations``) and the quick subset (tests/quick.txt, ``./scripts/test.sh --quick``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import suite_plan
from tests.conftest import REPO, HANG_GUARD_S


def test_the_quick_list_names_test_files_whose_recorded_times_keep_it_under_five_minutes():
    """Every line of tests/quick.txt is a test file that exists, once, with a time recorded for it (none counted at
    the median), and laid out on 2 workers of an idle 2-core machine those times end within QUICK_LIMIT_S."""
    files = suite_plan.quick_files()
    assert files and len(set(files)) == len(files), files
    assert [f for f in files if not (f.startswith("tests/") and f.endswith(".py") and (REPO / f).name.startswith("test_")
                                     and (REPO / f).is_file())] == []
    recorded = suite_plan.read()
    assert [f for f in files if f not in recorded["files"]] == []
    selected = {f: recorded["files"][f]["tests"] for f in files}
    plan = suite_plan.predict(selected, workers=2, load=0.0, cores=2, recorded=recorded)
    assert plan.unrecorded == 0 and plan.factor == 1.0
    assert plan.seconds < suite_plan.QUICK_LIMIT_S, plan
    assert not set(files) & set(suite_plan.NEEDS_CPU_ADAM)  # --quick never waits for the DeepSpeedCPUAdam build


def test_the_quick_files_command_prints_the_list_test_sh_runs():
    r = subprocess.run([sys.executable, "-m", "tests.suite_plan", "--quick-files"], cwd=REPO, capture_output=True,
                       text=True, timeout=HANG_GUARD_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == suite_plan.quick_files()
    script = (REPO / "scripts" / "test.sh").read_text(encoding="utf-8")
    assert "python -m tests.suite_plan --quick-files" in script and "--plan" in script


def test_files_are_laid_out_on_the_workers_as_xdist_hands_them_out():
    """Each worker gets two files to start with (the 1st and 3rd, the 2nd and 4th), then one each time it ends one."""
    assert suite_plan.makespan([10, 1, 1, 1], 2) == 11  # 10 then 1 on the first worker; a greedy layout would say 10
    assert suite_plan.makespan([10, 1, 1, 1, 1], 2) == 11  # the fifth goes to the second worker when it ends one
    assert suite_plan.makespan([3, 3, 3], 1) == 9 and suite_plan.makespan([], 2) == 0
    assert suite_plan.makespan([5, 4], 4) == 5  # more workers than files: one file each


def test_the_prediction_counts_missing_files_at_the_median_scales_by_tests_and_by_the_load():
    recorded = {"startup_s": 20.0, "files": {"a": {"tests": 10, "s": 100.0}, "b": {"tests": 4, "s": 40.0},
                                             "c": {"tests": 1, "s": 10.0}}}
    # a: half its tests selected -> 50; b whole -> 40; d unrecorded -> the median 40; one worker: 20 + 130
    p = suite_plan.predict({"a": 5, "b": 4, "d": 7}, workers=1, load=0.5, cores=2, recorded=recorded)
    assert (p.tests, p.files, p.unrecorded, p.median_s, p.idle_s, p.factor) == (16, 3, 1, 40.0, 150.0, 1.0)
    # load 6 before the run on 2 cores, with its 2 workers: 8 tasks on 2 cores, 4x as long as alone
    busy = suite_plan.predict({"a": 10, "b": 4}, workers=2, load=6.0, cores=2, recorded=recorded)
    assert busy.idle_s == 20 + 100 and busy.factor == 4.0 and busy.seconds == 480.0
    lines = suite_plan.plan_text(p)
    assert lines[0] == "plan: 16 tests in 3 files on 1 worker, predicted 2 min 30 s on this machine (load 0.5 on 2 cores)"
    assert suite_plan.plan_text(busy)[0].endswith("predicted 8 min 00 s on this machine (2 min 00 s on idle cores, "
                                                  "x4.0 for load 6.0 on 2 cores)")
    assert "1 file without a recorded time" in lines[1] and "counted at the median 40 s" in lines[1]
    assert len(suite_plan.plan_text(busy)) == 1  # nothing to add: one line
    missing = suite_plan.predict({suite_plan.NEEDS_CPU_ADAM[0]: 3}, 2, 0.0, 2, recorded, cpu_adam_built=False)
    assert "DeepSpeedCPUAdam is not built yet" in suite_plan.plan_text(missing)[1]


def test_recording_merges_and_takes_the_load_out(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"files": {"old": {"tests": 2, "s": 7.0}, "a": {"tests": 1, "s": 1.0}}}), encoding="utf-8")
    doc = suite_plan.record(path, {"a": {"tests": 3, "measured_s": 60.0, "load": 8.0, "workers": 1, "cpu_s": 9.0}},
                            cores=2, startup_s=12.0)
    assert doc["files"]["old"] == {"tests": 2, "s": 7.0}  # not run: kept
    a = doc["files"]["a"]
    assert (a["tests"], a["s"], a["measured_s"], a["load"]) == (3, 15.0, 60.0, 8.0)  # load 8 on 2 cores: 4x
    doc = suite_plan.record(path, {"b": {"tests": 1, "measured_s": 20.0, "load": 8.0, "workers": 1, "cpu_s": 9.0}}, cores=2)
    assert doc["files"]["b"]["s"] == 9.0 and doc["files"]["a"]["s"] == 15.0  # never below its CPU seconds
    assert doc["startup_s"] == 12.0  # kept when a run did not measure it
    assert json.loads(path.read_text(encoding="utf-8")) == doc and doc["startup_s"] == 12.0 and doc["cores"] == 2


def test_the_files_that_build_cpu_adam_are_the_ones_the_plan_names():
    users = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "cpu_adam_built" in p.read_text(encoding="utf-8") and p.name != "test_suite_plan.py")
    assert users == sorted(suite_plan.NEEDS_CPU_ADAM)


def _pytest(*args: str, durations) -> subprocess.CompletedProcess:
    env = {**os.environ, "FINETUNER_TESTS_DURATIONS": str(durations), "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_a_run_prints_its_plan_and_records_the_files_it_ran_whole(tmp_path):
    """As ./scripts/test.sh runs pytest (xdist's controller and a worker), on one small file: the plan line once the
    tests are collected, then the file's time in the durations file named by FINETUNER_TESTS_DURATIONS."""
    durations = tmp_path / "durations.json"
    r = _pytest("-n", "1", "--dist", "loadfile", "--plan", "--record-durations", "tests/test_units.py", durations=durations)
    assert r.returncode == 0, r.stdout + r.stderr
    first = next(line for line in r.stdout.splitlines() if line.startswith("plan: "))
    assert " tests in 1 file on 1 worker, predicted " in first and "on this machine" in first, r.stdout
    assert f"1 file without a recorded time in {durations} counted at 0 s (none recorded)" in r.stdout
    assert f"recorded the times of 1 test file into {durations}" in r.stdout
    entry = json.loads(durations.read_text(encoding="utf-8"))["files"]["tests/test_units.py"]
    assert f"plan: {entry['tests']} tests in 1 file" in first
    assert entry["workers"] == 1 and entry["measured_s"] >= entry["s"] and entry["measured_s"] > 0


def test_recording_refuses_a_selection_inside_a_file(tmp_path):
    r = _pytest("-n", "0", "--record-durations", "-k", "duration", "tests/test_units.py", durations=tmp_path / "d.json")
    assert r.returncode == 4 and "--record-durations records whole test files" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "d.json").exists()

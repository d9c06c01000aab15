"""The test command's plan: how many tests a run collected and how long they should take on this machine, from the
per-file times a measured run recorded (``tests/durations.json``), and the quick subset (``tests/quick.txt``).

``./scripts/test.sh`` passes ``--plan``: tests/conftest.py prints :func:`plan_text` once the tests are collected.
``--record-durations`` (tests/conftest.py) writes the times of the files a run ran whole into ``tests/durations.json``
(merged: the files it did not run keep theirs). A file's time is the sum of its tests' set-up, call and tear-down
seconds, divided by the share of a core each task had while it ran (``finetuner.planning.load.share`` of the mean
1-minute load average seen at its tests' reports), and at least its CPU seconds: its time on an idle machine, one
worker a core. The plan
multiplies it back by the share it expects now (the load before the run plus its own workers), and lays the files
out on the workers as pytest-xdist's ``--dist loadfile`` hands them out (:func:`makespan`). A file without a recorded
time counts at the median of the recorded ones; a file whose test count changed since, in proportion.

    python -m tests.suite_plan --quick-files   # the quick subset's files, one a line (scripts/test.sh --quick)
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the recorded times (``FINETUNER_TESTS_DURATIONS`` names another file: tests/test_suite_plan.py records into one)
DURATIONS = Path(os.environ.get("FINETUNER_TESTS_DURATIONS") or REPO / "tests" / "durations.json")
QUICK = REPO / "tests" / "quick.txt"

#: the quick subset's bound: ``./scripts/test.sh --quick`` on 2 idle cores (tests/test_suite_plan.py checks the
#: recorded times keep it)
QUICK_LIMIT_S = 300.0

#: the test files that need DeepSpeedCPUAdam (its C++ extension, built by their ``cpu_adam_built`` fixture on first
#: use: 3 minutes of CPU on 2 idle cores, 9 minutes on busy ones); the plan says so when it is not built yet
NEEDS_CPU_ADAM = ("tests/training/test_distributed.py",)


def quick_files(path: Path = QUICK) -> list[str]:
    """The test files of the quick subset: ``tests/quick.txt``'s lines, without comments (``#``) and blank lines."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def file_of(nodeid: str) -> str:
    """``tests/a/test_b.py`` of ``tests/a/test_b.py::test_c[x]``."""
    return nodeid.split("::", 1)[0]


def counts(nodeids) -> dict[str, int]:
    """How many of ``nodeids`` each file holds, in the order the files first come (the collection's)."""
    out: dict[str, int] = {}
    for nodeid in nodeids:
        out[file_of(nodeid)] = out.get(file_of(nodeid), 0) + 1
    return out


def read(path: Path = DURATIONS) -> dict:
    """The recorded durations (``{"files": {}}`` when there are none)."""
    if not path.is_file():
        return {"files": {}}
    return json.loads(path.read_text(encoding="utf-8"))


def share(load: float, cores: int) -> float:
    """How many times longer a task takes under ``load`` on ``cores`` than alone (finetuner's own rule)."""
    from finetuner.planning.load import share as load_share

    return load_share(load, cores)


def makespan(seconds: list[float], workers: int) -> float:
    """When the last of files taking ``seconds`` (in the run's order) ends on ``workers`` workers, as
    ``--dist loadfile`` hands them out: each worker gets two files to start with and the next one in the queue
    each time it ends one (pytest-xdist's LoadScopeScheduling keeps two assigned a worker)."""
    workers = max(1, min(workers, len(seconds)))
    if not seconds:
        return 0.0
    queue = list(seconds)
    queues: list[list[float]] = [[] for _ in range(workers)]
    for _ in range(2):
        for q in queues:
            if queue:
                q.append(queue.pop(0))
    ends = [(q.pop(0), w) for w, q in enumerate(queues) if q]  # (when the worker's current file ends, worker)
    heapq.heapify(ends)
    last = 0.0
    while ends:
        t, w = heapq.heappop(ends)
        last = max(last, t)
        if queue:
            queues[w].append(queue.pop(0))
        if queues[w]:
            heapq.heappush(ends, (t + queues[w].pop(0), w))
    return last


@dataclass
class Plan:
    tests: int
    files: int
    workers: int
    idle_s: float  #: the predicted time on an idle machine of these cores
    factor: float  #: how many times longer the load now makes it
    seconds: float  #: the prediction: ``idle_s * factor``
    load: float
    cores: int
    unrecorded: int  #: files with no recorded time
    median_s: float | None  #: the time each of those counts at
    cpu_adam_missing: bool  #: a file that needs DeepSpeedCPUAdam is selected and it is not built yet


def predict(selected: dict[str, int], workers: int, load: float, cores: int, recorded: dict | None = None,
            cpu_adam_built: bool = True) -> Plan:
    """The plan of a run of ``selected`` (file -> its number of selected tests, in the run's order) on ``workers``
    workers, ``load`` the load average before it started on ``cores`` cores."""
    rec = (read() if recorded is None else recorded).get("files", {})
    known = [e["s"] for e in rec.values()]
    median = statistics.median(known) if known else None
    times, unrecorded = [], 0
    for f, n in selected.items():
        entry = rec.get(f)
        if entry is None:
            unrecorded += 1
            times.append(median or 0.0)
        else:
            times.append(entry["s"] * n / max(1, entry["tests"]))
    startup = (recorded if recorded is not None else read()).get("startup_s", 0.0)
    idle = startup + makespan(times, workers)
    factor = share(load + workers, cores) / share(workers, cores)
    missing = not cpu_adam_built and any(f in NEEDS_CPU_ADAM for f in selected)
    return Plan(sum(selected.values()), len(selected), workers, idle, factor, idle * factor, load, cores, unrecorded,
                median, missing)


def plan_text(p: Plan) -> list[str]:
    """The plan in one or two lines, as ``./scripts/test.sh`` prints it."""
    from finetuner.units import duration_text

    load = (f"{duration_text(p.idle_s)} on idle cores, x{p.factor:.1f} for load {p.load:.1f} on {p.cores} cores"
            if p.factor > 1 else f"load {p.load:.1f} on {p.cores} cores")
    lines = [f"plan: {p.tests:,} tests in {p.files:,} file{'s' if p.files != 1 else ''} on {p.workers} worker{'s' if p.workers != 1 else ''}, "
             f"predicted {duration_text(p.seconds)} on this machine ({load})"]
    notes = []
    if p.unrecorded:
        at = f"the median {duration_text(p.median_s)}" if p.median_s is not None else "0 s (none recorded)"
        notes.append(f"{p.unrecorded} file{'s' if p.unrecorded != 1 else ''} without a recorded time in "
                     f"{shown(DURATIONS)} counted at {at}")
    if p.cpu_adam_missing:
        notes.append("DeepSpeedCPUAdam is not built yet: its first test builds it (3-9 min more, once)")
    if notes:
        lines.append("      " + "; ".join(notes))
    return lines


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is in it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def record(path: Path, measured: dict[str, dict], cores: int, startup_s: float | None = None) -> dict:
    """Merge ``measured`` (file -> ``{"tests", "measured_s", "load", "workers", "cpu_s"}`` of a run that ran it
    whole) into the durations file at ``path``: each file's idle time ``s``, its measured seconds over the share of a
    core it had, and never less than its CPU seconds (its own and its subprocesses': on one core it cannot take less;
    the load average counts every waiting thread, so under load the share alone overstates the wait, by up to 4x
    measured here); the files not measured keep their times. Returns what was written."""
    doc = {"about": "", **read(path)}
    doc["about"] = ("Per-file test times for the plan ./scripts/test.sh prints (tests/suite_plan.py): s is the idle "
                    "time (the measured seconds over the share of a core at the load seen, at least the CPU seconds), written by "
                    "./scripts/test.sh --record-durations")
    doc["cores"] = cores
    files = doc.setdefault("files", {})
    today = datetime.date.today().isoformat()
    for f, m in measured.items():
        s = max(m["measured_s"] / share(m["load"], cores), m.get("cpu_s", 0.0))
        files[f] = {"tests": m["tests"], "s": round(s, 1), "measured_s": round(m["measured_s"], 1),
                    "load": round(m["load"], 1), "workers": m["workers"], "cpu_s": round(m.get("cpu_s", 0.0), 1),
                    "recorded": today}
    if startup_s is not None:
        doc["startup_s"] = round(startup_s, 1)
    doc["files"] = dict(sorted(files.items()))
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def load_now() -> tuple[float, int]:
    """This machine's 1-minute load average and its cores (finetuner's own measurement)."""
    from finetuner.planning.load import load_now as finetuner_load_now

    return finetuner_load_now()


def cpu_adam_built() -> bool:
    """Whether DeepSpeedCPUAdam's extension is in ``$TORCH_EXTENSIONS_DIR`` (tests/conftest.py sets it)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or REPO / ".cache" / "torch_extensions")
    return (root / "cpu_adam" / "cpu_adam.so").is_file()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick-files", action="store_true", help="print the quick subset's test files, one a line")
    args = ap.parse_args(argv)
    if args.quick_files:
        print("\n".join(quick_files()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

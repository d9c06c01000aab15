"""The demo's steps with torch's threads at 1, 2 and ``auto`` (finetuner/threads.py), on the machine as it is and
under a reproducible load: ``--busy`` processes that never wait (``python -c 'while True: pass'``, 2 by default,
one per core of the development machine), started before the run and ended after it.

Each case runs ``finetuner run recipes/demo_cpu.yaml`` in its own process with ``training.threads`` set (and
``OMP_NUM_THREADS`` unset), ``--steps`` steps, no samples, no probe, a fixed calibration
(tests/planning/speed_cpu.json: the cases differ in threads, not in a calibration measured under each load), and
reads from the run folder the threads chosen (the ``start`` event), the steps' own seconds (metrics.json
``step_seconds``) and the command's wall time. The other processes' load the run measured is in its ``start``
event; the machine's other work (it is shared) adds to the busy loops, so each row records it.

Usage:
  python -m scripts.bench.threads                       # the six cases, a markdown table on stdout
  python -m scripts.bench.threads --out docs/bench_threads.json --steps 30
  python -m scripts.bench.threads --out docs/bench_threads.json --cases busy:2   # one case again, the others kept
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CASES = (("idle", "auto"), ("idle", "2"), ("idle", "1"), ("busy", "1"), ("busy", "auto"), ("busy", "2"))


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FINETUNER_LOAD")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               FINETUNER_GENERAL_PROBE="0", FINETUNER_CACHE_DIR=str(cache),
               FINETUNER_SPEED_FILE=str(REPO / "tests" / "planning" / "speed_cpu.json"))
    return env


def run_case(load: str, threads: str, steps: int, busy: int, work: Path) -> dict:
    """One case: the run's threads, the load it measured, its steps' seconds and its wall time."""
    out = work / f"{load}-{threads}"
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy if load == "busy" else 0)]
    try:
        time.sleep(0.5)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "finetuner.cli.main", "run", str(REPO / "recipes" / "demo_cpu.yaml"),
                            "-o", str(out), "-q", "--set", f"training.max_steps={steps}", "--set", f"training.threads={threads}",
                            "--set", "samples.prompts=[]", "--set", "training.eval_every=1000",
                            "--set", "checkpointing.save_every=1000"],
                           cwd=REPO, env=_env(work / "cache"), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        loadavg = os.getloadavg()[0]
    finally:
        for lp in loops:
            lp.kill()
        for lp in loops:
            lp.wait()
    if p.returncode != 0:
        raise SystemExit(f"{load} threads={threads}: the run failed:\n{p.stderr[-2000:]}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    metrics = json.loads((out / "metrics.json").read_text())
    return {"load": load, "busy_loops": len(loops), "threads_asked": threads, "threads": start["threads"]["threads"],
            "reason": start["threads"]["reason"], "load_measured": start["threads"]["load"],
            "load_avg_1min_at_end": round(loadavg, 2), "steps": metrics["steps"],
            "step_s": round(metrics["step_seconds"] / metrics["steps"], 4), "steps_s": round(metrics["step_seconds"], 1),
            "command_s": round(wall, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| machine | training.threads | threads chosen (reason) | s a step | steps | command |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        what = "as it is" if r["load"] == "idle" else f"+ {r['busy_loops']} busy loops"
        lines.append(f"| {what} | {r['threads_asked']} | {r['threads']} ({r['reason']}) | {r['step_s']:.3f} | "
                     f"{r['steps_s']:.1f} s | {r['command_s']:.1f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes for the busy cases")
    ap.add_argument("--cases", default=",".join(f"{load}:{t}" for load, t in CASES),
                    help="the cases to run, LOAD:THREADS with LOAD idle or busy (default: all six)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here (an existing file's other cases are kept)")
    a = ap.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    if any(len(c) != 2 or c[0] not in ("idle", "busy") for c in cases):
        ap.error(f"--cases {a.cases}: give LOAD:THREADS pairs, e.g. busy:1,busy:auto")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for load, threads in cases:
            rows.append(run_case(load, threads, a.steps, a.busy, Path(tmp)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if a.out:  # after each case: a long one cut short keeps the others
                write_rows(a.out, rows)
    print(table(rows))
    return 0


def write_rows(path: Path, rows: list[dict]) -> None:
    """``rows`` into the JSON file ``path``, beside the rows of the other cases it holds (in :data:`CASES`' order)."""
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    key = lambda r: (r["load"], r["threads_asked"])  # noqa: E731
    mine = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in mine] + rows
    merged.sort(key=lambda r: CASES.index(key(r)) if key(r) in CASES else len(CASES))
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                                "platform": platform.platform(), "recipe": "recipes/demo_cpu.yaml",
                                "rows": merged}, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())

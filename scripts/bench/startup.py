"""Start-up times: ``finetuner --help``, ``finetuner plan``, and the time to the first training step
with a cold and with a warm tokenized-data cache.

Each command is run ``--runs`` times after one untimed warm-up run (like hyperfine) and the
report gives the median, mean ± standard deviation, min and max wall time. ``python -X importtime``
of ``finetuner --help`` lists the slowest imports. Time to first step is measured from launching
``finetuner run`` to the time stamp of its first ``step`` event, for the demo model on a data set
of ``--rows`` alpaca rows made from data/alpaca_sample.json (each row varied so none repeats),
first with an empty cache folder (cold: tokenize, pack, store) and then again (warm: load).

Usage:
  python -m scripts.bench.startup                 # prints a markdown table
  python -m scripts.bench.startup --out DIR       # also writes bench_startup.json / .md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra)
    return env


def timed(cmd: list[str], runs: int, cwd: Path) -> dict:
    subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, check=True)  # warm-up (disk cache)
    import resource

    times, cpu = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times), "cpu_median_s": statistics.median(cpu),
            "stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0, "min_s": min(times), "max_s": max(times), "runs": runs}


def slowest_imports(cmd_args: list[str], cwd: Path, n: int = 8) -> list[tuple[str, float]]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "finetuner", *cmd_args], cwd=cwd, env=_env(),
                          capture_output=True, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cum, name = (p.strip() for p in line[len("import time:"):].split("|"))
            if cum.isdigit() and not name.startswith(" "):
                rows.append((name.strip(), int(cum) / 1e6))
    top_level = [r for r in rows if "." not in r[0]]
    return sorted(top_level, key=lambda r: -r[1])[:n]


def make_data(path: Path, rows: int) -> None:
    base = json.loads((REPO / "data" / "alpaca_sample.json").read_text())
    out = []
    for i in range(rows):
        r = dict(base[i % len(base)])
        r["instruction"] = f"{r['instruction']} (case {i})"
        out.append(r)
    path.write_text(json.dumps(out))


def first_step(recipe: Path, data: Path, cache: Path, out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "finetuner", "run", str(recipe), "-q", "--no-resume", "-o", str(out_dir),
           "--set", f"data.path={data}", "--set", "training.max_steps=1", "--set", "samples.prompts=[]",
           "--set", "data.val_size=0", "--set", "training.eval_every=null", "--set", "logging.every=1"]
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, env=_env(FINETUNER_CACHE_DIR=str(cache)), capture_output=True, check=True)
    events = [json.loads(line) for line in (out_dir / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    step = next(e for e in events if e["event"] == "step")
    return {"to_start_event_s": start["time"] - t0, "to_first_step_s": step["time"] - t0, "cache": start["data"].get("cache"),
            "prepare_data_s": start["data"].get("prepare_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rows", type=int, default=5000, help="rows of the data set for the time-to-first-step runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    results: dict = {}
    fin = [sys.executable, "-m", "finetuner"]
    results["finetuner --help"] = timed([*fin, "--help"], args.runs, work)
    plan = ["plan", "--model", "llama-3.1-8b", "--gpu", "rtx4090"]
    results["finetuner plan --model llama-3.1-8b --gpu rtx4090"] = timed([*fin, *plan], args.runs, work)
    results["python -c pass (interpreter alone)"] = timed([sys.executable, "-c", "pass"], args.runs, work)
    imports = slowest_imports(["--help"], work)

    data = work / "data.json"
    make_data(data, args.rows)
    cache = work / "cache"
    cold = first_step(REPO / "recipes" / "demo_cpu.yaml", data, cache, work / "run-cold")
    warm = first_step(REPO / "recipes" / "demo_cpu.yaml", data, cache, work / "run-warm")
    results["time to first step"] = {"cold": cold, "warm": warm}

    lines = ["| command | median | mean ± sd | min | max | CPU time (median) |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "median_s" in r:
            lines.append(f"| `{name}` | {r['median_s']:.3f} s | {r['mean_s']:.3f} ± {r['stdev_s']:.3f} s | {r['min_s']:.3f} s | {r['max_s']:.3f} s | {r['cpu_median_s']:.3f} s |")
    lines += ["", f"Time to first training step, demo model, {args.rows:,} alpaca rows (from launching `finetuner run`):", "",
              "| data cache | data preparation | to the start event | to the first step event |", "|---|---|---|---|"]
    for name, r in (("cold (tokenize, store)", cold), ("warm (load)", warm)):
        lines.append(f"| {name} [{r['cache']}] | {r['prepare_data_s']:.2f} s | {r['to_start_event_s']:.1f} s | {r['to_first_step_s']:.1f} s |")
    lines += ["", "Slowest top-level imports of `finetuner --help` (`python -X importtime`, cumulative):", "",
              ", ".join(f"{name} {s * 1000:.0f} ms" for name, s in imports)]
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_startup.json").write_text(json.dumps({"results": results, "imports": imports}, indent=2))
        (out / "bench_startup.md").write_text(md)


if __name__ == "__main__":
    main()

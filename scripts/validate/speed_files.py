"""The speed model on the shipped recipes and data, run as users run them: ``finetuner run`` in a new process,
every core, wall time.

``scripts/validate/speed_model.py`` checks the step-time formula on full-length synthetic rows with one torch
thread (the CPU time of a step). Users run real files: rows of many lengths, padding, pairs, GRPO's rollouts,
the machine's default thread count. For each recipe below this runs ``finetuner run RECIPE`` (a fresh process,
a fresh run folder, the planned settings as shipped) and reads what the run itself wrote into ``metrics.json``:
``time.predicted`` (what ``plan`` and ``estimate`` say for this recipe on this machine) beside ``time.measured``
(the run's own clock) for the steps, the evaluations and the whole run.

Run it at normal priority on an otherwise idle machine (it measures time; ~10 min on 2 cores):

    python -m scripts.validate.speed_files --out docs/validation

It writes ``speed_files_<device>.json``: one row per recipe with predicted and measured seconds by part and
their errors, and a summary (median and largest error of the steps' time and of the whole run's).
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

from finetuner.children import python_command

REPO = Path(__file__).resolve().parents[2]
#: name → (recipe, overrides): every shipped CPU recipe as shipped, and the demo on the chat sample file
RECIPES: dict[str, tuple[str, list[str]]] = {
    "demo_cpu (alpaca sample, as shipped)": ("recipes/demo_cpu.yaml", []),
    "demo_cpu on data/chat_sample.jsonl": ("recipes/demo_cpu.yaml", ["data.path=data/chat_sample.jsonl"]),
    "demo_dpo_cpu (preference pairs)": ("recipes/demo_dpo_cpu.yaml", []),
    "demo_grpo_cpu (GRPO prompts)": ("recipes/demo_grpo_cpu.yaml", []),
    "smollm2_cpu (SmolLM2-135M, bike_shop chats)": ("recipes/smollm2_cpu.yaml", []),
}
#: name → ``finetuner plan`` arguments: a recipe the planner writes for a data file on this machine, then run
PLANNED: dict[str, list[str]] = {
    "planned: demo model on data/alpaca_sample.json": ["--model", "data/demo_model", "--gpu", "cpu", "--data",
                                                        "data/alpaca_sample.json"],
}
#: the parts compared (``total``: the whole run, from the process's start to the end of its samples)
PARTS = ("load", "steps", "evaluations", "checkpoints", "samples", "total")


def run_one(recipe: str, overrides: list[str], out: Path) -> dict:
    """Train ``recipe`` into ``out`` with the ``finetuner`` command; the run's predicted and measured time."""
    cmd = [*python_command(), "-m", "finetuner", "run", str(REPO / recipe), "--output", str(out), "--quiet"]
    for o in overrides:
        cmd += ["--set", o]
    began = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - began
    if proc.returncode != 0:
        raise SystemExit(f"{recipe} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    t = metrics["time"]
    return {"predicted": t["predicted"], "measured": t["measured"], "process_wall_s": round(wall, 2),
            "steps": metrics.get("steps"), "tokens_per_s": metrics.get("tokens_per_s")}


def error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured, None where either is missing or nothing was measured."""
    if predicted is None or not measured:
        return None
    return round((predicted - measured) / measured, 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "validation")
    ap.add_argument("--only", nargs="*", help="names (substrings) of the recipes to run")
    args = ap.parse_args(argv)
    rows, load_before = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="finetuner-speed-files-") as tmp:
        for i, (name, (recipe, overrides)) in enumerate(RECIPES.items()):
            if args.only and not any(o in name for o in args.only):
                continue
            got = run_one(recipe, overrides, Path(tmp) / f"run{i}")
            errors = {p: error(got["predicted"].get(p), got["measured"].get(p)) for p in PARTS}
            rows.append({"name": name, "recipe": recipe, "overrides": overrides, **got, "error": errors})
            print(f"{name:48} steps {got['predicted'].get('steps')} s predicted / {got['measured'].get('steps')} s "
                  f"measured ({errors['steps']:+.0%}); whole run {got['predicted'].get('total')} / "
                  f"{got['measured'].get('total')} s ({errors['total']:+.0%})", flush=True)
        for j, (name, plan_args) in enumerate(PLANNED.items()):
            if args.only and not any(o in name for o in args.only):
                continue
            recipe = Path(tmp) / f"planned{j}.yaml"
            made = subprocess.run([*python_command(), "-m", "finetuner", "plan", *plan_args, "-o", str(recipe)], cwd=REPO,
                                  capture_output=True, text=True, timeout=600)
            if made.returncode != 0:
                raise SystemExit(f"plan {plan_args} failed:\n{made.stdout[-2000:]}\n{made.stderr[-2000:]}")
            got = run_one(str(recipe), [], Path(tmp) / f"planned-run{j}")
            errors = {p: error(got["predicted"].get(p), got["measured"].get(p)) for p in PARTS}
            rows.append({"name": name, "recipe": "finetuner plan " + " ".join(plan_args), "overrides": [], **got,
                         "error": errors})
            print(f"{name:48} whole run {got['predicted'].get('total')} / {got['measured'].get('total')} s "
                  f"({errors['total']:+.0%})", flush=True)
    steps = [abs(r["error"]["steps"]) for r in rows if r["error"]["steps"] is not None]
    totals = [abs(r["error"]["total"]) for r in rows if r["error"]["total"] is not None]
    summary = {"steps_median_abs_error": round(statistics.median(steps), 4) if steps else None,
               "steps_largest_abs_error": round(max(steps), 4) if steps else None,
               "total_median_abs_error": round(statistics.median(totals), 4) if totals else None,
               "total_largest_abs_error": round(max(totals), 4) if totals else None}
    device = "cpu"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "") if Path("/proc/cpuinfo").exists() else ""
    doc = {"device": device, "cpu": cpu, "cores": os.cpu_count(), "threads": "default (every core)",
           "load_before": round(load_before, 2), "rows": rows, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.only:
        (args.out / f"speed_files_{device}.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

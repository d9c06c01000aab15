"""Multi-process training on this machine (CPU, gloo) against one process, on the demo recipe.

Runs ``finetuner run recipes/demo_cpu.yaml`` as a user would (a subprocess each), with the same
effective batch: once in one process, then with ``--gpus 2`` for each strategy. LoRA dropout is
set to 0 so every variant sees the same numbers (with dropout each process draws its own masks
and the runs agree only statistically). Prints the wall time of each command (start-up of every
process included), the final training loss and the largest difference against one process, per
step and in the adapter weights.

    .venv/bin/python -m scripts.bench.distributed --steps 30 --strategies ddp,zero2,zero3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from finetuner.children import python_command

REPO = Path(__file__).resolve().parents[2]


def run(work: Path, name: str, steps: int, extra: list[str]) -> dict:
    out = work / name
    cmd = [*python_command(), "-m", "finetuner.cli.main", "run", str(REPO / "recipes" / "demo_cpu.yaml"), "--quiet", "--no-resume",
           "--output", str(out), "--set", f"training.max_steps={steps}", "--set", "lora.dropout=0",
           "--set", "samples.prompts=[]", "--set", "checkpointing.save_every=null", "--set", "logging.tensorboard=false",
           *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    losses = {e["step"]: e["loss"] for e in events if e["event"] == "step"}
    return {"name": name, "wall_s": round(wall, 1), "losses": losses, "adapter": out / "adapter" / "adapter_model.safetensors",
            "train_s": next(e for e in events if e["event"] == "done")["metrics"]["train_seconds"]}


def max_adapter_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--strategies", default="ddp,zero2,zero3")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("FINETUNER_CACHE_DIR", str(REPO / ".cache" / "finetuner"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    work = Path(tempfile.mkdtemp(prefix="ft-bench-dist-"))
    ref = run(work, "one-process", args.steps, [])
    rows = [ref]
    for strategy in args.strategies.split(","):
        rows.append(run(work, strategy, args.steps, ["--gpus", str(args.processes), "--set", f"distributed.strategy={strategy}"]))
    print(f"\n| run | processes | wall time (command) | training time | final loss | max abs loss diff vs 1 process (all steps) | max abs adapter weight diff |")
    print("|---|---|---|---|---|---|---|")
    figures = []
    for r in rows:
        n = 1 if r is ref else args.processes
        loss_diff = max(abs(r["losses"][s] - ref["losses"][s]) for s in ref["losses"])
        w_diff = max_adapter_diff(r["adapter"], ref["adapter"])
        last = r["losses"][max(r["losses"])]
        print(f"| {r['name']} | {n} | {r['wall_s']:.1f} s | {r['train_s']:.1f} s | {last:.6f} | {loss_diff:.2e} | {w_diff:.2e} |")
        figures.append({"run": r["name"], "processes": n, "wall_s": r["wall_s"], "train_s": r["train_s"], "final_loss": last,
                        "max_loss_diff": loss_diff, "max_adapter_diff": w_diff})
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "rows": figures}, indent=2))


if __name__ == "__main__":
    main()

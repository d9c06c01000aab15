"""CPU cost of each offload option, in one run: tokens/s with and without.

Trains the embedded demo (recipes/demo_cpu.yaml) for a fixed number of steps per variant, the
variants interleaved ``--rounds`` times (so background load hits them alike), and prints the
median tokens/s of each, relative to its baseline. On CPU, "offload" copies tensors within the
same RAM, so this measures the bookkeeping overhead (extra copies, hooks, paging logic), not
PCIe transfers; the GPU cost is what the planner's cost model charges (finetuner/planning/planner.py).

    .venv/bin/python -m scripts.bench.offload --steps 40 --rounds 4

The wall-clock tokens/s swing several-fold between runs on a shared 2-core machine; tokens per
CPU-second of the process (one torch thread) is the steady measure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

VARIANTS = {
    # name: (overrides, baseline name)
    "checkpointing": (["training.gradient_checkpointing=true"], None),
    "checkpointing + activation offload": (["training.gradient_checkpointing=true", "training.offload_activations=true"], "checkpointing"),
    "no checkpointing": (["training.gradient_checkpointing=false"], None),
    "activation offload (save_on_cpu)": (["training.gradient_checkpointing=false", "training.offload_activations=true"], "no checkpointing"),
    "adamw_torch": (["training.optimizer=adamw_torch"], None),
    "paged_adamw_8bit": (["training.optimizer=paged_adamw_8bit"], "adamw_torch"),
}


def run(overrides: list[str], steps: int, work: Path) -> float:
    from finetuner import Recipe, train

    recipe = Recipe.from_yaml(REPO / "recipes" / "demo_cpu.yaml", overrides + [
        f"training.max_steps={steps}", "samples.prompts=[]", "checkpointing.save_every=null", "logging.tensorboard=false",
        "training.eval_every=null", "data.val_size=0",
    ])
    out = Path(tempfile.mkdtemp(dir=work))
    cpu0 = time.process_time()
    res = train(recipe, output_dir=out / "run", resume=False)
    cpu = time.process_time() - cpu0  # the whole call: the same fixed load cost for every variant
    return float(res.metrics["tokens_per_s"]), res.metrics["tokens_seen"] / cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="bench_offload_"))
    import torch

    torch.set_num_threads(args.threads)  # one thread: CPU time is not inflated by spinning OpenMP threads
    speeds: dict[str, list[float]] = {k: [] for k in VARIANTS}
    per_cpu: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(args.rounds):
        names = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            tps, tpc = run(VARIANTS[name][0], args.steps, work)
            speeds[name].append(tps)
            per_cpu[name].append(tpc)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    cmed = {k: statistics.median(v) for k, v in per_cpu.items()}
    print(f"| variant | tokens per CPU-second (median of {args.rounds}) | vs baseline | tokens/s wall (median; runs) | vs baseline |")
    print("|---|---|---|---|---|")
    for name, (_ov, base) in VARIANTS.items():
        crel = f"{100 * (cmed[name] / cmed[base] - 1):+.1f}% vs {base}" if base else "baseline"
        rel = f"{100 * (med[name] / med[base] - 1):+.1f}%" if base else "baseline"
        runs = ", ".join(f"{v:,.0f}" for v in speeds[name])
        print(f"| {name} | {cmed[name]:,.0f} | {crel} | {med[name]:,.0f} ({runs}) | {rel} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "rounds": args.rounds, "threads": args.threads,
                                               "tokens_per_s": speeds, "tokens_per_cpu_s": per_cpu}, indent=2))


if __name__ == "__main__":
    main()

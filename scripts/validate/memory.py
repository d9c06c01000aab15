"""Validate the memory model against real training steps on a GPU.

For each configuration of a matrix (LoRA / QLoRA, sequence 512 / 2048, gradient checkpointing
on / off, two optimizers) on 7B- and 13B-shaped Llama models built from their config with random
weights (nothing is downloaded), this runs ``finetuner run`` for a few steps in a fresh process
and compares the memory model's prediction (the ``predicted`` block of the run's ``start``
event, i.e. exactly what ``finetuner estimate`` says for that recipe on this device) with the
measured peaks (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` from the step
events). Every token is labelled (``train_on_prompt``) and the data are packed, so each
micro-batch is full.

One command per model (on a CUDA machine, from the repository root):

    python -m scripts.validate.memory --preset llama-2-7b --out docs/validation
    python -m scripts.validate.memory --preset llama-2-13b --out docs/validation
    python -m scripts.validate.memory --report docs/validation   # → table for docs/memory.md

``--smoke`` runs a tiny model for two configurations (works on CPU; it checks the script, not
the model: on CPU there is no device peak to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from scripts.validate.train_gpu import build_model, is_preset, write_data

from finetuner.children import python_command

GiB = 2**30

#: name → recipe overrides. Sequence length is the packed length; micro-batch 1 (2 where noted).
MATRIX = {
    "lora-seq512-gc-adamw": ["method=lora", "data.max_seq_len=512", "training.gradient_checkpointing=true", "training.optimizer=adamw_torch"],
    "lora-seq512-nogc-adamw": ["method=lora", "data.max_seq_len=512", "training.gradient_checkpointing=false", "training.optimizer=adamw_torch"],
    "lora-seq2048-gc-adamw": ["method=lora", "data.max_seq_len=2048", "training.gradient_checkpointing=true", "training.optimizer=adamw_torch"],
    "lora-seq2048-nogc-adamw8": ["method=lora", "data.max_seq_len=2048", "training.gradient_checkpointing=false", "training.optimizer=adamw_8bit"],
    "qlora-seq512-gc-paged8": ["method=qlora", "data.max_seq_len=512", "training.gradient_checkpointing=true", "training.optimizer=paged_adamw_8bit"],
    "qlora-seq512-nogc-adamw": ["method=qlora", "data.max_seq_len=512", "training.gradient_checkpointing=false", "training.optimizer=adamw_torch"],
    "qlora-seq2048-gc-adamw": ["method=qlora", "data.max_seq_len=2048", "training.gradient_checkpointing=true", "training.optimizer=adamw_torch"],
    "qlora-seq2048-gc-mb2-paged8": ["method=qlora", "data.max_seq_len=2048", "training.micro_batch_size=2", "training.gradient_checkpointing=true", "training.optimizer=paged_adamw_8bit"],
    "qlora-seq2048-nogc-adamw8": ["method=qlora", "data.max_seq_len=2048", "training.gradient_checkpointing=false", "training.optimizer=adamw_8bit"],
}
SMOKE = ["lora-seq512-gc-adamw", "qlora-seq512-nogc-adamw"]


def log(*a: object) -> None:
    print(*a, flush=True)


def planned_overrides(preset: str, gpu: str, seq_len: int = 2048, default_install: bool = False) -> list[str]:
    """The planner's choice for ``preset`` on ``gpu`` as recipe overrides (``default_install``: as
    planned for an install without Liger Kernel or FlashAttention-2, like docs/planning.md's fit table)."""
    from finetuner.config.hardware import get_gpu
    from finetuner.planning.planner import plan

    card = get_gpu(gpu).with_default_install() if default_install else gpu
    c = plan(preset, card, seq_len=seq_len).recipe_choice()
    out = [f"method={c['method']}", f"data.max_seq_len={c['max_seq_len']}", f"training.micro_batch_size={c['micro_batch_size']}",
           f"training.optimizer={c['optimizer']}", f"training.gradient_checkpointing={str(c['gradient_checkpointing']).lower()}",
           f"training.offload_activations={str(c['offload_activations']).lower()}"]
    if c["quantization_bits"]:
        out.append(f"quantization.bits={c['quantization_bits']}")
    return out


def smoke_overrides(overrides: list[str]) -> list[str]:
    """A configuration at toy size for ``--smoke``: sequences of 2,048 tokens and more become 256,
    shorter ones 128; QLoRA computes in fp32 (bf16 is slow on a CPU)."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        out.append(f"{key}={256 if int(value) >= 2048 else 128}" if key == "data.max_seq_len" else o)
    if "method=qlora" in out:
        out.append("quantization.compute_dtype=fp32")
    return out


def run_one(name: str, overrides: list[str], model_dir: Path, data: Path, work: Path, steps: int, smoke: bool,
            cap_gib: float | None = None, sections: dict | None = None) -> dict:
    """One configuration in a fresh ``finetuner run`` process: the measured peaks and the memory
    model's prediction from the run's ``start`` event. ``sections``: recipe keys set over the
    defaults here, a section's keys one by one (``None`` removes a key), e.g. a preference run's
    ``objective`` and its unpacked ``data``. A run with ``distributed.strategy`` keeps
    ``distributed`` (strategy, processes, offload) in its row, and :func:`recompute` predicts
    it per device."""
    import yaml

    recipe = {
        "name": name,
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "packing": True, "train_on_prompt": True},
        "training": {"max_steps": steps, "lr": 1e-4, "gradient_accumulation": 1, "warmup_steps": 0, "micro_batch_size": 1},
        "checkpointing": {"save_every": None},
        "logging": {"tensorboard": False},
        "output_dir": str(work / name),
    }
    for key, value in (sections or {}).items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {k: v for k, v in {**recipe[key], **value}.items() if v is not None}
        else:
            recipe[key] = value
    if smoke:
        overrides = smoke_overrides(overrides)
    rpath = work / f"{name}.yaml"
    rpath.write_text(yaml.safe_dump(recipe))
    args = ["run", str(rpath), "--no-resume", "-q"]
    for o in overrides:
        args += ["--set", o]
    if cap_gib:  # stand for a smaller card: the caching allocator refuses to grow past the cap
        code = ("import sys, torch; torch.cuda.set_per_process_memory_fraction("
                f"{cap_gib} * 2**30 / torch.cuda.get_device_properties(0).total_memory); "
                f"from finetuner.cli.main import main; sys.exit(main({args!r}))")
        cmd = [*python_command(), "-c", code]
    else:
        cmd = [*python_command(), "-m", "finetuner.cli.main", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        log(proc.stdout[-2000:], proc.stderr[-3000:])
        return {"config": name, "error": (proc.stderr or proc.stdout)[-600:]}
    events = [json.loads(line) for line in (work / name / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    steps_ev = [e for e in events if e["event"] == "step"]
    pred = start.get("predicted") or {}
    measured_alloc = max(e["mem_peak"] for e in steps_ev)
    measured_reserved = max(e.get("mem_reserved", 0) for e in steps_ev)
    row = {
        "config": name,
        "overrides": overrides,
        "tokens_per_step": steps_ev[-1].get("tokens"),
        "measured_allocated_bytes": measured_alloc,
        "measured_reserved_bytes": measured_reserved,
        "predicted_allocated_bytes": pred.get("allocated_bytes"),
        "predicted_reserved_bytes": pred.get("reserved_bytes"),
        "predicted_total_bytes": pred.get("total_bytes"),
        "predicted_peak_phase": pred.get("peak_phase"),
        "predicted_components": pred.get("components"),
        "predicted_settings": pred.get("settings"),
        "wall_s": round(wall, 1),
    }
    dist = {o.split("=", 1)[0].split(".", 1)[1]: o.split("=", 1)[1] for o in overrides if o.startswith("distributed.")}
    if dist.get("strategy"):
        from finetuner.memory.sharding import OFFLOADS

        offload = "optimizer+params" if dist.get("fsdp_offload") == "true" else dist.get("offload", "none")
        row["distributed"] = {"strategy": dist["strategy"], "world_size": int(dist.get("num_processes", 1)),
                              "offload": offload if offload in OFFLOADS else "none"}
    if pred and measured_alloc:
        row["error_allocated_pct"] = round(100 * (pred["allocated_bytes"] - measured_alloc) / measured_alloc, 2)
    if pred and measured_reserved:
        row["error_reserved_pct"] = round(100 * (pred["reserved_bytes"] - measured_reserved) / measured_reserved, 2)
    return row


VALIDATION = REPO / "docs" / "validation"


def recompute(preset: str, row: dict, device: str | None, config: dict | None = None) -> dict:
    """Re-predict a measured row with the memory model as it is now (same settings, same card):
    lets the model be refined offline against measurements taken once on the GPU. Torch-free. ``config``: the
    model's ``config.json`` as its file recorded it, for a model that is not a preset (a model type's default)."""
    from finetuner.config.hardware import PROFILES, profile_for_device_name
    from finetuner.memory.model import Settings, estimate
    from finetuner.model.shapes import resolve_shape, shape_from_config

    settings = dict(row["predicted_settings"])
    # the row that reached the model: packed rows are not always full. Only with one row per
    # micro-batch is its length known (several rows are padded to the longest, not recorded:
    # those keep max_seq_len, an upper bound); a preference pair's two sequences are each cut
    # to max_seq_len, and its step counts both
    if row.get("tokens_per_step") and settings["micro_batch"] == 1 and settings.get("objective", "sft") == "sft":
        settings["seq_len"] = min(settings["seq_len"], -(-row["tokens_per_step"] // settings["micro_batch"]))
    if isinstance(settings.get("lora_targets"), list):
        settings["lora_targets"] = tuple(settings["lora_targets"])
    known = Settings.__dataclass_fields__
    shape = shape_from_config(config, name=preset) if config else resolve_shape(preset)
    est = estimate(shape, Settings(**{k: v for k, v in settings.items() if k in known}),
                   (profile_for_device_name(device or "", 0) if device else None) or PROFILES["h100-80gb"])
    row = dict(row)
    row["predicted_allocated_bytes"], row["predicted_reserved_bytes"] = est.allocated_bytes, est.reserved_bytes
    row["predicted_components"] = est.components
    if row.get("distributed"):
        row.update(per_device(est, shape, row["distributed"]))
    row["error_allocated_pct"] = round(100 * (est.allocated_bytes - row["measured_allocated_bytes"]) / row["measured_allocated_bytes"], 2)
    row["error_reserved_pct"] = round(100 * (est.reserved_bytes - row["measured_reserved_bytes"]) / row["measured_reserved_bytes"], 2)
    return row


def per_device(est, shape, distributed: dict) -> dict:
    """The prediction of one device of a ``distributed`` run (:func:`finetuner.memory.sharding.shard_estimate`):
    reserved = the device's total less the CUDA context, allocated = that less the allocator
    slack and the paged optimizer states (as :func:`finetuner.memory.model.estimate` counts them)."""
    from finetuner.memory.sharding import shard_estimate

    sh = shard_estimate(est, distributed["strategy"], distributed["world_size"], distributed.get("offload", "none"), shape=shape)
    reserved = sh.per_device_bytes - sh.components.get("CUDA context", 0)
    return {"predicted_allocated_bytes": reserved - sh.components.get("allocator slack", 0) - sh.spillable_bytes,
            "predicted_reserved_bytes": reserved, "predicted_components": dict(sh.components)}


def measure(preset: str, runs: list[tuple[str, list[str], float | None, dict | None]], out: Path, work: Path, steps: int,
            smoke: bool, tag: str | None = None, model_dir: Path | None = None) -> Path:
    """Run each ``(name, overrides, cap GiB or None, sections)`` of ``runs`` on a random-weight model
    of ``preset``'s shape (built once into ``work``; tiny with ``smoke``) and write the rows to
    ``out/validate_<tag>.json`` (``tag``: the preset, ``smoke`` with ``smoke``) in the format
    :func:`replay` reads. Returns the file's path."""
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir or work / ("tiny" if smoke else preset)
    build_model(preset, model_dir, smoke)
    data = work / "data.json"
    if not data.exists():
        write_data(data, n=600)
    results = []
    for name, overrides, cap, sections in runs:
        log(f"== {'smoke' if smoke else preset} {name} {overrides if cap else ''}")
        row = run_one(name, overrides, model_dir, data, work, steps, smoke, cap_gib=cap, sections=sections)
        row["cap_gib"] = cap
        if row.get("distributed") and "error" not in row and row.get("predicted_settings"):
            row = recompute(str(model_dir) if smoke else preset, row, _device_name())
        log(json.dumps({k: v for k, v in row.items() if k not in ("predicted_components", "predicted_settings")}))
        results.append(row)
    path = out / f"validate_{tag or ('smoke' if smoke else preset)}.json"
    doc = {"device": _device_name(), "preset": "smoke" if smoke else preset, "steps": steps, "results": results}
    if not is_preset(preset):  # a model type's default config: its shape is the config the run trained, kept here
        doc["config"] = json.loads((model_dir / "config.json").read_text())
    path.write_text(json.dumps(doc, indent=2))
    return path


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def replay(folder: Path = VALIDATION, again: bool = True) -> list[dict]:
    """Every run recorded in ``folder``'s ``validate_*.json``, in file order, each with its
    ``preset`` and ``device``; ``again``: re-predicted by the current memory model
    (:func:`recompute`), else the prediction recorded at the time. A run that failed keeps its
    ``error``. What ``--report`` prints and what ``tests/memory/test_memory_accuracy.py`` checks."""
    rows = []
    for path in sorted(folder.glob("validate_*.json")):
        doc = json.loads(path.read_text())
        for r in doc["results"]:
            if again and "error" not in r:
                r = recompute(doc["preset"], r, doc.get("device"), doc.get("config"))
            rows.append({**r, "preset": doc["preset"], "device": doc.get("device")})
    return rows


def summary(rows: list[dict]) -> dict:
    """The error statistics of :func:`replay`'s measured rows (failed runs left out): per
    ``allocated`` and ``reserved``, the median and max of |error| in percent and the number of
    rows predicted below the measurement."""
    done = [r for r in rows if "error" not in r]
    out: dict = {"rows": len(done), "devices": sorted({r["device"] for r in done if r["device"]})}
    for kind in ("allocated", "reserved"):
        errs = [r[f"error_{kind}_pct"] for r in done]
        out[kind] = {"median_abs_pct": statistics.median(abs(e) for e in errs) if errs else None,
                     "max_abs_pct": max((abs(e) for e in errs), default=None),
                     "under_predicted": [f"{r['preset']} {r['config']}" for r in done if r[f"error_{kind}_pct"] < 0]}
    return out


def gpu_name(device: str | None) -> str:
    """A GPU's name, short: "H100" of "NVIDIA H100 80GB HBM3", "A100" of "NVIDIA A100-SXM4-80GB"."""
    return (device or "?").removeprefix("NVIDIA ").split()[0].split("-")[0]


def _gpu(row: dict) -> str:
    return gpu_name(row.get("device"))


def _loss(row: dict) -> str:
    """Which loss the row's run used: Liger's fused cross-entropy or finetuner's chunked one."""
    fused = (row.get("predicted_settings") or {}).get("fused_ce")
    return "?" if fused is None else "Liger fused" if fused else "chunked"


def report(folder: Path = VALIDATION, again: bool = False) -> str:
    """A Markdown table of every ``validate_*.json`` in ``folder``, with the error statistics
    (``again``: re-predict with the current memory model instead of the recorded prediction)."""
    lines = [
        "| model | config | GPU | loss | tokens/step | measured allocated GiB | predicted allocated GiB | error | measured reserved GiB | predicted reserved GiB | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = replay(folder, again=again)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['config']} | {_gpu(r)} | | failed: {r['error'][-80:]!r} | | | | | | |")
            continue
        ea, er = r["error_allocated_pct"], r["error_reserved_pct"]
        lines.append(
            f"| {r['preset']} | {r['config']} | {_gpu(r)} | {_loss(r)} | {r['tokens_per_step']} | {r['measured_allocated_bytes'] / GiB:.2f} | "
            f"{r['predicted_allocated_bytes'] / GiB:.2f} | {ea:+.1f}% | {r['measured_reserved_bytes'] / GiB:.2f} | "
            f"{r['predicted_reserved_bytes'] / GiB:.2f} | {er:+.1f}% |"
        )
    st = summary(rows)
    if st["rows"]:
        a, rs = st["allocated"], st["reserved"]
        lines += [
            "",
            f"Device: {', '.join(st['devices'])}. Rows: {st['rows']}. Allocated: median |error| {a['median_abs_pct']:.1f}%, "
            f"max {a['max_abs_pct']:.1f}%, under-predicted rows {len(a['under_predicted'])}. Reserved: median |error| "
            f"{rs['median_abs_pct']:.1f}%, max {rs['max_abs_pct']:.1f}%, under-predicted rows {len(rs['under_predicted'])}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-2-7b", help="finetuner preset whose shape to build (random weights)")
    ap.add_argument("--configs", default=None, help="comma-separated subset of: " + ", ".join(MATRIX))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="docs/validation")
    ap.add_argument("--work", default="/tmp/finetuner_validate")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short sequences (runs on CPU)")
    ap.add_argument("--planned", metavar="GPU", help="also run the planner's recipe for this card (seq 2048) under a cap of its memory")
    ap.add_argument("--report", metavar="FOLDER", help="print the Markdown table of the JSON files in FOLDER and exit")
    ap.add_argument("--again", action="store_true", help="with --report: re-predict each row with the current memory model")
    args = ap.parse_args()
    if args.report:
        print(report(Path(args.report), again=args.again), end="")
        return
    out, work = Path(args.out), Path(args.work)
    names = args.configs.split(",") if args.configs else (SMOKE if args.smoke else list(MATRIX))
    runs = [(name, MATRIX[name], None, None) for name in names]
    if args.planned:
        from finetuner.config.hardware import get_gpu

        card = get_gpu(args.planned)
        runs.append((f"planned-{card.name}-capped", planned_overrides(args.preset, card.name), card.memory_gib, None))
    measure(args.preset, runs, out, work, args.steps, args.smoke)
    log(report(out))


if __name__ == "__main__":
    main()

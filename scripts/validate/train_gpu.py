"""GPU check of finetuner's real training path on 7B/8B-shaped models with random weights.

No download is needed: the model is built from a preset config (``finetuner/model/presets/<name>.json``)
with random bf16 weights, saved once to a scratch folder, and then trained by ``finetuner run``
(a subprocess per configuration, so each peak is clean) on synthetic packed data. For each
configuration it reports real tokens/s (steps after the first two), the peak allocated and
reserved memory, and the loss, and writes them as JSON and a markdown table.

Usage (on a CUDA machine):
    python -m scripts.validate.train_gpu --preset llama-2-7b --out /tmp/out
    python -m scripts.validate.train_gpu --smoke --out /tmp/out   # tiny model, CPU ok
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

from finetuner.children import python_command

REPO = Path(__file__).resolve().parents[2]

CONFIGS = {
    # name: recipe overrides
    "qlora-nf4-mb2-seq2048-gc": ["method=qlora", "training.micro_batch_size=2", "data.max_seq_len=2048",
                                 "training.gradient_checkpointing=true", "training.optimizer=paged_adamw_8bit"],
    "lora-bf16-mb2-seq2048-gc": ["method=lora", "training.micro_batch_size=2", "data.max_seq_len=2048",
                                 "training.gradient_checkpointing=true", "training.optimizer=adamw_torch"],
    "qlora-nf4-mb1-seq2048-gc": ["method=qlora", "training.micro_batch_size=1", "data.max_seq_len=2048",
                                 "training.gradient_checkpointing=true", "training.optimizer=paged_adamw_8bit"],
    "qlora-nf4-mb1-seq2048-nogc": ["method=qlora", "training.micro_batch_size=1", "data.max_seq_len=2048",
                                   "training.gradient_checkpointing=false", "training.optimizer=adamw_8bit"],
}


def log(*a):
    print(*a, flush=True)


PRESETS = REPO / "finetuner" / "model" / "presets"


def is_preset(name: str) -> bool:
    """Whether ``name`` is a preset shipped with finetuner (else :func:`preset_config` takes it as a model type)."""
    return (PRESETS / f"{name}.json").exists()


def preset_config(preset: str):
    """The transformers config of a preset shipped with finetuner (finetuner/model/presets/<preset>.json), or where
    no preset has that name, transformers' default config of the model type ``preset`` (``qwen3_5_text``:
    ``AutoConfig.for_model``, what a user gets from ``AutoConfig.for_model(T).save_pretrained(DIR)``)."""
    from transformers import AutoConfig

    from finetuner.model.inventory import special_floats

    if not is_preset(preset):
        return AutoConfig.for_model(preset)
    # (Granite 4.0-H's time_step_limit is [0.0, {"__float__": "Infinity"}], as transformers writes infinity)
    cfg_dict = special_floats(json.loads((PRESETS / f"{preset}.json").read_text()))
    cfg_dict = {k: v for k, v in cfg_dict.items() if not k.startswith("_")}
    return AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)


def build_model(preset: str | None, folder: Path, smoke: bool) -> None:
    """A random-weight model from a preset config (or a model type's default config, :func:`preset_config`) plus a
    small tokenizer, saved with save_pretrained. ``smoke``: at toy size, a tiny Llama, or for a preset of another
    family that family's tiny config (:func:`finetuner.model.tiny.tiny_config`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetuner.model.inventory import auto_class
    from finetuner.model.tiny_llama import tiny_llama, train_bpe_tokenizer

    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from it this be are or an hike bird sea".split()
    tok = train_bpe_tokenizer([" ".join(rng.choices(words, k=30)) for _ in range(500)], vocab_size=1024)
    if (folder / "config.json").exists():
        return
    # saved beside the folder and renamed into place: a build cut off half-way (a device command
    # past its time limit) leaves no folder that a later call would take for a finished model
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    t0 = time.perf_counter()
    family = preset_config(preset).model_type if preset else "llama"
    if smoke and family == "llama":
        model = tiny_llama(tok, hidden_size=128, num_layers=2)
    elif smoke:
        from finetuner.model.tiny import tiny_config

        cfg = tiny_config(family, len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    else:
        cfg = preset_config(preset)
        with torch.device("cuda"):
            model = auto_class(cfg.model_type).from_config(cfg, dtype=torch.bfloat16)
        model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = (
            tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    model.save_pretrained(partial, safe_serialization=True)
    tok.save_pretrained(partial)
    del model
    partial.rename(folder)
    log(f"built and saved {folder} in {time.perf_counter() - t0:.1f}s")


def write_data(path: Path, n: int = 400) -> None:
    rng = random.Random(1)
    words = "the of and to in is was for on that with as by at from it this be are or an hike bird sea".split()
    rows = [{"instruction": " ".join(rng.choices(words, k=rng.randint(40, 200))),
             "input": "", "output": " ".join(rng.choices(words, k=rng.randint(100, 400)))} for _ in range(n)]
    path.write_text(json.dumps(rows))


def write_pair_data(path: Path, seq_len: int, n: int = 64) -> None:
    """Preference pairs (TRL's ``prompt``/``chosen``/``rejected``) whose every sequence is longer
    than ``seq_len`` tokens of :func:`build_model`'s tokenizer (at least one token per word), so
    each one is cut to exactly ``seq_len`` (the start of the prompt goes) and every micro-batch is
    full: the peak the memory model predicts for ``data.max_seq_len``."""
    rng = random.Random(2)
    words = "the of and to in is was for on that with as by at from it this be are or an hike bird sea".split()

    def text(k: int) -> str:
        return " ".join(rng.choices(words, k=k))

    rows = [{"prompt": text(seq_len), "chosen": text(seq_len // 4), "rejected": text(seq_len // 4)} for _ in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def run_config(name: str, overrides: list[str], model_dir: Path, data: Path, work: Path, steps: int, smoke: bool) -> dict:
    import yaml

    recipe = {
        "name": name,
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "packing": True},
        "training": {"max_steps": steps, "lr": 1e-4, "gradient_accumulation": 1, "warmup_steps": 0},
        "checkpointing": {"save_every": None},
        "logging": {"tensorboard": False},
        "output_dir": str(work / name),
    }
    if smoke:
        overrides = [o.replace("2048", "256") for o in overrides] + ["quantization.compute_dtype=fp32"] * ("method=qlora" in overrides)
    rpath = work / f"{name}.yaml"
    rpath.write_text(yaml.safe_dump(recipe))
    t0 = time.perf_counter()
    cmd = [*python_command(), "-m", "finetuner.cli.main", "run", str(rpath), "--no-resume", "-q"]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        log(proc.stdout[-3000:], proc.stderr[-3000:])
        return {"config": name, "error": proc.stderr[-500:]}
    events = [json.loads(l) for l in (work / name / "events.jsonl").read_text().splitlines()]
    steps_ev = [e for e in events if e["event"] == "step"]
    start = next(e for e in events if e["event"] == "start")
    # skip the first two steps (allocator warm-up, kernel selection)
    timed, t_start = (steps_ev[2:], steps_ev[1]["elapsed_s"]) if len(steps_ev) > 2 else (steps_ev, 0.0)
    tps = sum(e["tokens"] for e in timed) / max(timed[-1]["elapsed_s"] - t_start, 1e-9)
    return {
        "config": name,
        "trainable_params": start["trainable_params"],
        "total_params": start["total_params"],
        "tokens_per_s": round(tps, 1),
        "peak_allocated_gib": round(max(e["mem_peak"] for e in steps_ev) / 2**30, 3),
        "peak_reserved_gib": round(max(e["mem_reserved"] for e in steps_ev) / 2**30, 3),
        "loss_first": steps_ev[0]["loss"],
        "loss_last": steps_ev[-1]["loss"],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--work", default="/tmp/finetuner_gpu_check")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--smoke", action="store_true", help="tiny model, short sequences (runs on CPU)")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / ("tiny" if args.smoke else args.preset)
    build_model(args.preset, model_dir, args.smoke)
    data = work / "data.json"
    write_data(data)
    results = []
    for name in args.configs.split(","):
        log(f"== {name}")
        res = run_config(name, CONFIGS[name], model_dir, data, work, args.steps, args.smoke)
        log(json.dumps(res))
        results.append(res)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    tag = "smoke" if args.smoke else args.preset
    (out / f"gpu_check_train_{tag}.json").write_text(json.dumps({"device": device, "preset": args.preset, "results": results}, indent=2))
    lines = [f"Device: {device}; model: {args.preset} shape, random weights; {args.steps} steps, packed data.", "",
             "| config | trainable | tokens/s | peak allocated GiB | peak reserved GiB | loss first → last |", "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | error | | | | |")
        else:
            lines.append(f"| {r['config']} | {r['trainable_params']:,} | {r['tokens_per_s']:.0f} | {r['peak_allocated_gib']:.2f} | {r['peak_reserved_gib']:.2f} | {r['loss_first']:.3f} → {r['loss_last']:.3f} |")
    (out / f"gpu_check_train_{tag}.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))


if __name__ == "__main__":
    main()

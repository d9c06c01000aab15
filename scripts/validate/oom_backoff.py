"""A real out-of-memory error in training, and finetuner's back-off recovering from it (GPU).

Three runs of the same recipe (a random-weight Llama-shaped model, packed synthetic rows, so
every micro-batch has the same length), each in its own process so each peak is clean:

1. **reference**: micro-batch M, no memory limit: its losses and its peak memory;
2. **small**: micro-batch M/4, no limit: its peak (the limit of run 3 sits just above it);
3. **limited**: micro-batch M under ``torch.cuda.set_per_process_memory_fraction`` set between the
   two peaks: micro-batch M and M/2 run out of memory for real (``torch.OutOfMemoryError`` from
   the caching allocator), finetuner halves the micro-batch twice (same effective batch) and the
   run finishes on the reference's losses (bf16 noise).

The result goes to ``--out/oom_backoff[_smoke].json``; the exit status is 1 when the limited run
did not recover. ``--smoke`` runs on the CPU with a tiny model, where no real out-of-memory error
can be provoked: the limited run gets an injected one instead (``FINETUNER_FAULT=OOM@2*2``), which
checks the script and the back-off path, not the allocator (and its memory figures are the
process's resident memory, not CUDA allocations).

Usage:
    python -m scripts.validate.oom_backoff --out /tmp/oom            # on a CUDA machine
    python -m scripts.validate.oom_backoff --smoke --out /tmp/oom    # CPU, about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from finetuner.children import python_command

REPO = Path(__file__).resolve().parents[2]


def log(*a) -> None:
    print(*a, flush=True)


def build_model(folder: Path, smoke: bool) -> None:
    """A random-weight Llama with a small BPE tokenizer; big activations for its weights (no
    checkpointing, long rows), so the micro-batch decides the peak."""
    if (folder / "config.json").exists():
        return
    from finetuner.model.tiny_llama import tiny_llama, train_bpe_tokenizer

    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from it this be are or an hike bird sea".split()
    tok = train_bpe_tokenizer([" ".join(rng.choices(words, k=30)) for _ in range(500)], vocab_size=1024)
    if smoke:
        model = tiny_llama(tok, hidden_size=64, num_layers=2)
    else:
        model = tiny_llama(tok, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2816,
                           max_position_embeddings=2048)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def write_data(path: Path, smoke: bool, n: int = 256) -> None:
    """Rows that fill ``data.max_seq_len`` once packed (64 tokens with --smoke, else 1,024)."""
    rng = random.Random(1)
    words = "the of and to in is was for on that with as by at from it this be are or an hike bird sea".split()
    prompt, answer = (8, 24) if smoke else (100, 300)
    rows = [{"instruction": " ".join(rng.choices(words, k=prompt)), "input": "", "output": " ".join(rng.choices(words, k=answer))}
            for _ in range(n)]
    path.write_text(json.dumps(rows), encoding="utf-8")


def recipe(name: str, model_dir: Path, data: Path, work: Path, micro: int, effective: int, steps: int, smoke: bool) -> dict:
    return {
        "name": name,
        "model": {"name": str(model_dir)},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "data": {"path": str(data), "packing": True, "max_seq_len": 64 if smoke else 1024},
        "training": {"max_steps": steps, "lr": 1e-4, "micro_batch_size": micro, "gradient_accumulation": effective // micro,
                     "warmup_steps": 0, "gradient_checkpointing": False},
        "checkpointing": {"save_every": None},
        "logging": {"tensorboard": False},
        "output_dir": str(work / name),
    }


def child(spec: dict) -> None:
    """One run in this process (``--child``): the memory limit first, then finetuner.train."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as finetuner.train sets it
    import torch

    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.runs.events import read_events

    cuda = torch.cuda.is_available()
    if spec.get("fraction") is not None:
        torch.cuda.set_per_process_memory_fraction(spec["fraction"], 0)
    result = finetuner.train(Recipe.from_dict(spec["recipe"]), resume=False)
    events = read_events(Path(result.run_dir) / "events.jsonl")
    out = {
        "losses": result.losses,
        "backoffs": [{k: e[k] for k in ("step", "old_micro_batch_size", "micro_batch_size", "gradient_accumulation", "message")}
                     for e in events if e["event"] == "oom_backoff"],
        "micro_batch_per_step": [e["micro_batch_size"] for e in events if e["event"] == "step"],
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()) if cuda else result.metrics.get("mem_peak"),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()) if cuda else None,
        "allocated_after_backoff_bytes": next((e["mem_allocated"] for e in events if e["event"] == "step"
                                               and any(b["step"] == e["step"] for b in events if b["event"] == "oom_backoff")), None),
    }
    Path(spec["result"]).write_text(json.dumps(out), encoding="utf-8")


def run_child(name: str, spec: dict, work: Path, fault: str | None = None) -> dict:
    spec = {**spec, "result": str(work / f"{name}.result.json")}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("FINETUNER_FAULT", None)
    if fault:
        env["FINETUNER_FAULT"] = fault
    t0 = time.perf_counter()
    proc = subprocess.run([*python_command(), "-m", "scripts.validate.oom_backoff", "--child", json.dumps(spec)],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        log(proc.stdout[-3000:], proc.stderr[-3000:])
        return {"error": proc.stderr[-1000:], "returncode": proc.returncode}
    res = json.loads(Path(spec["result"]).read_text(encoding="utf-8"))
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    log(f"{name}: {json.dumps({k: v for k, v in res.items() if k != 'losses'})}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the JSON result (required)")
    ap.add_argument("--work", default=None, help="scratch folder (default: OUT/work)")
    ap.add_argument("--micro", type=int, default=16, help="the micro-batch that should not fit (a multiple of 4)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, an injected out-of-memory error")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    if not args.out:
        ap.error("the following argument is required: --out")
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        log("No CUDA device: a real out-of-memory error needs a GPU (use --smoke for the CPU check).")
        return 2
    micro = 4 if args.smoke else args.micro
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model_dir, data = work / ("tiny" if args.smoke else "llama-1024x8"), work / "data.json"
    build_model(model_dir, args.smoke)
    write_data(data, args.smoke)

    def spec(name, m, fraction=None):
        return {"recipe": recipe(name, model_dir, data, work, m, micro, args.steps, args.smoke), "fraction": fraction}

    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "mode": "gpu" if cuda else "smoke (injected fault)",
                    "micro_batch_size": micro, "effective_batch": micro, "steps": args.steps}
    report["reference"] = ref = run_child("reference", spec("reference", micro), work)
    if cuda:
        report["small"] = small = run_child("small", spec("small", micro // 4), work)
        if "error" in ref or "error" in small:
            limited = {"error": "a run without a memory limit failed"}
        else:
            total = torch.cuda.get_device_properties(0).total_memory
            # between micro M/4 and M/2: 20 % of the way from the M/4 peak to the M peak, and at
            # least 5 % above the M/4 run's reserved peak (the limit applies to reserved memory)
            limit = max(small["peak_allocated_bytes"] + 0.2 * (ref["peak_allocated_bytes"] - small["peak_allocated_bytes"]),
                        1.05 * small["peak_reserved_bytes"])
            report["limit_bytes"], report["fraction"] = int(limit), limit / total
            limited = run_child("limited", spec("limited", micro, limit / total), work)
    else:
        limited = run_child("limited", spec("limited", micro), work, fault="OOM@2*2")
    report["limited"] = limited
    ok = "error" not in ref and "error" not in limited and bool(limited["backoffs"])
    if ok:
        report["final_micro_batch_size"] = limited["micro_batch_per_step"][-1]
        report["max_loss_diff"] = max(abs(a - b) for a, b in zip(ref["losses"], limited["losses"]))
        ok = len(limited["losses"]) == len(ref["losses"]) == args.steps and report["max_loss_diff"] < (2e-2 if cuda else 1e-4)
    report["recovered"] = ok
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"oom_backoff{'' if cuda else '_smoke'}.json"
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    log(f"{'recovered' if ok else 'NOT recovered'}: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

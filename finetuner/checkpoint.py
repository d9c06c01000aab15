"""Resumable training checkpoints, written atomically and pruned to the last K.

Layout of ``<run>/checkpoints/step-00000040/``:

- ``adapter/`` — the trainable weights, ``save_pretrained`` (safetensors): the LoRA adapter, or
  the whole model for full fine-tuning;
- ``optimizer.pt``, ``scheduler.pt``, ``rng.pt`` — torch state dicts, read back with
  ``weights_only=True`` (no arbitrary pickles);
- ``trainer_state.json`` — step, tokens seen, elapsed time, loss history, and the micro-batch
  and accumulation actually in use.

A checkpoint is written into ``.tmp-step-…`` and renamed into place only when complete, so a
run killed at any moment leaves either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from finetuner.fileio import atomic_write_json, publish_dir

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / "trainer_state.json").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, state: dict[str, Any], keep_last: int) -> Path:
    import torch

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "adapter", safe_serialization=True)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / "rng.pt")
    atomic_write_json(tmp / "trainer_state.json", state)
    if final.exists():  # the same step saved again (e.g. a final save right after a periodic one)
        shutil.rmtree(final)
    publish_dir(tmp, final)
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / "trainer_state.json").read_text(encoding="utf-8"))


def restore_checkpoint(ckpt: Path, model, optimizer, scheduler, full: bool) -> dict[str, Any]:
    """Load weights, optimizer, scheduler and RNG state from ``ckpt``; return its trainer state."""
    import torch
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    weights_dir = ckpt / "adapter"
    if full:
        state_dict: dict[str, Any] = {}
        for f in sorted(weights_dir.glob("*.safetensors")):
            state_dict.update(load_file(f))
        model.load_state_dict(state_dict, strict=False)
    else:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(weights_dir / "adapter_model.safetensors"))
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location="cpu"))
    scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return load_trainer_state(ckpt)

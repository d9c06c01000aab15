"""Resumable training checkpoints, written atomically and pruned to the last K.

Layout of ``<run>/checkpoints/step-00000040/``:

- ``adapter/`` — the trainable weights, ``save_pretrained`` (safetensors): the LoRA adapter, or
  the whole model for full fine-tuning;
- ``optimizer.pt``, ``scheduler.pt`` (and ``scaler.pt`` for fp16) — torch state dicts, read back
  with ``weights_only=True`` (no arbitrary pickles);
- ``rng_rank0.pt``, ``rng_rank1.pt``, … — each process's random generators (Python's, NumPy's,
  torch's CPU and CUDA ones), written by that process, so that every rank of a multi-process run
  draws the same dropout masks after a resume as it would have without the interruption
  (checkpoints of older versions hold one ``rng.pt``, rank 0's, which every rank then resumes with);
- ``recipe.yaml`` — the resolved recipe the checkpoint was made with;
- ``trainer_state.json`` — step, tokens seen, elapsed time, loss history, and the micro-batch
  and accumulation actually in use;
- ``deepspeed/`` instead of ``optimizer.pt`` in a DeepSpeed ZeRO run: the engine's sharded
  optimizer states, one file per process, written and read by the engine; ``fsdp/`` instead of
  it in an FSDP run: the trained weights' and the optimizer's shards, one file per process,
  through ``torch.distributed.checkpoint`` (such checkpoints resume only with the same strategy
  and number of processes).

A checkpoint is written into ``.tmp-step-…`` and renamed into place only when complete, so a
run killed at any moment leaves either the old checkpoint or the new one, never half of one.
Resuming reads a checkpoint whole before applying any of it; one that cannot be read (a
truncated file, a missing part, weights that hold NaN or inf) is reported and the one before it is used.
Pruning to the last ``keep_last`` gives up the unreadable checkpoints of later steps that such a
resume left behind before any checkpoint written since, and never the one just written.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import finetuner.device as dev
from finetuner.checkpoint_layout import (  # noqa: F401  (the trainer's modules read them here)
    STEP_DIR, checkpoint_dirs, latest_checkpoint, load_trainer_state, remove_staging, staging_dir)
from finetuner.fileio import atomic_write_json, give_back, publish_dir
from finetuner.quiet import quieted
from finetuner.strategy_table import DEEPSPEED_ENGINE, SHARD_DIRS, checkpoint_dir_of

log = logging.getLogger(__name__)

#: the folder of a checkpoint that holds a DeepSpeed engine's own (sharded) state
ENGINE_DIR = checkpoint_dir_of(DEEPSPEED_ENGINE)


def is_sharded(ckpt: Path) -> bool:
    """Whether ``ckpt`` holds an engine's sharded state, which resuming unpickles (:mod:`finetuner.training.seal`)."""
    return any((Path(ckpt) / d).is_dir() for d in SHARD_DIRS)


def start_checkpoint(run_dir: Path, step: int) -> Path:
    """An empty :func:`staging_dir` for the checkpoint of ``step``."""
    tmp = staging_dir(run_dir, step)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def rng_file(rank: int) -> str:
    """The name of the file of a checkpoint that holds the random generators' state of ``rank``."""
    return f"rng_rank{rank}.pt"


#: the single RNG file of checkpoints written before each rank saved its own (rank 0's state)
OLD_RNG_FILE = "rng.pt"


def write_rng_state(tmp: Path, rank: int = 0) -> None:
    """Save this process's random generators (Python's, NumPy's, torch's CPU and CUDA ones) into the
    checkpoint being written in ``tmp``, as :func:`rng_file` of ``rank``; each rank calls this."""
    import random

    import numpy as np
    import torch

    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    rng: dict[str, Any] = {  # plain numbers and tensors only: read back with weights_only=True
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached_gaussian)},
        "cpu": torch.get_rng_state(),
    }
    devices = dev.rng_state()
    if devices is not None:
        rng[dev.CUDA] = devices
    torch.save(rng, tmp / rng_file(rank))


def write_checkpoint_parts(
    tmp: Path, model, optimizer, scheduler, state: dict[str, Any], scaler=None, recipe_yaml: str | None = None, midway=None,
    rank: int = 0, weights: dict[str, Any] | None = None,
) -> None:
    """Write a checkpoint's parts into ``tmp``; ``optimizer=None`` when an engine keeps the optimizer
    states itself (:data:`ENGINE_DIR`); ``weights``: see :func:`save_weights`. ``midway()`` is called after the weights, before the rest
    (the fault point of :mod:`finetuner.training.faults`' ``KILL@save:STEP``). The RNG state
    written is this process's, as ``rank``'s; in a multi-process run the other ranks write theirs
    with :func:`write_rng_state` into the same ``tmp`` before it is published."""
    import torch

    with quieted():
        save_weights(model, tmp / "adapter", weights)
    if midway is not None:
        midway()
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    write_rng_state(tmp, rank)
    if scaler is not None:
        torch.save(scaler.state_dict(), tmp / "scaler.pt")
    if recipe_yaml is not None:
        (tmp / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
    atomic_write_json(tmp / "trainer_state.json", state)


def save_weights(model, folder: Path, weights: dict[str, Any] | None = None) -> None:
    """``model.save_pretrained(folder)`` (safetensors): a peft adapter or a whole model; ``weights``:
    the state dict to save instead of the model's own (gathered from the ranks when the model's
    parameters are sharded)."""
    if weights is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True, state_dict=weights)


def prune_order(dirs: list[Path], step: int) -> list[Path]:
    """The checkpoints ``dirs`` (oldest step first) in the order they are given up, after ``step``'s
    was written: first those of later steps, then the others oldest first. A checkpoint of a later
    step than the one just written is left from before the run resumed from an earlier one, which
    it does only when the later ones cannot be read; they go before any the run wrote since, so
    that the newest (the one just written last of all) are kept."""

    def step_of(p: Path) -> int:
        return int(STEP_DIR.match(p.name).group(1))

    return [p for p in dirs if step_of(p) > step] + [p for p in dirs if step_of(p) <= step]


def publish_checkpoint(run_dir: Path, step: int, keep_last: int) -> Path:
    """Rename the complete :func:`staging_dir` of ``step`` into place and prune to the last ``keep_last``
    (in :func:`prune_order`: unreadable ones left from before a resume go first; never ``step``'s)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    if final.exists():  # the same step saved again (e.g. a final save right after a periodic one)
        shutil.rmtree(final)
    publish_dir(staging_dir(run_dir, step), final)
    for old in prune_order(checkpoint_dirs(run_dir), step)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    remove_staging(run_dir)
    return final


def save_checkpoint(
    run_dir: Path, step: int, model, optimizer, scheduler, state: dict[str, Any], keep_last: int, scaler=None,
    recipe_yaml: str | None = None, midway=None,
) -> Path:
    """Write the checkpoint of ``step`` (see the module's docstring) and prune older ones."""
    tmp = start_checkpoint(run_dir, step)
    try:
        write_checkpoint_parts(tmp, model, optimizer, scheduler, state, scaler, recipe_yaml, midway)
    except Exception as e:  # a full disk, say: give the space of the half-written checkpoint back
        give_back(tmp, e)
        raise
    return publish_checkpoint(run_dir, step, keep_last)


class CheckpointUnreadable(Exception):
    """A checkpoint folder exists but one of its parts cannot be read."""


def _read_rng_state(ckpt: Path, rank: int, world_size: int) -> dict[str, Any]:
    """The RNG state ``rank`` resumes with: its own, or in a checkpoint without it (an older version's
    ``rng.pt``, or one saved by fewer processes) rank 0's, which rank 0 warns about."""
    import torch

    old = (ckpt / OLD_RNG_FILE).is_file()  # rank 0's
    missing = [r for r in range(world_size) if not ((ckpt / rng_file(r)).is_file() or (r == 0 and old))]
    if missing and rank == 0 and world_size > 1:
        log.warning(
            "%s holds no random-generator state of rank %s (saved by an older version of finetuner or by fewer "
            "processes); rank 0's is used instead, so the resumed run's dropout masks differ from those of an "
            "uninterrupted run.", ckpt.name, ", ".join(map(str, missing)),
        )
    for name in (rng_file(rank), rng_file(0), OLD_RNG_FILE):
        if (ckpt / name).is_file():
            return torch.load(ckpt / name, weights_only=True)
    raise FileNotFoundError(f"no random-generator state ({rng_file(rank)}) in {ckpt}")


def read_checkpoint(ckpt: Path, engine: bool = False, rank: int = 0, world_size: int = 1, engine_dir: str = ENGINE_DIR) -> dict[str, Any]:
    """Read every part of a checkpoint into memory, touching no model: fails before anything is applied.

    ``engine=True`` (a sharded run: DeepSpeed's engine, FSDP): the weights and optimizer states are
    the strategy's to load from its folder ``engine_dir`` (:data:`ENGINE_DIR` for DeepSpeed); a
    checkpoint without that folder cannot be resumed by it.
    ``rank`` of ``world_size`` processes: whose RNG state is read (see :func:`_read_rng_state`).
    """
    import torch
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    if engine and not (ckpt / engine_dir).is_dir():
        raise CheckpointUnreadable("not a DeepSpeed checkpoint" if engine_dir == ENGINE_DIR else f"no {engine_dir}/ shards in it")
    try:
        weights: dict[str, Any] | None = None
        if not engine:
            weights = {}
            files = sorted((ckpt / "adapter").glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no weights in {ckpt / 'adapter'}")
            for f in files:
                weights.update(load_file(f))
            bad = [name for name, w in weights.items() if w.is_floating_point() and not bool(torch.isfinite(w).all())]
            if bad:  # written before finetuner refused to save such weights: resuming would train NaNs
                raise ValueError(f"{len(bad)} of its {len(weights)} weight tensors hold NaN or inf values (e.g. {bad[0]})")
        parts = {
            "weights": weights,
            "optimizer": None if engine else torch.load(ckpt / "optimizer.pt", weights_only=True, map_location="cpu"),
            "scheduler": torch.load(ckpt / "scheduler.pt", weights_only=True),
            "rng": _read_rng_state(ckpt, rank, world_size),
            "state": load_trainer_state(ckpt),
        }
        scaler = ckpt / "scaler.pt"
        parts["scaler"] = torch.load(scaler, weights_only=True) if scaler.exists() else None
        return parts
    except Exception as e:  # truncated or missing files, bad JSON, unpicklable content
        raise CheckpointUnreadable(f"{ckpt.name}: {type(e).__name__}: {e}") from e


def apply_checkpoint(parts: dict[str, Any], model, optimizer, scheduler, scaler, full: bool) -> dict[str, Any]:
    """Load what :func:`read_checkpoint` read into the model, optimizer, scheduler and RNGs (the
    weights and optimizer states only when it read them: not for an engine's checkpoint)."""
    import torch

    if parts["weights"] is not None and full:
        model.load_state_dict(parts["weights"], strict=False)
    elif parts["weights"] is not None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, parts["weights"])
    if parts["optimizer"] is not None:
        optimizer.load_state_dict(parts["optimizer"])
    scheduler.load_state_dict(parts["scheduler"])
    if scaler is not None and parts["scaler"] is not None:
        scaler.load_state_dict(parts["scaler"])
    set_rng_state(parts["rng"])
    return parts["state"]


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore what :func:`write_rng_state` saved (an older ``rng.pt`` holds torch's generators only)."""
    import random

    import numpy as np
    import torch

    torch.set_rng_state(rng["cpu"])
    dev.set_rng_state(rng.get(dev.CUDA))
    if "python" in rng:
        py = rng["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "numpy" in rng:
        n = rng["numpy"]
        np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))

"""Where a run folder keeps its checkpoints: ``<run>/checkpoints/step-00000040/``, complete once it holds
``trainer_state.json`` (and the staging folders a checkpoint is written into before it is renamed into place).

Torch-free and low in the package order: the trainer writes checkpoints (:mod:`finetuner.training.checkpoint`),
while the run folder (:mod:`finetuner.runs.folder`, resuming and disk space) and inference
(:mod:`finetuner.infer.loading`, a run's last adapter) only find them, which needs this layout alone.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

#: the folder of a run that holds its checkpoints
CHECKPOINTS_DIR = "checkpoints"
#: a complete checkpoint's folder name, its step in group 1
STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / "trainer_state.json").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's last complete checkpoint, None when it has none."""
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json``: its step, tokens seen, loss history and batch in use."""
    return json.loads((Path(ckpt) / "trainer_state.json").read_text(encoding="utf-8"))


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before :func:`~finetuner.training.checkpoint.publish_checkpoint` renames it into place."""
    return Path(run_dir) / CHECKPOINTS_DIR / f".tmp-step-{step:08d}"


def remove_staging(run_dir: Path) -> list[tuple[str, int]]:
    """Remove every :func:`staging_dir` of the run: checkpoints that were never completed (a full disk, a
    process killed while it wrote), which no resume reads. Returns the name and size of each. Only where
    nothing writes into them: once a step's checkpoint is published, under the run's lock before its
    processes start, or after they have all ended."""
    from finetuner.fileio import tree_bytes

    removed = []
    for stale in sorted((Path(run_dir) / CHECKPOINTS_DIR).glob(".tmp-step-*")):
        removed.append((stale.name, tree_bytes(stale)))
        shutil.rmtree(stale, ignore_errors=True)
    return removed

"""Where a run folder keeps its checkpoints: ``<run>/checkpoints/step-00000040/``, complete once it holds
``trainer_state.json``.

Torch-free and low in the package order: the trainer writes checkpoints (:mod:`finetuner.training.checkpoint`),
while the run folder (:mod:`finetuner.runs.folder`, resuming and disk space) and inference
(:mod:`finetuner.infer.loading`, a run's last adapter) only find them, which needs this layout alone.
"""

from __future__ import annotations

import re
from pathlib import Path

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

"""``--profile-memory``: the CUDA allocations of a run's first steps, written to ``memory_snapshot.pickle`` in the
run folder (open it at https://pytorch.org/memory_viz)."""

from __future__ import annotations

import logging
from pathlib import Path

import finetuner.device as dev
from finetuner.config.runtime import Runtime

log = logging.getLogger(__name__)


def start_memory_profile(rt: Runtime) -> bool:
    """Start recording CUDA allocations; whether they are recorded (not on a run off CUDA: a warning says so)."""
    if not rt.is_cuda:
        log.warning("--profile-memory records CUDA allocations; this run is on %s, so nothing is recorded.", rt.device)
        return False
    dev.record_allocations(max_entries=200_000)
    return True


def dump_memory_profile(run_dir: Path, events, step: int) -> bool:
    """Write the snapshot (open it at https://pytorch.org/memory_viz), stop recording and say so in the
    ``memory_snapshot`` event of ``events`` (the run's event writer); False: nothing is recorded any more."""
    path = run_dir / "memory_snapshot.pickle"
    dev.dump_allocations(str(path))
    events.emit("memory_snapshot", step=step, path=str(path))
    return False

"""What a training run returns (:func:`finetuner.train`), in a module of its own so that the
single-process trainer and the multi-process launcher both build it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainResult:
    """What :func:`train` returns: where everything is, and the final metrics."""

    run_dir: Path
    adapter_dir: Path
    metrics: dict[str, Any]
    stopped: bool = False
    losses: list[float] = field(default_factory=list)
    #: Set when the run folder already held a finished run that this recipe would not extend:
    #: what was found and what to do (nothing was trained or changed).
    finished: str | None = None

"""What makes a folder a run folder: the marker finetuner writes into every run folder it sets up.

A bottom module, apart from :mod:`finetuner.runs.folder` (which reads recipes), so that reading a recipe can ask
it: a run folder's own ``recipe.yaml`` trains in the folder it was read from
(:meth:`finetuner.config.recipe.Recipe.from_yaml`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: The file finetuner writes into every run folder it sets up (JSON: when, by which process).
RUN_MARKER = ".finetuner-run"


def is_run_folder(folder: Path) -> bool:
    """Whether finetuner made ``folder`` as a run folder: its :data:`RUN_MARKER`, or (folders made
    before the marker) ``recipe.yaml`` and ``events.jsonl`` both. A folder the user made and put a
    ``recipe.yaml`` in is not one."""
    folder = Path(folder)
    return (folder / RUN_MARKER).is_file() or ((folder / "recipe.yaml").is_file() and (folder / "events.jsonl").is_file())


def mark_run_folder(folder: Path) -> None:
    """Write :data:`RUN_MARKER` into a run folder finetuner sets up (once; atomically)."""
    import json

    from finetuner.fileio import atomic_write_text

    marker = Path(folder) / RUN_MARKER
    if not marker.is_file():
        atomic_write_text(marker, json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid()}) + "\n")

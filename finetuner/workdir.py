"""finetuner's own working folder: where the processes it starts run (the web UI's training jobs, torchrun and its
ranks) and where the trackers' libraries start, instead of a run folder or whatever folder a user typed a command in.

Why: a run folder may come from someone else, and libraries read settings from their working folder. W&B reads
``./wandb/settings`` (``base_url``, ``mode``) when it sets itself up and ``./config-defaults.yaml`` on every
``wandb.init``: a received run folder holding them sent the user's API key and the run's stream to the sender's
server when the UI resumed it (the job ran inside the run folder), or when ``finetuner run`` resumed it typed inside
the folder (issue 66). Started here, they read only the user's own settings (the environment, ``~/.config/wandb``).

The folder is ``work/`` in finetuner's private folder (:func:`private_dir`, where the checkpoint key lives): made
when missing, used only while it is a real folder of this user's that no one else can enter, else a new private
temporary folder is used instead.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: the working folder's name in finetuner's private folder
WORK = "work"
_made: list[Path] = []  # the temporary folder this process fell back to, once


def _ours(path: Path, forbidden: int) -> bool:
    """Whether ``path`` is a real folder (not a link) of this user's without the ``forbidden`` mode bits."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & forbidden


def private_dir() -> Path:
    """finetuner's private folder, where its key and working folder live: ``$FINETUNER_CONFIG_DIR``, else
    ``$XDG_CONFIG_HOME/finetuner``, else ``~/.config/finetuner``."""
    if os.environ.get("FINETUNER_CONFIG_DIR"):
        return Path(os.environ["FINETUNER_CONFIG_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "finetuner"


def work_dir() -> Path:
    """finetuner's private working folder (made, mode 0700, when missing)."""
    path = private_dir() / WORK
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        pass
    if _ours(path, 0o077) and _ours(path.parent, 0o022):  # no one else enters it, or swaps it for another
        return path.resolve()
    if not _made:  # not ours alone (a link, another owner, others may enter it): a fresh private folder instead
        _made.append(Path(tempfile.mkdtemp(prefix="finetuner-work-")))
    return _made[0]


@contextlib.contextmanager
def in_work_dir() -> Iterator[Path]:
    """Run the block with :func:`work_dir` as the working folder, then go back (for a tracker's library setting
    itself up: W&B reads ``./wandb/settings``; relative paths given to it must be made absolute before)."""
    here = os.getcwd()
    there = work_dir()
    os.chdir(there)
    try:
        yield there
    finally:
        os.chdir(here)

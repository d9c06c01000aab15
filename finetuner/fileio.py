"""Atomic file and folder writes: a reader never sees a half-written file. And user paths."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def expand_user(path: str | Path) -> Path:
    """``Path(path).expanduser()``, or the path as given when ``~user`` names no user on this
    machine (pathlib raises RuntimeError there): the caller then reports a missing file."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def exists(path: str | Path, kind: str = "any") -> bool:
    """Whether ``path`` exists (``kind``: ``any``, ``file`` or ``dir``). A name the system refuses
    (too long, ...) names nothing there: False, where pathlib raises OSError."""
    p = Path(path)
    try:
        return p.is_file() if kind == "file" else p.is_dir() if kind == "dir" else p.exists()
    except OSError:
        return False


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def private_temp_dir(prefix: str, owner: object | None = None) -> Path:
    """A new folder under the system's temp folder that only this user can enter (mode 0700, an
    unpredictable name: :func:`tempfile.mkdtemp`, never a fixed name someone else could have
    made first), removed with everything in it when ``owner`` is garbage collected or, at the
    latest, when the process exits."""
    import shutil
    import weakref

    path = Path(tempfile.mkdtemp(prefix=prefix))
    if owner is not None:
        weakref.finalize(owner, shutil.rmtree, path, True)
    else:
        import atexit

        atexit.register(shutil.rmtree, path, True)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename: a new file
    made with ``O_CREAT | O_EXCL`` (:func:`tempfile.mkstemp`), so a symbolic link already at
    ``path`` is replaced, never followed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written ``tmp_dir`` to ``final_dir`` in one rename (same filesystem)."""
    for root, _dirs, files in os.walk(tmp_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    os.replace(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)


def tree_bytes(folder: str | Path) -> int:
    """Bytes of the files under ``folder``; files removed while it walks (an old checkpoint being
    deleted by a running job) count as gone."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

"""Atomic file and folder writes: a reader never sees a half-written file. And user paths."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

from finetuner.errors import UserError


def cache_root() -> Path:
    """The folder of finetuner's caches: ``$FINETUNER_CACHE_DIR``, else ``$XDG_CACHE_HOME/finetuner``, else
    ``~/.cache/finetuner``."""
    if os.environ.get("FINETUNER_CACHE_DIR"):
        return Path(os.environ["FINETUNER_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "finetuner"


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


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename: a new file
    made with ``O_CREAT | O_EXCL`` (:func:`tempfile.mkstemp`), so a symbolic link already at
    ``path`` is replaced, never followed. Its mode: ``mode``, else the umask's (:func:`file_mode`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), file_mode() if mode is None else mode)  # mkstemp makes it 0600; a file written in place gets the umask's mode
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def file_mode() -> int:
    """The mode a new file gets from this process's umask (0644 under the usual 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def publish_dir(tmp_dir: Path, final_dir: Path, mode: int | None = None) -> None:
    """Move a fully written ``tmp_dir`` to ``final_dir`` in one rename (same filesystem). Its files get ``mode``,
    else the umask's (:func:`file_mode`): libraries write some of them 0600 through temporary files of their own
    (transformers' and peft's ``*.safetensors``), the others of the folder 0644."""
    mode = file_mode() if mode is None else mode
    for root, _dirs, files in os.walk(tmp_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fchmod(f.fileno(), mode)
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


# ---------------------------------------------------------------------- a full disk
#: ``errno`` of a write refused for want of space: no space left, disk quota exceeded
DISK_FULL_ERRNOS = (28, 122)  # ENOSPC, EDQUOT (Linux numbers; errno.ENOSPC is 28 on every platform finetuner runs on)
#: how libraries that do not raise ``OSError`` report it: safetensors' Rust writer (``os error 28``,
#: ``StorageFull``), torch's zip writer (``file write failed`` / ``inline_container.cc … unexpected pos``)
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "storagefull", "disk quota exceeded", "os error 122")
_WRITE_FAILED_TEXT = ("file write failed", "unexpected pos")
#: below this much free space a failed write of torch's zip writer (which gives no reason) is taken for a full disk
_NEARLY_FULL_BYTES = 64 * 2**20
#: numpy's ``tofile`` (the gguf package's writer of tensor data) when the kernel took only part of a write: an
#: ``OSError`` with no errno, ``145024 requested and 132384 written``
_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def size_text(n: float) -> str:
    """A size in words with the precision that says something: ``0 bytes``, ``812 KiB``, ``3.4 MiB``, ``1.25 GiB``."""
    n = max(0.0, float(n))
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if n < scale * 1024 or unit == "TiB":
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}" if value >= 10 else f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def free_bytes(path: str | Path) -> int | None:
    """Free space on the file system of ``path`` (its nearest existing parent), or None if unknown."""
    import shutil

    p = Path(path).absolute()
    for candidate in (p, *p.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _chain(error: BaseException):
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_disk_full(error: BaseException, path: str | Path | None = None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a write refused for want of disk space:
    an ``OSError`` ENOSPC/EDQUOT, safetensors' ``os error 28``, or a write that failed without saying why
    while the disk of ``path`` is (nearly) full: torch's zip writer's, or a short write (numpy's ``N requested
    and M written``, with no errno) where less than the bytes it could not write are free. Ask before the
    half-written file is removed: its removal gives the space back."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        text = str(e).lower()
        if any(marker in text for marker in _DISK_FULL_TEXT):
            return True
        if path is None:
            continue
        short = _SHORT_WRITE.search(text) if isinstance(e, OSError) else None
        if short or any(marker in text for marker in _WRITE_FAILED_TEXT):
            free = free_bytes(path)
            left = int(short.group(1)) - int(short.group(2)) if short else 0
            if free is not None and free < max(_NEARLY_FULL_BYTES, left):
                return True
    return False


def give_back(folder: Path, error: BaseException) -> None:
    """Remove ``folder``, half-written when ``error`` stopped the write, and give its space back now. The
    files the failing writer still held open (torch's zip writer, from the frames of the error's traceback)
    are closed first: a removed file that is still open keeps its space until it is closed, and a message
    about the free space made before would say too little."""
    import shutil
    import traceback

    for e in _chain(error):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)  # the frames' locals released: their files closed
    shutil.rmtree(folder, ignore_errors=True)


def disk_full_path(error: BaseException) -> str | None:
    """The file an ``OSError`` in ``error``'s chain names, if any."""
    return next((str(e.filename) for e in _chain(error) if isinstance(e, OSError) and e.filename), None)


class DiskFull(UserError):
    """A write to ``path`` that ran out of space: how much is free now, how much to free (``need_bytes``,
    when known: what the command that comes next needs in all) and ``then``, what to do next. It keeps
    what it was made of, so that another process (the launcher of a multi-process run, which removes
    the half-written checkpoint after its ranks have ended) can say it again with the space free then
    (:func:`finetuner.worker_protocol.error_of`)."""

    def __init__(self, path: str | Path, then: str, need_bytes: int | None = None):
        self.path, self.then, self.need_bytes = str(path), then, need_bytes
        free = free_bytes(path)
        has = f" ({size_text(free)} free)" if free is not None else ""
        if need_bytes and free is not None:
            need = f"at least {size_text(max(need_bytes - free, 0))} more on that disk ({size_text(need_bytes)} free in all)"
        else:
            need = f"at least {size_text(need_bytes)} on that disk" if need_bytes else "some space on that disk"
        super().__init__(f"No space left on device while writing {path}{has}.", hint=f"Free {need}, then {then}.")

    def fields(self) -> dict[str, Any]:
        """What it was made of (``DiskFull(**fields)`` says it again)."""
        return {"path": self.path, "then": self.then, "need_bytes": self.need_bytes}


@contextlib.contextmanager
def disk_full_as_user_error(path: str | Path, then: str, need_bytes: int | None = None) -> Iterator[None]:
    """Turn a write that fails for want of disk space inside the block into :class:`DiskFull`
    (one line, no traceback); any other error passes through unchanged."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e, path):
            raise
        raise DiskFull(path, then, need_bytes) from None


# ---------------------------------------------------------------------- a test's pause inside a write
#: the variable of the tests' faults (finetuner.training.faults), and the gate file of their holds
FAULT_ENV, HOLD_ENV = "FINETUNER_FAULT", "FINETUNER_HOLD_FILE"
#: the points inside a one-off write that ``FINETUNER_FAULT=HOLD@POINT`` names: a merge's staging folder made, a
#: GGUF file's header written, a run's final adapter folder made; the rest of the write not done yet
HOLD_POINTS = ("merge", "export", "adapter")


def hold(point: str) -> None:
    """At ``point`` of a write (one of :data:`HOLD_POINTS`), wait for as long as the gate file ``$FINETUNER_HOLD_FILE``
    exists when ``$FINETUNER_FAULT`` holds ``HOLD@point``; go on at once otherwise (always, in normal use). A pause,
    no fault: a test fills the disk under the write, or sends the process a signal, at that point however fast
    the machine. A signal's handler that raises (Ctrl-C, SIGTERM under :func:`finetuner.children.stop_signals_abort`)
    ends the wait as it would end the write."""
    planned = {item.strip().upper() for item in os.environ.get(FAULT_ENV, "").split(",")}
    if f"HOLD@{point.upper()}" not in planned:
        return
    import time

    gate = os.environ.get(HOLD_ENV, "")
    while gate and os.path.exists(gate):
        time.sleep(0.05)

"""Sealed checkpoints: a sharded checkpoint is resumed only if this user's finetuner wrote it, unchanged.

Why: the sharded checkpoints of FSDP (``torch.distributed.checkpoint``: ``.metadata`` is read with
``pickle.load``, non-tensor items with ``torch.load(weights_only=False)``) and of DeepSpeed ZeRO
(its state files, loaded with ``weights_only=False``) are unpickled when a run resumes, and
unpickling a crafted file runs its code. A run folder may come from someone else (a colleague, a
download), so what finetuner reads of it must not be able to run code unless the user says so.
(One-process and DDP checkpoints hold safetensors and ``weights_only=True`` state dicts: nothing
to seal.)

How: when rank 0 has seen every rank write its share, it writes ``seal.json`` into the checkpoint:
the size and SHA-256 of every file in it, and an HMAC-SHA256 of that list under a key only this
user has (:func:`key_path`, made on first use, mode 0600 in a 0700 folder). Before any rank unpickles
anything, rank 0 checks the seal (:func:`check`):

- the HMAC does not match (another machine's or another user's checkpoint, or none: an older
  finetuner's, a received one) → :class:`NotOurs`, a :class:`~finetuner.errors.UserError`: the
  run stops and says how to opt in (``finetuner run --trust-checkpoints``, or the UI's tick);
- the HMAC matches but a file is missing, of another size or other bytes (a truncated shard, a
  garbage ``.metadata``) → :class:`~finetuner.training.checkpoint.CheckpointUnreadable`: the run
  resumes from the checkpoint before it, as with any unreadable checkpoint.

- the key itself is not private (a link, another owner, group or other access; a folder others can
  write) → :class:`KeyExposed`, a :class:`NotOurs`: whoever could read the key could have sealed a
  crafted checkpoint, so the key is refused as ssh refuses an open private key, and the fix is a new
  key, not a chmod.

With the opt-in (``FINETUNER_TRUST_CHECKPOINTS=1`` in the ranks' environment, which the launcher
sets for ``--trust-checkpoints``) the HMAC is not asked for; a seal's file list is still checked.

Cost: the files are read once more after a save and before a resume (SHA-256 runs at about
1 GB/s per core; a LoRA checkpoint is megabytes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from finetuner.cachedir import exposure
from finetuner.errors import UserError
from finetuner.fileio import atomic_write_text, file_digest
from finetuner.workdir import private_dir

#: the seal's file name inside a checkpoint folder
SEAL = "seal.json"
#: set (to 1) in the environment of a run's ranks: unsealed sharded checkpoints may be unpickled
TRUST_ENV = "FINETUNER_TRUST_CHECKPOINTS"
#: the key's file name in :func:`key_dir`
KEY_FILE = "checkpoint.key"
VERSION = 1


class NotOurs(UserError):
    """A sharded checkpoint that this user's finetuner did not seal: resuming it would unpickle it."""


def key_dir() -> Path:
    """``$FINETUNER_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/finetuner``, else ``~/.config/finetuner``
    (:func:`finetuner.workdir.private_dir`)."""
    return private_dir()


def key_path() -> Path:
    return key_dir() / KEY_FILE


class KeyExposed(NotOurs):
    """The sealing key is not private (a link, another owner, group or other access on it or its folder): anyone
    who could read it can seal a crafted checkpoint, so no seal made with it is trusted, not even after a chmod."""


def _refuse_exposed(path: Path, why: str) -> KeyExposed:
    return KeyExposed(
        f"{path}: {why}, so a checkpoint seal made with it cannot be trusted (whoever could read it can sign one).",
        hint=f"Remove it (rm {path}; a chmod is not enough: a copy may have been read): finetuner makes a new private "
             "key (mode 0600 in a 0700 folder) on the next run; a sharded checkpoint sealed with the old key then "
             "resumes only with --trust-checkpoints, if you trust everyone who could read the key.",
    )


def _key(create: bool) -> bytes | None:
    """This user's sealing key (32 random bytes, hex in :func:`key_path`); made, mode 0600 in a 0700 folder, when
    ``create`` and missing (``O_EXCL``: two processes making it at once agree on the first). Read only from a
    regular file of this user's with no group or other access, in a folder only this user can write, opened
    without following a link (as ssh treats a private key): else :class:`KeyExposed`."""
    path = key_path()
    if create and not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if os.path.islink(path):
            raise _refuse_exposed(path, "it is a link (finetuner reads its key only from a regular file)") from None
        raise UserError(f"{path} cannot be read ({e.strerror}).",
                        hint="Remove it: finetuner makes a new key (checkpoints sealed with the old one then ask for --trust-checkpoints).") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _refuse_exposed(path, "it is not a regular file")
        why = (exposure(st, "it", 0o077, "readable or writable")
               or exposure(os.stat(path.parent), "its folder", 0o022, "writable"))
        if why:
            raise _refuse_exposed(path, why)
        raw = f.read(200)
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    return bytes.fromhex(text) if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def private_key() -> bytes:
    """This user's sealing key, made when missing; a :class:`~finetuner.errors.UserError` when it is damaged or
    not private (checked before a multi-process run starts, so that a bad key stops it in one line, not a rank)."""
    key = _key(create=True)
    if key is None:
        raise UserError(f"{key_path()} is not a finetuner checkpoint key (64 hex digits).",
                        hint="Delete it: finetuner makes a new one (checkpoints sealed with the old key then ask for --trust-checkpoints).")
    return key


def _files(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``folder`` but the seal: relative path → size and SHA-256."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != SEAL):
        out[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    return out


def _mac(key: bytes, files: dict[str, dict[str, Any]]) -> str:
    body = json.dumps({"version": VERSION, "files": files}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode("utf-8"), hashlib.sha256).hexdigest()


def write(folder: Path) -> None:
    """Seal the complete checkpoint being written in ``folder`` (rank 0, after every rank wrote)."""
    key = private_key()
    files = _files(folder)
    atomic_write_text(folder / SEAL, json.dumps({"version": VERSION, "files": files, "hmac": _mac(key, files)}, indent=1) + "\n")


def _read(folder: Path) -> dict[str, Any] | None:
    """``folder``'s seal (its ``files`` a dict, its ``hmac`` a string), or None when it has none readable."""
    try:
        seal = json.loads((Path(folder) / SEAL).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(seal, dict) and isinstance(seal.get("files"), dict) and isinstance(seal.get("hmac"), str)
    return seal if ok else None


def _made_with_our_key(seal: dict[str, Any] | None) -> bool:
    key = _key(create=False)
    return seal is not None and key is not None and hmac.compare_digest(_mac(key, seal["files"]), seal["hmac"])


def is_ours(folder: Path) -> bool:
    """Whether ``folder``'s seal was made with this user's key (its files not checked: see :func:`check`)."""
    return _made_with_our_key(_read(folder))


def unsealed(run_dir: Path) -> list[Path]:
    """The checkpoints of ``run_dir`` that resuming would unpickle and this user did not seal."""
    from finetuner.training.checkpoint import checkpoint_dirs, is_sharded

    return [c for c in checkpoint_dirs(run_dir) if is_sharded(c) and not is_ours(c)]


def trusted_by_env() -> bool:
    return os.environ.get(TRUST_ENV, "") not in ("", "0")


def check(folder: Path, trusted: bool | None = None) -> None:
    """Before ``folder``'s shards are unpickled: raise :class:`NotOurs` unless this user's key sealed
    it (or ``trusted``, default :func:`trusted_by_env`), and ``CheckpointUnreadable`` when a file
    differs from what the seal lists."""
    from finetuner.training.checkpoint import CheckpointUnreadable

    trusted = trusted_by_env() if trusted is None else trusted
    seal = _read(folder)
    if not trusted and not _made_with_our_key(seal):
        why = "it has no seal" if seal is None else "its seal was not made with this user's key"
        raise NotOurs(
            f"{folder} was not written by finetuner for this user on this machine ({why}): resuming it unpickles "
            "its sharded state, which can run code.",
            hint="If you trust whoever gave you this run, resume with `finetuner run ... --trust-checkpoints` (in the web UI: "
                 "tick the box that allows code); else train afresh with --no-resume (the old run is moved aside).",
        )
    if seal is None:  # trusted, unsealed: nothing to compare
        return
    listed = seal["files"]
    found = _files(folder)
    if found != listed:
        names = sorted(set(found) ^ set(listed)) or [n for n in sorted(listed) if found.get(n) != listed[n]]
        raise CheckpointUnreadable(f"{folder.name}: {names[0]} is missing or changed since it was written")

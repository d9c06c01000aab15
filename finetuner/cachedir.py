"""finetuner's cache folders, private to this user: the one door every cache goes through.

What is in a cache is used without being made again (tokenized data is trained on, a speed calibration
sizes a plan, a chat history is written back), so a cache folder someone else can write is a way to
plant it. Every cache folder is opened here, :func:`cache_folder`, before anything is read from it:

- made mode 0700 when missing (its files are written 0600: :func:`write_entry`);
- refused with one line naming it and the fix (:class:`CacheRefused`, a
  :class:`~finetuner.errors.UserError`) when it is owned by another user, writable by group or others,
  not a folder, or a link someone else made (a link of this user's is checked at its end);
- made 0700 when it is this user's and only readable by others (older versions made them 0755).

The ownership and mode test is :func:`exposure`, the one the checkpoint-sealing key is held to
(:mod:`finetuner.training.seal`).

Entries are read with :func:`read_entry` (``O_NOFOLLOW``: a link is never followed, a file that is not
this user's regular file is a miss) and written with :func:`write_entry` (a temporary file in the same
folder renamed over the name: a link there is replaced, never written through). A JSON entry
(:func:`write_json_entry`) starts with a header line holding its key and a SHA-256 of the key and its body;
:func:`read_json_entry` raises :class:`EntryRejected` (a miss, with the reason in words) when they do not
match: an entry written for another key, edited, cut short or planted.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from finetuner.errors import UserError
from finetuner.fileio import atomic_write_text, cache_root

#: the mode of a cache folder finetuner makes, and of its files
FOLDER_MODE, FILE_MODE = 0o700, 0o600
#: the header's format field of a JSON entry (:func:`write_json_entry`)
ENTRY_FORMAT = "finetuner-cache-1"


def exposure(st: os.stat_result, what: str, forbidden: int, access: str) -> str | None:
    """Why a file or folder (``what``, with its ``stat``) is not private to this user: another owner, or a
    ``forbidden`` mode bit set (``access`` by group or others); None when it is."""
    if st.st_uid != os.geteuid():
        return f"{what} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if st.st_mode & forbidden:
        return f"{what} is {access} by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class CacheRefused(UserError):
    """A cache folder that someone else could have written into: nothing in it is read."""


def _refuse(path: Path, why: str) -> CacheRefused:
    return CacheRefused(
        f"{path}: {why}, so what finetuner cached there (tokenized data, speed calibration, chat history ...) could "
        "have been planted by someone else; nothing was read from it.",
        hint=f"Remove it (rm -r {path}): finetuner makes a new private one (mode 0700); or set FINETUNER_CACHE_DIR "
             "to a folder of your own.",
    )


def _private(path: Path) -> None:
    """Make ``path`` a private folder (mode 0700) if missing; refuse it if others could have written into it."""
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileExistsError:
        pass  # an OSError else (a read-only disk, a file in the way): the caller works without its cache, as before
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        why = exposure(st, "it is a link that", 0, "")
        if why:
            raise _refuse(path, why)
        try:
            st = os.stat(path)
        except OSError:
            raise _refuse(path, "it is a link to nothing") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a folder")
    why = exposure(st, "it", 0o022, "writable")
    if why:
        raise _refuse(path, why)
    if st.st_mode & 0o077:  # this user's, readable by others (an older finetuner's 0755): made private
        os.chmod(path, FOLDER_MODE)


def cache_folder(*parts: str) -> Path:
    """The cache folder ``<cache>/<parts...>`` (:func:`finetuner.fileio.cache_root`), each level made private
    (0700) or checked to be (:func:`_private`) before the caller reads anything in it: :class:`CacheRefused` when
    one is not, ``OSError`` when one cannot be made (the caller then goes on without that cache)."""
    root = cache_root()
    root.parent.mkdir(parents=True, exist_ok=True)
    folder = root
    _private(folder)
    for part in parts:
        folder = folder / part
        _private(folder)
    return folder


class EntryRejected(Exception):
    """A cache entry that is not used (a miss: it is made again): why, in words."""


def read_entry(path: Path) -> bytes:
    """The bytes of the cache file ``path``, opened without following a link: ``FileNotFoundError`` when there is
    none, :class:`EntryRejected` when it is a link, not a regular file, or not this user's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except OSError as e:
        if os.path.islink(path):
            raise EntryRejected("it is a link (finetuner never follows one in its caches)") from None
        raise EntryRejected(f"it cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise EntryRejected("it is not a regular file")
        why = exposure(st, "it", 0o022, "writable")
        if why:
            raise EntryRejected(why)
        return f.read()


def tree_digests(folder: Path, skip: str) -> dict[str, dict[str, Any]]:
    """Every file under the cache entry ``folder`` but ``skip`` (its list): relative path → size and SHA-256. A link
    or anything but a regular file or folder in it: :class:`EntryRejected`."""
    from finetuner.fileio import file_digest

    out = {}
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = Path(root) / name
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise EntryRejected(f"{path.relative_to(folder)} is a link or not a regular file")
            rel = path.relative_to(folder).as_posix()
            if rel != skip:
                out[rel] = {"size": st.st_size, "sha256": file_digest(path)}
    return dict(sorted(out.items()))


def write_entry(path: Path, text: str) -> None:
    """Write the cache file ``path`` (mode 0600) via a temporary file in its folder and a rename."""
    atomic_write_text(path, text, mode=FILE_MODE)


def _digest(key: str, body: bytes) -> str:
    return hashlib.sha256(key.encode("utf-8") + b"\n" + body).hexdigest()


def write_json_entry(path: Path, key: str, obj: Any) -> None:
    """``obj`` as the JSON entry ``path`` of ``key``: a header line (format, key, SHA-256 of key and body), the body."""
    body = json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    header = {"format": ENTRY_FORMAT, "key": key, "sha256": _digest(key, body.encode("utf-8"))}
    write_entry(path, json.dumps(header, sort_keys=True) + "\n" + body)


def check_json_entry(raw: bytes, key: str) -> Any:
    """The body of a JSON entry's bytes once its header matches ``key`` and its SHA-256; else :class:`EntryRejected`."""
    head, _, body = raw.partition(b"\n")
    try:
        header = json.loads(head)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != ENTRY_FORMAT or not isinstance(header.get("sha256"), str):
        raise EntryRejected("it does not start with the header finetuner writes (its key and a SHA-256)")
    if header.get("key") != key:
        raise EntryRejected("it was written for another key")
    if _digest(key, body) != header["sha256"]:
        raise EntryRejected("its contents do not match the SHA-256 in its header (edited, cut short or planted)")
    try:
        return json.loads(body)
    except ValueError:
        raise EntryRejected("its body is not JSON") from None


def read_json_entry(path: Path, key: str) -> Any:
    """The body of the JSON entry ``path`` of ``key`` (:func:`write_json_entry`): ``FileNotFoundError`` when there is
    none, :class:`EntryRejected` when it fails a check."""
    return check_json_entry(read_entry(path), key)

"""What a base model's weights are: a fingerprint that changes when the weight files do, cheap to take again.

The fingerprint of a model is each weight file's name, size and SHA-256 of its bytes. A content hash, not the
files' modification times: ``finetuner merge --overwrite`` into the same folder, a retrained base copied over
it, or an ``rsync -a`` of other weights (which keeps the source's times) all change it; a copy of the same
weights elsewhere, or a ``touch``, does not (the same weights give the same answers).

Hashing reads every byte (SHA-256 at 1 to 1.4 GiB/s from the page cache on this project's 2-core machine, slower
from disk: ``python -m scripts.bench.weights_fingerprint``): a 15 GB checkpoint at every run would cost 10 s or
more. So a file's hash is computed once and kept in a small memo, ``<cache>/weights/digests.json``
(:func:`finetuner.fileio.cache_root`), keyed by the file's real path and its ``stat``: size, ``mtime_ns``,
``ctime_ns``, inode and device. A file rewritten in place and
its modification time put back (``touch -r``, ``cp -p`` over it, ``rsync --inplace -t``) keeps size, mtime and
inode but not its ctime, which only the kernel sets: any write, rename or ``utime`` changes it, so the memo
misses and the file is hashed again. A memo entry that matches the file's ``stat`` is trusted without reading
the file: the memo is this user's cache, as trusted as the rest of it. What this cannot see: a same-size
rewrite in place, its mtime put back, that ends within the same tick of the kernel's file clock (a few
milliseconds) as the ``stat`` taken before the earlier contents were hashed; no weight file is rewritten that
fast. Two runs that write the memo at once: the last write wins, and the other's files are hashed again next time.

Where the weights are read from (:func:`weights_location`): a local folder (its top-level weight files, as
``from_pretrained`` reads them), a ``.gguf`` file, or for a hub id the snapshot folder of the resolved revision
in the local hub cache (the commit ``from_pretrained`` loaded; its files are links to blobs, hashed the same
way, so a hub id whose branch moved to other weights fingerprints differently too).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetuner.cachedir import EntryRejected, cache_folder, read_json_entry, write_json_entry
from finetuner.fileio import cache_root, expand_user, file_digest

log = logging.getLogger(__name__)

#: the suffixes of files that hold weights (safetensors, PyTorch pickles, GGUF, TensorFlow/Flax checkpoints)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
#: bump when the memo's layout changes (an old memo is then ignored and rewritten)
MEMO_VERSION = 1


def memo_path() -> Path:
    """The memo of content hashes: ``<cache>/weights/digests.json`` (a private cache folder: :mod:`finetuner.cachedir`)."""
    return cache_folder("weights") / "digests.json"


def weights_location(name: str, revision: str | None = None) -> Path | None:
    """The folder or ``.gguf`` file the weights of ``model.name`` are read from: the path itself when it exists
    here, else (a hub id) the snapshot folder of ``revision`` in the local hub cache; None when neither is here."""
    path = expand_user(name)
    if path.exists():
        return path.resolve()
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json", revision=revision)
    except ValueError:  # not a valid repo id either
        return None
    return Path(found).parent if isinstance(found, str) else None


def weight_files(location: Path) -> list[Path]:
    """The weight files at ``location``: the file itself, or a folder's top-level files with a weight suffix."""
    if location.is_file():
        return [location]
    return sorted(p for p in location.iterdir() if p.suffix.lower() in WEIGHT_SUFFIXES and p.is_file())


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


@dataclass
class Memo:
    """The memo of content hashes, read once and written back once when it learned something."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    changed: bool = False

    @classmethod
    def load(cls) -> Memo:
        try:
            raw = read_json_entry(memo_path(), "digests.json")
        except EntryRejected as e:  # edited or planted: hashed again
            log.warning("The memo of weight hashes %s is not used (%s); the weights are hashed again.", memo_path(), e)
            return cls()
        except OSError:
            return cls()
        if not isinstance(raw, dict) or raw.get("version") != MEMO_VERSION or not isinstance(raw.get("files"), dict):
            return cls()
        return cls({k: v for k, v in raw["files"].items() if isinstance(v, dict)})

    def digest(self, path: Path) -> tuple[str, int, bool]:
        """``(SHA-256 of the file's bytes, its size, whether they were read now)``: the memo's hash when its
        ``stat`` still matches, else the file hashed (and remembered)."""
        real = os.path.realpath(path)
        stamp = _stamp(os.stat(real))
        entry = self.entries.get(real)
        if entry is not None and entry.get("stat") == stamp and isinstance(entry.get("sha256"), str):
            return entry["sha256"], stamp[0], False
        sha = file_digest(real)
        self.entries[real] = {"stat": stamp, "sha256": sha}
        self.changed = True
        return sha, stamp[0], True

    def save(self) -> None:
        """Write the memo back (entries of files gone dropped); a cache that cannot be written is only logged:
        the next run hashes again."""
        if not self.changed:
            return
        kept = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        try:
            write_json_entry(memo_path(), "digests.json", {"version": MEMO_VERSION, "files": kept})
        except OSError as e:
            log.warning("Could not write the memo of weight hashes under %s (%s); the next run hashes the weights "
                        "again.", cache_root(), e)


@dataclass
class Fingerprint:
    """A model's weights: ``files`` maps each weight file's name to its ``size`` and ``sha256``; ``hashed`` names
    the files whose bytes were read this time (the others came from the memo)."""

    location: Path
    files: dict[str, dict[str, Any]]
    hashed: list[str]

    def digest(self) -> str:
        """One short hash of the whole fingerprint (for display)."""
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()[:16]


def weights_fingerprint(name: str, revision: str | None = None) -> Fingerprint | None:
    """The fingerprint of the weights ``model.name`` (at ``revision``) loads, or None when no weight file of it is
    here to read (see :func:`weights_location`)."""
    location = weights_location(name, revision)
    files = weight_files(location) if location is not None else []
    if not files:
        return None
    memo = Memo.load()
    out: dict[str, dict[str, Any]] = {}
    hashed = []
    for f in files:
        sha, size, read = memo.digest(f)
        out[f.name] = {"size": size, "sha256": sha}
        if read:
            hashed.append(f.name)
    memo.save()
    return Fingerprint(location, out, hashed)


def remembered_fingerprint(name: str, revision: str | None = None) -> Fingerprint | None:
    """The fingerprint :func:`weights_fingerprint` would take, from the memo alone (a ``stat`` a file, no byte
    read): None when a weight file is not in the memo as it is now, or no weight file is here (what a plan asks
    before any run: whether a cache made with these weights still fits them)."""
    location = weights_location(name, revision)
    files = weight_files(location) if location is not None else []
    if not files:
        return None
    entries = Memo.load().entries
    out: dict[str, dict[str, Any]] = {}
    for f in files:
        real = os.path.realpath(f)
        stamp, entry = _stamp(os.stat(real)), entries.get(real)
        if entry is None or entry.get("stat") != stamp or not isinstance(entry.get("sha256"), str):
            return None
        out[f.name] = {"size": stamp[0], "sha256": entry["sha256"]}
    return Fingerprint(location, out, [])

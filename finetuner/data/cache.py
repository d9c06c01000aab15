"""On-disk cache of tokenized (and packed) data, so a second run starts training at once.

A prepared data set is stored under ``<cache>/tokenized/<key>/`` (``datasets.save_to_disk``
folders plus a small JSON of the pipeline's statistics) where the key is a SHA-256 over
everything that decides the tokens:

* the bytes of every local data file (``data.path`` and ``data.val_path``);
* the tokenizer: its full serialised form (vocabulary, merges, normaliser, post-processor) and
  special tokens;
* the chat template actually used;
* the data settings (``max_seq_len``, ``format``, ``train_on_prompt``, packing, ``val_size``,
  ``system_prompt`` …) and the seed (the validation split and the packing order depend on it);
* the source of the pipeline modules themselves, so a new finetuner never reads an old layout.

Change any of these and the key changes: the cache is never stale, only missed. Hub data sets
(no local file to hash) are not cached here. The cache folder is ``$FINETUNER_CACHE_DIR``, else
``$XDG_CACHE_HOME/finetuner``, else ``~/.cache/finetuner``; delete it at any time. It is private to this
user (:func:`finetuner.cachedir.cache_folder`: made 0700, its files 0600, refused when others could write it).

An entry is used only once it passes its checks (:func:`load`), else it is rebuilt and the run says why
(``data.cache: rebuilt`` and ``data.cache_note`` in its statistics, and a warning): ``meta.json`` is a JSON
entry of its key (:func:`finetuner.cachedir.write_json_entry`: the key and a SHA-256 of key and body) that
lists the size and SHA-256 of every file of the entry; the files must match the list (no links, none
missing or added), the data sets must hold the rows the statistics say, and the statistics must count the
rows the data file has now (its profile: the rows read from ``data.path``). An entry copied from another key,
edited or planted is never trained on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from finetuner.cachedir import FILE_MODE, EntryRejected, cache_folder, read_json_entry, tree_digests, write_json_entry
from finetuner.fileio import cache_root, file_digest
from finetuner.quiet import quieted

log = logging.getLogger(__name__)

#: bump when the stored layout changes in a way the module source hash would not catch
FORMAT_VERSION = 1
#: settings that do not change the tokens (left out of the key)
_NOT_IN_KEY = {"num_proc", "cache", "path", "val_path"}


def _local_files(paths: str | Sequence[str] | None) -> list[Path] | None:
    """The files behind ``paths``, or None when one of them is not a local file (a hub id)."""
    if paths is None:
        return []
    out = []
    for p in [paths] if isinstance(paths, str) else paths:
        path = Path(p).expanduser()
        if path.is_dir():
            out += sorted(f for f in path.rglob("*") if f.is_file())
        elif path.is_file():
            out.append(path)
        else:
            return None
    return out


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides the tokenizer's output: its serialised model and special tokens."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h.update(json.dumps(special, sort_keys=True).encode())
    h.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]).encode())
    return h.hexdigest()


#: The modules whose code turns rows into tokens: a change to them invalidates the cache.
PIPELINE_SOURCES = ("pipeline.py", "formats.py", "rows.py", "tools.py", "thinking.py")


def _pipeline_source_digest() -> str:
    h = hashlib.sha256()
    for name in PIPELINE_SOURCES:  # read, not imported: finetuner.data.pipeline imports this module
        h.update(Path(__file__).with_name(name).read_bytes())
    return h.hexdigest()


def cache_key(cfg: Any, tokenizer: Any, template: str, seed: int) -> str | None:
    """The key of a prepared data set, or None when it cannot be cached (a hub data set)."""
    train_files, val_files = _local_files(cfg.path), _local_files(cfg.val_path)
    if train_files is None or val_files is None:
        return None
    settings = {k: v for k, v in cfg.model_dump().items() if k not in _NOT_IN_KEY}
    parts = {
        "version": FORMAT_VERSION,
        "code": _pipeline_source_digest(),
        "train": [file_digest(f) for f in train_files],
        "val": [file_digest(f) for f in val_files],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": template,
        "settings": settings,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_dir(key: str) -> Path:
    """The folder of ``key``'s entry (its private parent made or checked: :func:`finetuner.cachedir.cache_folder`)."""
    return cache_folder("tokenized") / key


def _files(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file of the entry ``folder`` but ``meta.json``, with its size and SHA-256 (no link in it)."""
    return tree_digests(folder, "meta.json")


def _checked(folder: Path, key: str, profile_rows: Callable[[], int] | None):
    """``(train, val, stats_dict)`` of the entry in ``folder`` once it passes every check; else EntryRejected."""
    import datasets

    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise EntryRejected("it is a link or not a folder")
    try:
        info = read_json_entry(folder / "meta.json", key)
    except FileNotFoundError:
        raise EntryRejected("it has no meta.json") from None
    if not isinstance(info, dict) or not isinstance(info.get("stats"), dict) or not isinstance(info.get("files"), dict):
        raise EntryRejected("its meta.json is not one finetuner writes")
    if _files(folder) != info["files"]:
        raise EntryRejected("its files are not the ones its meta.json lists (changed, added or removed)")
    stats = info["stats"]
    try:
        train = datasets.load_from_disk(str(folder / "train"))
        val = datasets.load_from_disk(str(folder / "val")) if info.get("has_val") else None
    except Exception as e:  # noqa: BLE001 - a damaged entry is rebuilt
        raise EntryRejected(f"it cannot be read ({type(e).__name__}: {e})") from None
    want_train = stats.get("packed_rows") if stats.get("packing") else stats.get("train_examples")
    if len(train) != want_train:
        raise EntryRejected(f"it holds {len(train)} training rows where its statistics say {want_train}")
    if not stats.get("packing") and (len(val) if val is not None else 0) != stats.get("val_examples"):
        raise EntryRejected(f"it holds {len(val) if val is not None else 0} held-out rows where its statistics say "
                            f"{stats.get('val_examples')}")
    if profile_rows is not None:
        rows = profile_rows()
        if stats.get("rows") != rows:
            raise EntryRejected(f"it was made from {stats.get('rows')} rows where the data file has {rows}")
    return train, val, stats


def load(key: str, profile_rows: Callable[[], int] | None = None):
    """``(train, val, stats_dict)`` from the cache, ``None`` on a miss, or the reason in words (a ``str``) when an
    entry was there but failed its checks (:func:`_checked`; ``profile_rows``: the rows the data files have now):
    it is removed, so that :func:`store` writes it again."""
    try:
        folder = cache_dir(key)
    except OSError:  # no cache folder can be made: a miss (store warns)
        return None
    if not os.path.lexists(folder):
        return None
    try:
        return _checked(folder, key, profile_rows)
    except EntryRejected as e:
        why = str(e)
    except OSError as e:
        why = f"it cannot be read ({e.strerror or e})"
    log.warning("The tokenized-data cache entry %s is not used (%s): the data are tokenized again and the entry "
                "rebuilt.", folder, why)
    if os.path.islink(folder) or not os.path.isdir(folder):
        os.unlink(folder)
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return why


def relocate(stats: Any, cfg: Any) -> None:
    """Point a cache hit's statistics at this run's files.

    The key is content-based, so an entry may have been made from other copies of the same
    files (another checkout, a renamed file); its statistics name those (``format`` is keyed by
    path, skipped rows say where they were). Here they are rewritten in place to name ``cfg``'s
    files, matched by position: the same key means the same files in the same order.
    """
    new = [str(p) for p in ([cfg.path] if isinstance(cfg.path, str) else cfg.path)]
    if cfg.val_path:
        new.append(str(cfg.val_path))
    new = list(dict.fromkeys(new))
    old = list(stats.format)
    if old == new or len(old) != len(new):
        return
    moves = dict(zip(old, new))
    stats.format = {moves[k]: v for k, v in stats.format.items()}
    reasons = []
    for reason in stats.skipped_reasons:
        src = next((o for o in old if reason.startswith(o)), None)
        reasons.append(moves[src] + reason[len(src):] if src is not None else reason)
    stats.skipped_reasons = reasons


def store(key: str, train, val, stats: dict[str, Any]) -> Path | None:
    """Write an entry atomically (a private temporary folder renamed into place, its files 0600, its ``meta.json``
    listing them: :func:`load`'s checks); failures only warn."""
    folder, tmp = cache_root() / "tokenized" / key, None
    try:
        folder = cache_dir(key)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{key}.", suffix=".tmp"))  # mode 0700
        with quieted():  # no "Saving the dataset" bars in the Python API
            train.save_to_disk(str(tmp / "train"))
            if val is not None:
                val.save_to_disk(str(tmp / "val"))
        for root, dirs, names in os.walk(tmp):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o700)
            for name in names:
                os.chmod(os.path.join(root, name), FILE_MODE)
        write_json_entry(tmp / "meta.json", key, {"has_val": val is not None, "stats": stats, "files": _files(tmp)})
        if os.path.lexists(folder):  # another run stored the same key meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
            return folder
        tmp.rename(folder)
        return folder
    except BaseException as e:  # a full disk, or Ctrl-C: no half-written entry is left in the cache
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError):
            raise
        log.warning("Could not write the tokenized-data cache to %s (%s); the next run tokenizes again.", folder, e)
        return None

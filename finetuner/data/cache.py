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
``$XDG_CACHE_HOME/finetuner``, else ``~/.cache/finetuner``; delete it at any time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    return cache_root() / "tokenized" / key


def load(key: str):
    """``(train, val, stats_dict)`` from the cache, or None on a miss (or an unreadable entry)."""
    import datasets

    folder = cache_dir(key)
    meta = folder / "meta.json"
    if not meta.is_file():
        return None
    try:
        info = json.loads(meta.read_text())
        train = datasets.load_from_disk(str(folder / "train"))
        val = datasets.load_from_disk(str(folder / "val")) if info["has_val"] else None
    except Exception as e:  # a damaged entry is a miss; it is rewritten
        log.warning("Ignoring the unreadable tokenized-data cache %s (%s).", folder, e)
        return None
    return train, val, info["stats"]


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
    """Write an entry atomically (a temporary folder renamed into place); failures only warn."""
    folder = cache_dir(key)
    tmp = folder.with_name(f".{key}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.mkdir(parents=True)
        with quieted():  # no "Saving the dataset" bars in the Python API
            train.save_to_disk(str(tmp / "train"))
            if val is not None:
                val.save_to_disk(str(tmp / "val"))
        (tmp / "meta.json").write_text(json.dumps({"has_val": val is not None, "stats": stats}))
        if folder.exists():  # another run stored the same key meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
            return folder
        tmp.rename(folder)
        return folder
    except BaseException as e:  # a full disk, or Ctrl-C: no half-written entry is left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError):
            raise
        log.warning("Could not write the tokenized-data cache to %s (%s); the next run tokenizes again.", folder, e)
        return None

"""Local path or hub id: what a name given for a model, a run folder or a data file points at.

Every place that takes such a name (``model.name``, the ``chat``/``eval``/``merge``/``export``
source, ``data.path`` / ``--data``, the web UI's fields) resolves it with :func:`locate`:

- a file or folder that exists (relative to the given folders, then the current one) is that path;
- a name that *could* be a local path and exists nowhere is a missing file or folder, said at once
  with the near matches in its nearest existing parent folder (never sent to the hub, where
  ``runs/demo_model-plannd`` spent 49 s in retries and ended with "couldn't connect"). A name could
  be local when it starts with ``.``, ``/`` or ``~``, has more than one ``/``, ends with a data or
  model file suffix, or its first path component exists here (``runs/...`` where ``runs/`` exists);
- anything else is a hub id, returned as given.

Before anything fetches a hub id, :func:`check_hub` makes sure the hub can be reached (one short
connection, once per process; ``HF_HUB_OFFLINE`` counts as unreachable) or the id is in the local
hub cache. Unreachable and not cached: one line saying so, at once. Unreachable but cached: the
hub libraries are put in offline mode, so they read the cache without retrying the network.
"""

from __future__ import annotations

import difflib
import functools
import os
import socket
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from finetuner.errors import UserError
from finetuner.fileio import exists, expand_user

#: Suffixes of files a name may point at: data (``data.path``), weights, recipes.
FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".gguf", ".safetensors", ".bin", ".pt", ".yaml", ".yml")
#: Seconds the hub probe waits for a connection.
HUB_PROBE_TIMEOUT = 3.0
_TRUE = {"1", "true", "yes", "on"}


def _candidates(name: str, base_dirs: Iterable[str | Path]) -> list[Path]:
    p = expand_user(name)
    if p.is_absolute():
        return [p]
    return [Path(d) / p for d in base_dirs] + [Path.cwd() / p]


def find_local(name: str, base_dirs: Iterable[str | Path] = ()) -> Path | None:
    """The existing file or folder ``name`` names (relative to ``base_dirs``, then the current
    folder), resolved; None when there is none."""
    if not name or not name.strip():
        return None
    for c in _candidates(name, base_dirs):
        if exists(c):
            return c.resolve()
    return None


def could_be_local(name: str, base_dirs: Iterable[str | Path] = ()) -> bool:
    """Whether ``name`` reads as a local path rather than a hub id (``org/name``)."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1:
        return True
    if name.lower().endswith(FILE_SUFFIXES):
        return True
    first = Path(name).parts[0] if Path(name).parts else name
    return "/" in name and any(exists(d / first) for d in [Path(b) for b in base_dirs] + [Path.cwd()])


def near_matches(name: str, base_dirs: Iterable[str | Path] = (), n: int = 3) -> tuple[Path | None, list[str]]:
    """The nearest existing parent of ``name`` and the entries in it whose names are close to the
    missing part (difflib), as paths written the way the user wrote ``name``."""
    for c in _candidates(name, base_dirs):
        parent, missing = c.parent, c.name
        written = Path(name).parent
        while not exists(parent, "dir") and parent != parent.parent:
            missing, parent, written = parent.name, parent.parent, written.parent
        if not exists(parent, "dir"):
            continue
        try:
            entries = [e.name for e in parent.iterdir()]
        except OSError:
            continue
        close = difflib.get_close_matches(missing, entries, n=n, cutoff=0.6)
        if close:
            prefix = "" if str(written) == "." else f"{written}/"
            return parent, [prefix + m + ("/" if exists(parent / m, "dir") else "") for m in close]
        return parent, []
    return None, []


def missing(name: str, what: str, base_dirs: Iterable[str | Path] = (), why: str = "", hint: str | None = None) -> UserError:
    """The error for a ``what`` (``model.name``, ``data.path``, ``the run folder``) that exists nowhere:
    where it was looked for, ``why`` it is not fetched from the hub either, and the near matches."""
    dirs = list(dict.fromkeys(str(Path(d).resolve()) for d in [*base_dirs, Path.cwd()]))
    looked = "" if expand_user(name).is_absolute() else f" (looked in {' and '.join(dirs)})"
    _, close = near_matches(name, base_dirs)
    near = f" Near matches: {', '.join(close)}." if close else ""
    said = f"is not a file or folder here{looked}, and {why}" if why else f"does not exist{looked}"
    return UserError(f"{what}: '{name}' {said}.{near}", hint=hint or "Check the spelling; a hub id is written org/name.")


def locate(name: str, what: str, base_dirs: Iterable[str | Path] = (), hub: bool = True) -> Path | str:
    """The existing path ``name`` names, or ``name`` itself as a hub id; a :class:`UserError` at once
    (with near matches) when it could be a local path and is not there, or when it cannot be a hub
    id (``hub=False``: a run folder, a recipe)."""
    base_dirs = list(base_dirs)
    found = find_local(name, base_dirs)
    if found is not None:
        return found
    if not hub:
        raise missing(name, what, base_dirs, hint="Check the spelling and the folder it is in.")
    if could_be_local(name, base_dirs):
        raise missing(name, what, base_dirs)
    return name


# --------------------------------------------------------------------------- the hub
def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


@functools.cache
def hub_unreachable() -> str | None:
    """Why the hub cannot be reached (``HF_HUB_OFFLINE`` is set, or one connection to it failed within
    :data:`HUB_PROBE_TIMEOUT` seconds), or None when it can. Asked once per process."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var} is set"
    url = urlparse(hub_endpoint())
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT):
            return None
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        return f"cannot connect to {host} ({reason})"


def _cache_names(repo_id: str, repo_type: str) -> list[Path]:
    try:
        from huggingface_hub import constants

        hub_cache = Path(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - a dependency of transformers
        return []
    found = [hub_cache / f"{repo_type}s--{repo_id.replace('/', '--')}"]
    if repo_type == "dataset":  # the datasets library's own cache of prepared data sets
        home = Path(os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets")
        found.append(home / repo_id.replace("/", "___"))
    return found


def in_hub_cache(repo_id: str, repo_type: str = "model") -> bool:
    return any(exists(p, "dir") for p in _cache_names(repo_id, repo_type))


def work_offline() -> None:
    """Make the hub libraries read only their cache, without network requests (and retries):
    ``HF_HUB_OFFLINE`` for this process's children, the libraries' flags for this process."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True


def check_hub(name: str, what: str, repo_type: str = "model") -> None:
    """Before ``name`` is fetched from the hub: nothing when it is a local path or the hub can be
    reached; offline mode when it cannot but ``name`` is cached; else a one-line :class:`UserError`."""
    if find_local(name) is not None:
        return
    why = hub_unreachable()
    if why is None:
        return
    if in_hub_cache(name, repo_type):
        work_offline()
        return
    kind = "data set" if repo_type == "dataset" else "model"
    raise missing(name, what, why=f"it cannot be fetched as a hub {kind}: {why}, and it is not in the local hub cache",
                  hint="Check the spelling, or connect to the internet; or download it where you can (hf download "
                       f"{name}{' --repo-type dataset' if repo_type == 'dataset' else ''} --local-dir DIR) and give that folder.")

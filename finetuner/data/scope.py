"""The folders a web UI that serves other machines reads files from: data files and the pictures their rows name.

``finetuner ui --host 0.0.0.0`` (or ``--data-dir``) may make this machine read files only in ``data/``, the uploads,
the runs and the ``--data-dir`` folders (:class:`ui.handlers.Handlers`' ``data_dirs``). The UI runs its handlers
:func:`within` that :class:`ReadScope`, and what opens a file on their behalf asks it first, before anything looks at
the file: a data file (:func:`data_file`: the UI's Data file box, :func:`finetuner.data.formats.read_rows`) and each
picture a row names (:func:`picture`: :func:`finetuner.data.formats.picture_path`, so the Data tab's profile,
preview and thumbnails, the plan, the estimate and training read only what it allowed).

The decision is made on the path's text first (``..`` folded away without asking the file system), then on the
file system inside the scope only (links followed there: a link in ``data/`` to a file elsewhere is elsewhere); the
path used afterwards is the one decided on. So a path outside is refused with one message whatever the file's state
(missing, unreadable, a folder, there), and no part of it outside the scope is ever looked at (but for a data file
written as a hub id, ``org/name``: :func:`data_file` makes sure no such local path is read as a data set): whoever
reaches the page cannot probe which files exist. A job the UI starts (training, resuming) inherits the scope through
:data:`ENV` (:func:`child_env`). The command line sets none: it reads the files you name, wherever they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from finetuner.errors import UserError
from finetuner.fileio import expand_user

#: the environment variable that carries the scope into a job the UI starts (JSON: the folders and their names)
ENV = "FINETUNER_READ_SCOPE"
#: a hub id as the hub spells one (``org/name`` or ``name``: letters, digits, ``_.-``)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
#: the suffixes that make a name a file's, never a hub id (finetuner.locate's data suffixes)
FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet")


def _folded(path: str | Path) -> Path:
    """``path`` absolute, with ``.`` and ``..`` folded away on its text alone (nothing on disk is asked)."""
    return Path(os.path.normpath(os.path.abspath(expand_user(path))))


@dataclass(frozen=True)
class ReadScope:
    """The folders files may be read from (links resolved), and how messages name them; ``written``: the same
    folders as given, for a path written through a link to one of them (``/tmp`` where it is ``/private/tmp``)."""

    folders: tuple[Path, ...]
    shown: tuple[str, ...]
    written: tuple[Path, ...] = ()

    @classmethod
    def of(cls, folders: Iterable[str | Path], shown: Iterable[str] | None = None) -> ReadScope:
        given = [_folded(f) for f in folders]
        return cls(tuple(f.resolve() for f in given), tuple(shown) if shown is not None else tuple(map(str, given)),
                   tuple(given))

    def inside(self, path: Path, folders: tuple[Path, ...] | None = None) -> bool:
        return any(path == f or f in path.parents for f in (self.folders if folders is None else folders))

    def allowed(self, path: str | Path) -> Path | None:
        """The path to read for ``path`` when it lies inside the scope, judged on its folded text, then with the
        links inside the scope followed; None when it does not (whatever is or is not there)."""
        folded = _folded(path)
        if not self.inside(folded, self.folders + self.written):
            return None
        real = folded.resolve()
        return real if self.inside(real) else None

    def where(self) -> str:
        return ", ".join(self.shown)

    def to_env(self) -> str:
        return json.dumps({"folders": [str(f) for f in self.folders], "shown": list(self.shown),
                           "written": [str(f) for f in self.written]})

    @classmethod
    def from_env(cls, text: str) -> ReadScope:
        try:
            raw = json.loads(text)
            return cls(tuple(Path(f) for f in raw["folders"]), tuple(raw["shown"]), tuple(Path(f) for f in raw["written"]))
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{ENV} is not a scope finetuner wrote ({text[:80]!r}).",
                            hint=f"Unset {ENV}: the web UI sets it for the jobs it starts.") from None


_current: contextvars.ContextVar[ReadScope | None] = contextvars.ContextVar("finetuner_read_scope", default=None)


def current() -> ReadScope | None:
    """The scope files are read within now: the innermost :func:`within`, else :data:`ENV`'s, else None (any file)."""
    scope = _current.get()
    if scope is not None:
        return scope
    text = os.environ.get(ENV, "")
    return _from_env(text) if text else None


@functools.lru_cache(maxsize=4)
def _from_env(text: str) -> ReadScope:
    return ReadScope.from_env(text)


@contextlib.contextmanager
def within(scope: ReadScope | None) -> Iterator[None]:
    """Read files only inside ``scope`` in this block (None: no limit beyond the surrounding one's)."""
    token = _current.set(scope or _current.get())
    try:
        yield
    finally:
        _current.reset(token)


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`ENV` set to the current scope, for a job started within it (unchanged without one)."""
    scope = current()
    return {**env, ENV: scope.to_env()} if scope is not None else env


def hub_form(name: str) -> bool:
    """Whether ``name`` is written as a hub id (``org/name`` or ``name``), judged on its text alone."""
    t = name.strip()
    return bool(HUB_ID.fullmatch(t)) and ".." not in t and not t.lower().endswith(FILE_SUFFIXES)


def data_file(name: str, base_dirs: Iterable[str | Path] = ()) -> str:
    """The data file ``name`` names (relative to ``base_dirs``, then the current folder, as
    :func:`finetuner.locate.locate` looks), as the path to read when the current scope allows it; a hub id as it
    is; ``name`` unchanged without a scope. A local path outside the scope: one :class:`UserError`, whatever is
    there. A name written as a hub id that is also a file or folder outside the scope is refused the same way,
    never read as a local data set."""
    scope = current()
    if scope is None:
        return name
    p = expand_user(name.strip())
    candidates = [p] if p.is_absolute() else [*(Path(d) / p for d in base_dirs), Path.cwd() / p]
    allowed = [a for a in map(scope.allowed, candidates) if a is not None]
    if allowed:
        return str(next((a for a in allowed if a.exists()), allowed[0]))
    if hub_form(name) and not any(c.exists() for c in candidates):
        return name.strip()
    raise UserError(f"Data file {name}: this UI reads data files only from {scope.where()}.",
                    hint="Upload the file, or start the UI with --data-dir FOLDER for a folder of yours (finetuner ui --help).")


def picture(where: str | Path) -> Path | None:
    """The path to read for a row's picture at ``where`` (resolved against its data file's folder): ``where`` as it
    is without a scope, the path the current scope allowed, or None when it lies outside it (whatever is there):
    then the reader refuses it with :func:`picture_refusal`."""
    scope = current()
    return Path(where) if scope is None else scope.allowed(where)


def picture_refusal(ref: str) -> str:
    """Why a row's picture ``ref`` (as the row wrote it, nothing found on disk) is not read: one text for every
    picture outside the current scope."""
    scope = current()
    return (f"picture {ref!r} is not in a folder this UI reads pictures from "
            f"({scope.where() if scope else 'none'}; finetuner ui --data-dir FOLDER adds one)")

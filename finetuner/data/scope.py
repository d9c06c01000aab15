"""The folders a web UI that serves other machines reads files from: every path its page names, and the pictures rows name.

``finetuner ui --host 0.0.0.0`` (or ``--data-dir``) may make this machine read files only in ``data/``, the uploads,
the runs and the ``--data-dir`` folders (:class:`ui.handlers.Handlers`' ``data_dirs``). The UI runs its handlers
:func:`within` that :class:`ReadScope`, and what opens a file on their behalf asks it first, before anything looks at
the file: every path a box of the page names (:func:`local`, the one check: the Model, Data file, Rewards and recipe
boxes, the recipe editor's paths through :meth:`finetuner.config.recipe.Recipe.resolve_paths`, and the Export tab's
outputs, which are checked against the folders the UI writes in), a data file (:func:`data_file`:
:func:`finetuner.data.formats.read_rows`) and each picture a row names (:func:`picture`: :func:`finetuner.data.formats.picture_path`, so the Data tab's profile,
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
#: the suffixes that make a name a file's, never a hub id (finetuner.locate's suffixes, and Python's)
FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".gguf", ".safetensors", ".bin", ".pt", ".yaml", ".yml",
                 ".py")


def _folded(path: str | Path) -> Path:
    """``path`` absolute, with ``.`` and ``..`` folded away on its text alone (nothing on disk is asked)."""
    return Path(os.path.normpath(os.path.abspath(expand_user(path))))


@dataclass(frozen=True)
class ReadScope:
    """The folders files may be read from (links resolved), and how messages name them; ``written``: the same
    folders as given, for a path written through a link to one of them (``/tmp`` where it is ``/private/tmp``);
    ``data_only``: folders inside them whose files are data, never code (the UI's uploads: :func:`code_file`)."""

    folders: tuple[Path, ...]
    shown: tuple[str, ...]
    written: tuple[Path, ...] = ()
    data_only: tuple[Path, ...] = ()

    @classmethod
    def of(cls, folders: Iterable[str | Path], shown: Iterable[str] | None = None,
           data_only: Iterable[str | Path] = ()) -> ReadScope:
        given = [_folded(f) for f in folders]
        return cls(tuple(f.resolve() for f in given), tuple(shown) if shown is not None else tuple(map(str, given)),
                   tuple(given), tuple(_folded(f).resolve() for f in data_only))

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
                           "written": [str(f) for f in self.written], "data_only": [str(f) for f in self.data_only]})

    @classmethod
    def from_env(cls, text: str) -> ReadScope:
        try:
            raw = json.loads(text)
            return cls(tuple(Path(f) for f in raw["folders"]), tuple(raw["shown"]), tuple(Path(f) for f in raw["written"]),
                       tuple(Path(f) for f in raw.get("data_only", ())))
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


def local(name: str, what: str, base_dirs: Iterable[str | Path] = (), *, hub: bool = False, kind: str = "files",
          scope: ReadScope | None = None, verb: str = "reads", hint: str | None = None, cwd: bool = True) -> str:
    """The one check of a path a box of the web UI names: the path to use for ``name`` (relative to ``base_dirs``,
    then the current folder, as :func:`finetuner.locate.locate` looks) when ``scope`` (default: the current one)
    allows it; ``name`` unchanged without a scope. ``hub``: a name written as a hub id (``org/name``, a preset) that is
    no file or folder is that id, as it is. Anything else is one :class:`UserError` naming ``what`` and the folders,
    whatever is at the path (missing, unreadable, a folder, a file): nothing outside the scope is looked at but for a
    name written as a hub id, which is refused the same way when it is a local path outside, never read as one.
    ``kind`` and ``verb`` word the refusal (``reads data files``, ``writes exports``); ``cwd=False``: a relative name
    is looked for in ``base_dirs`` only."""
    scope = scope or current()
    if scope is None:
        return name
    p = expand_user(name.strip())
    candidates = [p] if p.is_absolute() else [*(Path(d) / p for d in base_dirs), *([Path.cwd() / p] if cwd else [])]
    allowed = [a for a in map(scope.allowed, candidates) if a is not None]
    if allowed:
        return str(next((a for a in allowed if a.exists()), allowed[0]))
    if hub and hub_form(name) and not any(c.exists() for c in candidates):
        return name.strip()
    where = "in" if verb == "writes" else "from"
    raise UserError(f"{what} {name}: this UI {verb} {kind} only {where} {scope.where()}.",
                    hint=hint or "Put it in data/, or start the UI with --data-dir FOLDER for a folder of yours "
                                 "(finetuner ui --help).")


def data_file(name: str, base_dirs: Iterable[str | Path] = ()) -> str:
    """The data file ``name`` names, as :func:`local` checks a path (a hub data set id as it is): a local path outside
    the current scope is one :class:`UserError`, whatever is there."""
    return local(name, "Data file", base_dirs, hub=True, kind="data files",
                 hint="Upload the file, or start the UI with --data-dir FOLDER for a folder of yours (finetuner ui --help).")


def recipe_paths(recipe, base_dir: str | Path, source: str = "recipe"):
    """A copy of the :class:`~finetuner.config.recipe.Recipe` ``recipe`` (validated, its paths as written, relative
    to ``base_dir``) with each path it names checked by :func:`local` against the current scope (its model, data and
    held-out files, the run it starts from, its reward files), as the path to use; ``recipe`` itself without a scope.
    The web UI checks a recipe so before anything looks at its files (:meth:`~finetuner.config.recipe.Recipe.resolve_paths`
    would, listing the near matches of a missing one)."""
    if current() is None:
        return recipe
    r = recipe.model_copy(deep=True)
    r.model.name = local(r.model.name, f"{source}: model.name", [base_dir], hub=True, kind="models")
    listed = r.data.path if isinstance(r.data.path, list) else [r.data.path]
    checked = [local(p, f"{source}: data.path", [base_dir], hub=True, kind="data files") for p in listed]
    r.data.path = checked if isinstance(r.data.path, list) else checked[0]
    if r.data.val_path:
        r.data.val_path = local(r.data.val_path, f"{source}: data.val_path", [base_dir], hub=True, kind="data files")
    if r.preference.start_from:
        r.preference.start_from = local(r.preference.start_from, f"{source}: preference.start_from", [base_dir])
    for i, reward in enumerate(r.grpo.rewards if r.grpo else []):
        if reward.file is not None:
            reward.file = local(reward.file, f"{source}: grpo.rewards[{i}].file", [base_dir], kind="reward files")
    return r


def code_file(path: str | Path, what: str, scope: ReadScope | None = None) -> Path:
    """The Python file ``path`` as the path to run (links followed), when the page may run it: inside ``scope``
    (default: the current one; None: anywhere; ``ReadScope.of(["/"], [])``: any file of this machine), outside its
    :attr:`~ReadScope.data_only` folders (an upload is data, never code), and a ``.py`` file. Else one
    :class:`UserError` naming ``what`` and what to do, decided on the path before the file is read."""
    scope = scope or current()
    folded = _folded(path)
    real = folded if scope is None else scope.allowed(folded)
    if real is not None and scope is not None and scope.inside(real, scope.data_only):
        real = None
    if real is None or real.suffix != ".py":
        raise UserError(f"{what}: {path} is not a Python file this UI runs: it runs reward code only from a .py file of "
                        f"this machine{f' in {scope.where()}' if scope is not None and scope.shown else ''}, "
                        "never from an upload.",
                        hint="Put the .py file in data/ (or a folder the UI was started with --data-dir), name it there, "
                             "and tick “Allow the model's own code to run”.")
    return real


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

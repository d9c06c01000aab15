"""A folder of task YAMLs given to ``eval --tasks --include-path`` is received input: what in it would run code.

lm-evaluation-harness turns parts of a task YAML into Python: ``!function utils.process_docs`` imports the
``utils.py`` beside the YAML (its top level runs) or any importable module, wherever the tag stands (a key given
twice imports its first value too; ``class: !function task.MyTask`` makes the task that class); a metric the
harness has not registered is loaded by Hugging Face ``evaluate`` (a metric script, from the hub or a local path,
run as a module); and the ``!!python/...`` tags of PyYAML's full loader (the harness's loader where PyYAML has no
libyaml) build Python objects. :func:`code_uses` finds them the way the harness reads the folder (every ``*.yaml``
under it, as its index globs them, with the files their ``include:`` names), importing nothing;
:func:`refuse_code` says the first in one line unless the user trusts the folder.

Two more things a folder could do unseen are stopped here too: a folder task named like one of the harness's own
tasks, groups or tags replaces it (:func:`task_manager` refuses that unless asked), and the harness renders a
task's ``doc_to_text``/``doc_to_choice``/... templates with jinja2 in an unsandboxed ``Environment``, where
``{{ ''.__class__.__mro__ }}`` reaches any Python object (:func:`sandboxed_templates` renders them in jinja2's
``SandboxedEnvironment`` instead, with bounds on memory and time: :mod:`finetuner.infer.template_bounds`).

What is checked is what runs: :func:`checked_copy` copies the folder's YAML and Python files to a private folder
(mode 0700, finetuner's own temp) and checks the copy, which is all the harness then reads; a file changed in the
user's folder after the check changes nothing. Every refusal of the check is one line naming the file and key: an
``include:`` that is not a file name, names no file or leads out of the folder, YAML that cannot be read, a dataset
loading script (``dataset_path`` naming a ``.py`` file or a folder with one).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from finetuner.errors import UserError

#: the folders the harness's index leaves out (lm_eval.tasks._index._IGNORE_DIRS)
IGNORED_DIRS = {"__pycache__", ".ipynb_checkpoints"}
#: PyYAML's tags for Python objects, as it writes them (``!!python/name:os.system``)
PYTHON_TAG = "tag:yaml.org,2002:python/"


@dataclass(frozen=True)
class Tagged:
    """A YAML value under a tag the safe loader does not build (``!function utils.process_docs``)."""

    tag: str
    value: str

    def __str__(self) -> str:
        standard = "tag:yaml.org,2002:"
        shown = "!!" + self.tag.removeprefix(standard) if self.tag.startswith(standard) else self.tag
        return f"{shown} {self.value}".rstrip()


class _Reader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # the harness's parser (libyaml where PyYAML has it)
    """A safe loader that keeps every tag it does not know as a :class:`Tagged` value instead of building it."""


def _tagged(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Tagged:
    return Tagged(node.tag, loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else "...")


_Reader.add_multi_constructor("", _tagged)


@dataclass(frozen=True)
class CodeUse:
    """One place of a task YAML that runs code: ``file``: ``key``: ``what`` ``runs``."""

    file: str
    key: str
    what: str
    runs: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.what} {self.runs}"


def builtin_task_dir() -> Path:
    """The folder of the harness's own task YAMLs (what ``TaskManager(include_defaults=True)`` indexes)."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def _known_metrics() -> set[str]:
    import lm_eval.api.metrics  # noqa: F401  (registers the harness's metrics)
    from lm_eval.api.registry import metric_registry

    return set(metric_registry.keys())


def task_yamls(folder: Path) -> list[Path]:
    """The YAML files the harness's index reads under ``folder`` (as ``TaskIndex._iter_yaml_files`` globs them)."""
    return sorted((p for p in folder.glob("**/*.yaml") if not any(part in IGNORED_DIRS for part in p.parts)
                   and not p.is_dir()),
                  key=lambda p: p.as_posix())


#: the files of a task folder the harness reads as configuration or imports as code (what :func:`checked_copy` copies)
COPIED_SUFFIXES = {".yaml", ".yml", ".py"}
#: the most a task folder's copied files may hold together
MAX_COPY_BYTES = 64 * 2**20
MAX_COPY_FILES = 10_000


class _Scan:
    """The walk of one folder: every file read once (an ``include:`` cycle ends), the harness's own files not
    read at all (their code is the installed harness's, run for its own tasks anyway). ``shown_as``: the folder the
    user named, when ``folder`` is its private copy (``contained``: an include may not lead out of it). The
    templates found (text -> ``file: key``) are kept in :attr:`templates`."""

    def __init__(self, folder: Path, shown_as: Path | None = None, contained: bool = False):
        self.folder, self.root = shown_as or folder, folder.expanduser().resolve()
        self.builtin = builtin_task_dir()
        self.metrics = _known_metrics()
        self.seen: set[Path] = set()
        self.contained = contained
        self.templates: dict[str, str] = {}

    def shown(self, path: Path) -> str:
        """``path`` as the user wrote the folder (``tasks/evil.yaml``), or in full outside it."""
        return str(self.folder / path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def file(self, path: Path) -> list[CodeUse]:
        path = path.expanduser().resolve()  # as lm_eval's load_yaml: a `!function` is found beside the real file
        if path in self.seen or path.is_relative_to(self.builtin):
            return []
        self.seen.add(path)
        try:
            with path.open("rb") as fh:
                loader = _Reader(fh)
                node = loader.get_single_node()
        except OSError as e:
            raise UserError(f"{self.shown(path)}: cannot read it ({e.strerror or e}).") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f"line {mark.line + 1}: " if mark is not None else ""
            raise UserError(f"{self.shown(path)}: {at}not valid YAML ({getattr(e, 'problem', None) or 'unreadable'}); "
                            "fix or remove the file.") from None
        if node is None:
            return []
        # the tags from the document as written: a key given twice keeps only its last value once built, but the
        # harness's loader builds (imports) the first one's `!function` too
        found = list(self.tags(node, "", path, set()))
        try:
            cfg = loader.construct_document(node)
        except Exception:  # noqa: BLE001  (nor does the harness build it: its index skips any file that fails)
            return found
        finally:
            loader.dispose()
        if not isinstance(cfg, dict):
            return found
        found += self.metrics_of(cfg, "", path)
        self.keep_templates(cfg, "", path)
        self.loading_script(cfg, path)
        includes = cfg.get("include")
        for inc in includes if isinstance(includes, list) else [] if includes is None else [includes]:
            found += self.file(self.included(inc, path))
        return found

    def included(self, inc: Any, path: Path) -> Path:
        """The file an ``include:`` entry names, as lm_eval's ``load_yaml`` finds it; one line when it is not a
        file name, is missing, or (in a private copy) lies outside the folder and the harness's own tasks."""
        where = f"{self.shown(path)}: include: {str(inc)[:120]}"
        if not isinstance(inc, str) or not inc.strip():
            raise UserError(f"{where} is not a file name; give the path of a YAML file (or a list of them).")
        target = (Path(inc) if Path(inc).is_absolute() else path.parent / inc).expanduser()
        resolved = target.resolve()
        if self.contained and not resolved.is_relative_to(self.root) and not resolved.is_relative_to(self.builtin):
            raise UserError(f"{where} lies outside the folder; copy it into {self.folder} (finetuner checks and runs "
                            "a private copy of the folder).")
        if not resolved.is_file():
            raise UserError(f"{where}: no such file.")
        return target

    def loading_script(self, cfg: dict, path: Path) -> None:
        """A ``dataset_path`` that is a dataset loading script (a ``.py`` file, or a folder holding one named like
        it, as ``datasets.load_dataset`` reads them): Python, refused in one line."""
        value = cfg.get("dataset_path")
        if not isinstance(value, str) or not value.strip():
            return
        named = Path(value).expanduser()
        candidates = [named] if named.is_absolute() else [path.parent / named, Path.cwd() / named]
        script = None
        if value.endswith(".py"):
            script = value
        else:
            for d in candidates:
                if d.is_dir() and (d / f"{d.resolve().name}.py").is_file():
                    script = self.shown((d / f"{d.resolve().name}.py").resolve())
                    break
        if script is not None:
            raise UserError(f"{self.shown(path)}: dataset_path: {value[:120]} is a dataset loading script ({script}): "
                            "Python, which finetuner does not run (datasets 4 and later refuse it too); give the data "
                            "as files instead (dataset_path: json, dataset_kwargs: data_files: ...).")

    def keep_templates(self, value: Any, key: str, path: Path) -> None:
        """Each jinja2 template of the document (a text with ``{{`` or ``{%``), by its file and key."""
        stack = [(value, key)]
        while stack:
            v, k = stack.pop()
            if isinstance(v, dict):
                stack += [(x, f"{k}.{n}" if k else str(n)) for n, x in v.items()]
            elif isinstance(v, list):
                stack += [(x, f"{k}[{i}]") for i, x in enumerate(v)]
            elif isinstance(v, str) and ("{{" in v or "{%" in v):
                self.templates.setdefault(v, f"{self.shown(path)}: {k}")

    def tags(self, node: yaml.Node, key: str, path: Path, walked: set[int]) -> Iterator[CodeUse]:
        """The code tags in the YAML node graph under ``node`` (an alias is the same node: each walked once)."""
        if id(node) in walked:
            return
        walked.add(id(node))
        if node.tag == "!function" or node.tag.startswith(PYTHON_TAG):
            tagged = Tagged(node.tag, node.value if isinstance(node, yaml.ScalarNode) else "...")
            yield CodeUse(self.shown(path), key or "(the document)", str(tagged), self.runs(tagged, path))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else "?"
                yield from self.tags(k, f"{key} (a key)" if key else "(a key)", path, walked)
                yield from self.tags(v, f"{key}.{name}" if key else name, path, walked)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                yield from self.tags(v, f"{key}[{i}]", path, walked)

    def metrics_of(self, value: Any, key: str, path: Path) -> Iterator[CodeUse]:
        """Every ``metric_list`` in the document (a task's, or a group's inline task's)."""
        if isinstance(value, dict):
            yield from self.metric_list(value, key, path)
            for k, v in value.items():
                yield from self.metrics_of(v, f"{key}.{k}" if key else str(k), path)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from self.metrics_of(v, f"{key}[{i}]", path)

    def runs(self, tagged: Tagged, path: Path) -> str:
        if tagged.tag != "!function":
            return "builds a Python object"
        module = tagged.value.rpartition(".")[0]
        beside = (path.parent / f"{module.replace('.', '/')}.py").resolve()  # where lm_eval looks first
        return f"runs {self.shown(beside)}" if beside.exists() else f"imports the Python module {module}"

    def metric_list(self, cfg: dict, key: str, path: Path) -> Iterator[CodeUse]:
        """A task's metrics: a name the harness has not registered (or ``hf_evaluate: true``) is loaded by
        ``evaluate.load(name)`` (lm_eval.api.registry.get_metric), which runs that metric's script."""
        metrics = cfg.get("metric_list")
        for i, m in enumerate(metrics if isinstance(metrics, list) else []):
            name = m.get("metric") if isinstance(m, dict) else None
            if isinstance(name, str) and (m.get("hf_evaluate") is True or name not in self.metrics):
                where = f"{key}.metric_list[{i}].metric" if key else f"metric_list[{i}].metric"
                yield CodeUse(self.shown(path), where, name, "is loaded by Hugging Face evaluate, which runs the "
                                                             "metric's Python script")


def code_uses(folder: str | Path) -> list[CodeUse]:
    """Every place of ``folder``'s task YAMLs (and the files they include) that would run code when the
    harness loads the task; nothing is imported to find them."""
    scan = _Scan(Path(folder))
    return [use for path in task_yamls(Path(folder)) for use in scan.file(path)]


def refuse_code(folder: str | Path) -> None:
    """Raise the one-line :class:`UserError` naming the first place of ``folder`` that runs code, if any."""
    _refuse(code_uses(folder))


def private_copy(folder: str | Path) -> Path:
    """The folder's YAML and Python files (:data:`COPIED_SUFFIXES`; a linked file's content) copied to a new
    private folder (mode 0700, under the system's temp folder, removed when the process exits); the copy is named
    like the folder. At most :data:`MAX_COPY_FILES` files and :data:`MAX_COPY_BYTES`, else one line."""
    import os

    from finetuner.fileio import private_temp_dir

    src = Path(folder).expanduser().resolve()
    dest = private_temp_dir("finetuner-tasks-") / (src.name or "tasks")
    dest.mkdir(mode=0o700)
    files = total = 0
    for top, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS)
        here = Path(top)
        for name in sorted(names):
            p = here / name
            if p.suffix.lower() not in COPIED_SUFFIXES or not (p.is_file() or p.is_symlink()):
                continue  # a link is copied as what it leads to (one line when that cannot be read)
            try:
                data = p.read_bytes()
            except OSError as e:
                raise UserError(f"{Path(folder) / p.relative_to(src)}: cannot read it ({e.strerror or e}).") from None
            files, total = files + 1, total + len(data)
            if files > MAX_COPY_FILES or total > MAX_COPY_BYTES:
                raise UserError(f"--include-path {folder}: over {MAX_COPY_FILES:,} YAML and Python files or "
                                f"{MAX_COPY_BYTES // 2**20} MiB of them; give a folder of task YAMLs.")
            out = dest / p.relative_to(src)
            out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            out.write_bytes(data)
    return dest


def checked_copy(folder: str | Path) -> tuple[Path, dict[str, str]]:
    """A private copy of ``folder`` (:func:`private_copy`), checked as :func:`refuse_code` checks a folder, and its
    templates (text -> ``file: key``, the files named as in ``folder``). The harness is given the copy: what was
    checked is what it reads."""
    copy = private_copy(folder)
    scan = _Scan(copy, shown_as=Path(folder), contained=True)
    _refuse([use for path in task_yamls(copy) for use in scan.file(path)])
    return copy, scan.templates


def _refuse(found: list[CodeUse]) -> None:
    if found:
        more = f" (and {len(found) - 1} more in the folder)" if len(found) > 1 else ""
        raise UserError(f"{found[0]}{more}; add --trust-remote-code if you trust the folder "
                        "(Python: trust_remote_code=True).")


def _kind(manager, name: str) -> str:
    return "group" if name in manager.all_groups else "tag" if name in manager.all_tags else "task"


def _declared_in(manager, name: str) -> Path:
    """The YAML that brings ``name`` into ``manager``'s index (a tag's: the first task that names it)."""
    entry = manager.task_index[name]
    return entry.yaml_path if entry.yaml_path is not None else manager.task_index[sorted(entry.tags)[0]].yaml_path


def task_manager(include_path: str | Path | None, replace_builtin_tasks: bool = False):
    """The harness's ``TaskManager`` with its own tasks and ``include_path``'s. A name the folder defines
    (task, group or tag) that is also one of the harness's own is refused in one line, unless
    ``replace_builtin_tasks`` (then the folder's replaces it, as ``lm_eval --include_path`` does).

    The harness's own ~14,000 YAMLs are indexed once (most of the time this takes): the folder first and
    the harness's folder after it, so that a name in both is the harness's in this index and the folder's
    in the folder's own small index, and the two entries differ; with no name in both, the index is the
    one ``TaskManager(include_path=...)`` builds."""
    from lm_eval.tasks import TaskManager

    if include_path is None:
        return TaskManager()
    if replace_builtin_tasks:
        return TaskManager(include_path=str(include_path))
    own = TaskManager(include_path=str(include_path), include_defaults=False)
    manager = TaskManager(include_path=[str(include_path), str(builtin_task_dir())], include_defaults=False)
    shadowed = [n for n in own.all_tasks if manager.task_index[n] != own.task_index[n]]
    if shadowed:
        first = shadowed[0]
        more = f" (and {', '.join(shadowed[1:])})" if shadowed[1:] else ""
        raise UserError(f"{_declared_in(own, first)}: {_kind(own, first)}: {first} would replace "
                        f"lm-evaluation-harness's own {_kind(manager, first)} {first}{more}; rename it, or add "
                        "--replace-builtin-tasks to run the folder's instead (Python: replace_builtin_tasks=True).")
    return manager


@contextmanager
def sandboxed_templates() -> Iterator[None]:
    """While it lasts, the harness renders task templates in jinja2's ``SandboxedEnvironment``, bounded
    (:class:`~finetuner.infer.template_bounds.BoundedSandbox`; same loader,
    undefined, newline and filters as its own ``Environment``): attributes such as ``__class__`` raise
    ``jinja2.exceptions.SecurityError`` instead of reaching Python objects. ``lm_eval.utils.apply_template``,
    through which every ``doc_to_*`` and ``gen_prefix`` template is rendered, reads the module's ``env`` at
    each call; it is put back when this ends."""
    from lm_eval import utils

    from finetuner.infer.template_bounds import BoundedSandbox

    plain = utils.env
    sandboxed = BoundedSandbox(loader=plain.loader, undefined=plain.undefined,
                               keep_trailing_newline=plain.keep_trailing_newline)
    sandboxed.filters.update(plain.filters)
    utils.env = sandboxed
    try:
        yield
    finally:
        utils.env = plain

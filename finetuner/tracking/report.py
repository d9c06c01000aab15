"""From the run's events to its trackers: one reader of the event stream, the same for every tracker.

:class:`Reporters` is an event callback of the trainer (rank 0 only: the other ranks' recipes report nowhere). On
``start`` it opens one tracking run per tracker, or continues the one whose id ``tracking.json`` in the run folder
keeps (a resumed run) when this user's finetuner started that one (:mod:`finetuner.tracking.owned`) or the
user says ``--tracking-resume``; the recipe, the plan and the start's figures become the run's parameters; each ``step`` and
``eval`` its metrics; ``done`` the final figures (predicted vs measured memory and time, the general probe) and the
adapter, plan and recipe as artifacts; ``samples`` and GRPO's sampled ``completions`` (each with its rewards) a table
where the tracker has one; ``error``/``stopped`` the run's end state. A tracker that fails (not installed, no server, a bad key) is dropped with one warning line: training goes on.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from finetuner.tracking import owned

log = logging.getLogger(__name__)

#: the run folder's file that keeps each tracker's run id, so that a resumed run continues its tracking run
IDS_FILE = "tracking.json"
#: the pip extra of each tracker
EXTRAS = {"mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}


class TrackerRun(Protocol):
    """One tracking run in one tracker (:mod:`finetuner.tracking.to_mlflow`, :mod:`~finetuner.tracking.to_wandb`,
    :mod:`~finetuner.tracking.to_trackio`)."""

    run_id: str
    #: where a user finds the run: a link (a server's page), else the place (a folder, a store) and the run's id
    where: str

    def log_params(self, params: dict[str, str]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_table(self, name: str, rows: list[dict[str, str]], step: int) -> None: ...
    def log_artifacts(self, paths: list[Path]) -> None: ...
    def finish(self, state: str) -> None: ...


def open_tracker(name: str, run_dir: Path, run_name: str, run_id: str | None) -> TrackerRun:
    """Start (or with ``run_id`` continue) ``name``'s tracking run of the finetuner run in ``run_dir``."""
    if name == "wandb":
        from finetuner.tracking.to_wandb import WandbRun

        return WandbRun(run_dir, run_name, run_id)
    if name == "trackio":
        from finetuner.tracking.to_trackio import TrackioRun

        return TrackioRun(run_dir, run_name, run_id)
    from finetuner.tracking.to_mlflow import MlflowRun

    return MlflowRun(run_dir, run_name, run_id)


#: what no tracker takes in a name (MLflow allows letters, digits, ``_ - . : /`` and spaces): replaced by ``_``
_NOT_IN_NAME = re.compile(r"[^\w\-.:/ ]")


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``a.b.c`` keys (lists kept as values), each key a name every tracker takes."""
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        k = _NOT_IN_NAME.sub("_", str(k))
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def numbers(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) dict, as metrics named ``prefix`` + their flattened key; byte counts
    (``mem_*``, ``*_bytes``) in GiB."""
    out: dict[str, float] = {}
    for k, v in flatten(d).items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            continue
        leaf = k.rsplit(".", 1)[-1]
        if leaf.startswith("mem_") or leaf.endswith("_bytes"):
            k, v = f"{k.removesuffix('_bytes')}_gib", v / 2**30
        out[prefix + k] = float(v)
    return out


def params_of(run_dir: Path, start: dict[str, Any]) -> dict[str, str]:
    """The tracking run's parameters: the recipe (``recipe.*``), the plan (``plan.*``, when ``finetuner plan``
    chose it) and the start's settings and predictions (``run.*``), each as text."""
    import yaml

    params: dict[str, Any] = {}
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text(encoding="utf-8")) if (run_dir / "recipe.yaml").exists() else {}
    params.update(flatten(recipe or {}, "recipe."))
    if (run_dir / "plan.json").exists():
        params.update(flatten(json.loads((run_dir / "plan.json").read_text(encoding="utf-8")), "plan."))
    skip = {"event", "time", "run_dir", "data", "resolved", "schema_version"}
    params.update(flatten({k: v for k, v in start.items() if k not in skip}, "run."))
    return {k: json.dumps(v) if isinstance(v, list | dict) else str(v) for k, v in params.items() if v is not None}


def tracked_at(run_dir: Path) -> dict[str, str]:
    """Where each tracker keeps the run in ``run_dir`` (:attr:`TrackerRun.where`), as its start wrote it in
    tracking.json; {} before that, or for a run reported to TensorBoard only."""
    try:
        where = json.loads((Path(run_dir) / IDS_FILE).read_text(encoding="utf-8")).get("where")
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in where.items()} if isinstance(where, dict) else {}


class Reporters:
    """The run's trackers, fed one event at a time (:meth:`__call__`, an :class:`~finetuner.runs.events.EventWriter`
    callback). Never raises: a tracker that fails says so in one warning line and is dropped."""

    def __init__(self, names: list[str], run_dir: Path, run_name: str, tracking_resume: bool | None = None,
                 private_key: Callable[[], bytes] | None = None):
        self.names = [n for n in names if n != "tensorboard"]
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        #: continue the tracking runs tracking.json names even when this user's finetuner did not start them
        #: (``--tracking-resume``; default: :data:`~finetuner.tracking.owned.RESUME_ENV`)
        self.tracking_resume = owned.resume_by_env() if tracking_resume is None else tracking_resume
        #: this user's private key, which marks the tracking runs a run starts (None: nothing is marked, none continued)
        self.private_key = private_key
        self.runs: dict[str, TrackerRun] = {}
        self.step = 0

    def _ids(self) -> dict[str, str]:
        try:
            return json.loads((self.run_dir / IDS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def _fail(self, name: str, e: BaseException) -> None:
        self.runs.pop(name, None)
        if name in self.names:
            self.names.remove(name)
        why = f"not installed: pip install 'finetuner[{EXTRAS[name]}]'" if isinstance(e, ImportError) else f"{type(e).__name__}: {e}"
        log.warning("%s: %s; the run goes on without it", name, " ".join(str(why).split())[:300])

    def _each(self, call) -> None:
        for name, run in list(self.runs.items()):
            try:
                call(run)
            except Exception as e:  # a tracker never stops training
                self._fail(name, e)

    def __call__(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "start":
            self._start(ev)
        elif kind == "step":
            self.step = ev["step"]
            metrics = numbers({k: ev.get(k) for k in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "epoch")}, "train/")
            metrics.update(numbers({k: v for k, v in ev.items() if k.startswith("mem_")}, "memory/"))
            skip = {"event", "time", "step", "max_steps", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "epoch",
                    "tokens", "elapsed_s", "eta_s", "micro_batch_size"}
            metrics.update(numbers({k: v for k, v in ev.items() if k not in skip and not k.startswith("mem_")}, "train/"))
            self._each(lambda r: r.log_metrics(metrics, ev["step"]))
            self._table("completions", ev.get("completions"), ev["step"])  # GRPO's sampled completions of the step
        elif kind == "eval":
            metrics = numbers({k: v for k, v in ev.items() if k not in ("event", "time", "step")}, "eval/")
            self._each(lambda r: r.log_metrics(metrics, ev["step"]))
        elif kind == "done":
            self._done(ev)
        elif kind == "samples":
            self._table("samples", ev.get("samples"), self.step)
        elif kind in ("error", "stopped"):
            self.close("failed" if kind == "error" else "stopped")

    def _table(self, name: str, items: Any, step: int) -> None:
        """``items`` (dicts: samples, GRPO's completions with their rewards) as a table named ``name``, one text column
        per flattened key (a completion's ``rewards.<function>``), where the tracker keeps tables."""
        rows = [flatten(item) for item in items or [] if isinstance(item, dict)]
        if rows:
            keys = list(dict.fromkeys(k for row in rows for k in row))
            rows = [{k: "" if row.get(k) is None else str(row[k]) for k in keys} for row in rows]
            self._each(lambda r: r.log_table(name, rows, step))

    def _continued(self, ids: dict[str, Any], name: str, key: bytes | None) -> str | None:
        """The id of ``name``'s tracking run to continue: tracking.json's, when this user's finetuner started it
        (:mod:`finetuner.tracking.owned`) or the user said ``--tracking-resume``; else None, said in one line."""
        run_id = ids.get(name)
        if not isinstance(run_id, str) or not run_id:
            return None
        marks = ids.get("marks") if isinstance(ids.get("marks"), dict) else {}
        if self.tracking_resume or owned.is_ours(name, run_id, marks.get(name), key):
            return run_id
        log.warning("%s: %s names %s run %s, which finetuner did not start for you (a run folder from elsewhere?): "
                    "reporting to a new %s run instead (to continue that one: finetuner run ... --tracking-resume)",
                    name, self.run_dir / IDS_FILE, name, " ".join(run_id.split())[:80], name)
        return None

    def _start(self, ev: dict[str, Any]) -> None:
        ids = self._ids()
        ids = ids if isinstance(ids, dict) else {}
        key = owned.user_key(self.private_key)
        for name in self.names:
            try:
                self.runs[name] = open_tracker(name, self.run_dir, self.run_name, self._continued(ids, name, key))
            except Exception as e:
                self._fail(name, e)
        if not self.runs:
            return
        ids.update({n: r.run_id for n, r in self.runs.items()})
        marks = ids.get("marks") if isinstance(ids.get("marks"), dict) else {}
        ids["marks"] = {**marks, **{n: owned.mark(n, r.run_id, key) for n, r in self.runs.items()}}
        where = ids.get("where") if isinstance(ids.get("where"), dict) else {}
        ids["where"] = {**where, **{n: r.where for n, r in self.runs.items()}}
        (self.run_dir / IDS_FILE).write_text(json.dumps(ids, indent=1) + "\n", encoding="utf-8")
        params = params_of(self.run_dir, ev)
        self._each(lambda r: r.log_params(params))

    def _done(self, ev: dict[str, Any]) -> None:
        self.step = ev["step"]
        m = ev.get("metrics") or {}
        final = numbers({k: v for k, v in m.items() if k not in ("memory", "time", "data", "general_probe")}, "final/")
        final.update(numbers(m.get("memory") or {}, "memory/"))
        final.update(numbers(m.get("time") or {}, "time/"))
        final.update(numbers(m.get("general_probe") or {}, "general_probe/"))
        final.update(numbers({k: v for k, v in ev.items() if k.startswith(("predicted_", "measured_"))}, "speed/"))
        self._each(lambda r: r.log_metrics(final, self.step))
        paths = [p for p in (Path(ev["adapter_dir"]) if ev.get("adapter_dir") else None, self.run_dir / "plan.json",
                             self.run_dir / "recipe.yaml", self.run_dir / "metrics.json") if p is not None and p.exists()]
        self._each(lambda r: r.log_artifacts(paths))

    def close(self, state: str = "finished") -> None:
        """End every tracking run (``state``: finished, failed or stopped); a second call does nothing."""
        self._each(lambda r: r.finish(state))
        self.runs.clear()

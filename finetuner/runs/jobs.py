"""Training jobs for the web UI (or any front end): start, stop, resume, list, follow.

A job is ``python -m finetuner run RUN_DIR/recipe.yaml -o RUN_DIR --quiet`` in its own process
and session, so closing the browser or restarting the UI never stops it; its output goes to
``RUN_DIR/train.log``, for people to read. What a front end shows comes from the run's
``events.jsonl`` (:func:`run_status`), never from the log: a run that fails, even before it trains
(a recipe value the planner refuses, a missing model), ends there with an ``error`` event. A failure
that may not be written into the run's events (the folder is held by another process: see
:func:`finetuner.runs.folder.record_early_failure`) reaches the job's runner through the worker
protocol's report file, ``RUN_DIR/.job-report.jsonl`` (:mod:`finetuner.worker_protocol`).

One job per device at a time: ``RUNS_DIR/.jobs.json`` records the running jobs (pid and the
process's start time, run folder, device), written under an ``flock`` so two sessions cannot both
start one. A job whose process has ended is dropped from the registry when it is next read; so is
one whose pid now belongs to another process (the pid was reused after the job ended: its start
time differs), which is therefore never signalled. Stopping sends SIGINT: the trainer
finishes the current step, saves a checkpoint and exits with status 130; starting the same run
folder again resumes from that checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import finetuner.phases as phases
import finetuner.worker_protocol as protocol
from finetuner.objectives.specs import DEFAULT as DEFAULT_OBJECTIVE
from finetuner.infer.probe import kept_line
from finetuner.infer.tool_eval import calls_line
from finetuner.data.replay import ROUTINE_REASONS
from finetuner.children import Spawned, module_command, safe_env, spawn_job
from finetuner.workdir import work_dir
from finetuner.data import scope as read_scope
from finetuner.device import CUDA
from finetuner.errors import UserError
from finetuner.runs.events import read_events, run_folder_busy, run_folder_holder
from finetuner.runs.schema import RESUMABLE_STATES, RunState, RunStateTracker

REGISTRY = ".jobs.json"
LOG_NAME = "train.log"
#: where a job's process reports a failure it could not record in the run's events (worker protocol messages)
REPORT_NAME = ".job-report.jsonl"

#: Children started by this process, so they are reaped (no zombies) and their exit code known.
_CHILDREN: dict[int, Spawned] = {}
_EXITED: dict[int, int] = {}


def repo_root() -> Path:
    """The folder holding the ``finetuner`` package (the checkout in a development install)."""
    return Path(__file__).resolve().parents[2]


def default_runs_dir() -> Path:
    """``runs/`` of the checkout when finetuner runs from one, else ``./runs``."""
    root = repo_root()
    if (root / "pyproject.toml").is_file():
        return root / "runs"
    return Path.cwd().resolve() / "runs"


@dataclass
class Job:
    """A training process started by :func:`start_job`."""

    pid: int
    run_dir: str
    name: str
    device: str
    started: float
    log: str
    command: list[str] = field(default_factory=list)
    #: the process's start time as the system tells it (:func:`process_start_time`): with the pid,
    #: what identifies the job's process (a pid alone may since have been given to another process)
    proc_start: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- processes
def _alive(pid: int) -> bool:
    child = _CHILDREN.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        _EXITED[pid] = child.returncode
        _CHILDREN.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child of another process may linger as a zombie
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def process_start_time(pid: int) -> float | None:
    """When the process ``pid`` started (seconds since the epoch, as ``psutil`` reads it from the
    system: the same value however often it is asked), or None if there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError, ValueError):
        return None


#: how far (s) two readings of one process's start time may differ: float noise only (the system
#: counts in clock ticks, 10 ms); a reused pid belongs to a process started long after the job's
START_TIME_SLACK_S = 0.05


def _is_job_process(job: dict[str, Any]) -> bool:
    """Whether the registry record ``job`` still names a live process of that job: its pid is alive
    and is the same process (the start time recorded matches; a record without one, written by an
    older finetuner, must match the recorded command line instead). A pid reused by an unrelated
    process after the job ended is not the job."""
    pid = int(job["pid"])
    if not _alive(pid):
        return False
    if pid in _CHILDREN:  # started and not yet reaped by this process: the pid cannot have been reused
        return True
    recorded = job.get("proc_start")
    if recorded is not None:
        now = process_start_time(pid)
        return now is not None and abs(now - float(recorded)) <= START_TIME_SLACK_S
    import psutil

    try:
        return bool(job.get("command")) and psutil.Process(pid).cmdline() == list(job["command"])
    except (psutil.Error, OSError):
        return False


def exit_code(pid: int) -> int | None:
    """The exit status of a job this process started, once it has ended (else None)."""
    _alive(pid)
    return _EXITED.get(pid)


def _devices_clash(a: str, b: str) -> bool:
    return a == b or "auto" in (a, b)


def _device_key(device: str) -> str:
    d = (device or "auto").strip().lower()
    return f"{CUDA}:0" if d == CUDA else d


# --------------------------------------------------------------------------- the registry
@contextmanager
def _registry(runs_dir: Path) -> Iterator[list[dict[str, Any]]]:
    """The running jobs, locked for the duration; ended jobs are dropped; changes are saved."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    path = runs_dir / REGISTRY
    with open(runs_dir / (REGISTRY + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            jobs = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
        except (json.JSONDecodeError, OSError):
            jobs = []
        before = json.dumps(jobs)
        jobs[:] = [j for j in jobs if isinstance(j, dict) and "pid" in j and _is_job_process(j)]
        yield jobs
        if json.dumps(jobs) != before:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(jobs, indent=2), encoding="utf-8")
            os.replace(tmp, path)


def running_jobs(runs_dir: str | Path | None = None) -> list[Job]:
    """Jobs whose process is alive, from the registry on disk (any UI session, any process)."""
    with _registry(Path(runs_dir or default_runs_dir())) as jobs:
        return [Job(**j) for j in jobs]


#: where a run that no job started is trained: a ``finetuner run`` in a terminal (or another program's process)
TERMINAL_WHERE = "started outside the web UI, by `finetuner run` in a terminal"


@dataclass
class TerminalRun:
    """A run folder of the runs folder that a process holds which no job started (:func:`terminal_runs`)."""

    run_dir: str
    name: str
    pid: int | None
    #: the device its recipe asks for (:func:`_device_key`: ``auto`` when it names none)
    device: str
    #: when its process started (seconds since the epoch), None when it cannot be told
    started: float | None


def terminal_runs(runs_dir: str | Path, job_dirs: set[str] | None = None) -> list[TerminalRun]:
    """The runs under ``runs_dir`` that are training in a process no job started (a ``finetuner run`` in a
    terminal, with ``-o`` in the runs folder): a process holds their folder's lock and no running job of the
    registry trains there (``job_dirs``: the jobs' run folders; default read from the registry). One device holds
    one run, whoever started it."""
    runs = Path(runs_dir)
    if job_dirs is None:
        job_dirs = {j.run_dir for j in running_jobs(runs)}
    out = []
    for d in sorted(runs.iterdir()) if runs.is_dir() else []:
        if not d.is_dir() or d.name.startswith(".") or str(d.resolve()) in job_dirs or not run_folder_busy(d):
            continue
        pid = run_folder_holder(d)
        device = _recipe_fields(d).get("device")
        out.append(TerminalRun(str(d.resolve()), d.name, pid, _device_key(device if isinstance(device, str) else "auto"),
                               process_start_time(pid) if pid else None))
    return out


def job_for(run_dir: str | Path, runs_dir: str | Path | None = None) -> Job | None:
    rd = str(Path(run_dir).resolve())
    return next((j for j in running_jobs(runs_dir) if j.run_dir == rd), None)


# --------------------------------------------------------------------------- start / stop
def safe_name(name: str) -> str:
    """A folder name from free text: letters, digits, ``.-_`` only, no leading dot."""
    s = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "-", name)).strip(".-_")
    return s[:80] or "run"


def new_run_dir(runs_dir: str | Path, name: str) -> Path:
    """A fresh folder ``RUNS_DIR/<name>-<date-time>`` (never an existing one)."""
    base = Path(runs_dir) / f"{safe_name(name)}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


def free_run_name(runs_dir: str | Path, name: str) -> str:
    """``name`` if no run folder has it yet, else the first free ``name-2``, ``name-3``...: a name to
    propose before a run starts (the user sees it), never applied silently at start."""
    base = safe_name(name)[:96]
    cand, i = base, 1
    while (Path(runs_dir) / cand).exists():
        i += 1
        cand = f"{base}-{i}"
    return cand


def named_run_dir(runs_dir: str | Path, name: str) -> Path:
    """The folder ``RUNS_DIR/<name>`` for a new run named as the user typed it.

    Raises:
        UserError: a run (or anything else) already has that name; nothing is renamed or replaced.
    """
    path = Path(runs_dir) / safe_name(name)
    if path.exists():
        raise UserError(
            f"A run named '{path.name}' already exists in {Path(runs_dir)}; a new run needs a new name.",
            hint=f"Change `name:` in the recipe (e.g. to {free_run_name(runs_dir, name)}) to start a new run, or pick "
                 f"{path.name} under Run to see it (Resume continues it if it was stopped).",
        )
    return path


def start_job(
    recipe: Any,
    run_dir: str | Path | None = None,
    runs_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    exact_name: bool = False,
    trust_checkpoints: bool = False,
    tracking_resume: bool = False,
) -> Job:
    """Start training in a new process; returns at once.

    Args:
        recipe: a :class:`~finetuner.config.recipe.Recipe`, or the path of a recipe YAML. Ignored when
            ``run_dir`` already holds a run (its ``recipe.yaml`` is resumed).
        run_dir: the run folder; default a new ``RUNS_DIR/<recipe name>-<date-time>``.
        runs_dir: where runs and the job registry live (default :func:`default_runs_dir`).
        overrides: ``key=value`` recipe overrides (``--set``), for a new run only.
        exact_name: a new run's folder is ``RUNS_DIR/<recipe name>``, the name as the user typed it
            (refused if taken), instead of ``<recipe name>-<date-time>``.
        trust_checkpoints: ``finetuner run --trust-checkpoints``: sharded checkpoints this user did not
            seal may be resumed (:mod:`finetuner.training.seal`).
        tracking_resume: ``finetuner run --tracking-resume``: the run reports to the tracking runs its
            ``tracking.json`` names even when finetuner did not start them for this user (:mod:`finetuner.tracking.owned`).

    Raises:
        UserError: another job is running on the same device, the recipe is invalid, or (with
            ``exact_name``) a run already has the recipe's name.
    """
    from finetuner.config.recipe import Recipe
    from finetuner.data.follow import load_recipe

    runs = Path(runs_dir or default_runs_dir()).resolve()
    existing = Path(run_dir).resolve() if run_dir else None
    resuming = existing is not None and (existing / "recipe.yaml").is_file()
    if resuming:
        recipe_obj = Recipe.from_yaml(existing / "recipe.yaml")
    else:
        recipe_obj = load_recipe(recipe, overrides)
    device = _device_key(recipe_obj.device)
    with _registry(runs) as jobs:
        for j in jobs:
            if existing is not None and j["run_dir"] == str(existing):
                raise UserError(f"The run {j['name']} is already training (pid {j['pid']}).")
            if _devices_clash(device, j["device"]):
                raise UserError(
                    f"A training job is already running on this device: {j['name']} (pid {j['pid']}, "
                    f"started {time.strftime('%H:%M:%S', time.localtime(j['started']))} as a job, from the web UI "
                    "or finetuner.runs.jobs).",
                    hint="Wait for it to finish, or stop it first (a checkpoint is saved; it can be resumed).",
                )
        for t in terminal_runs(runs, {j["run_dir"] for j in jobs}):
            if existing is not None and t.run_dir == str(existing):
                continue  # the folder to resume, held: the job's own process reports it (REPORT_NAME)
            if _devices_clash(device, t.device):
                raise UserError(
                    f"A training job is already running on this device: {t.name} (pid {t.pid}"
                    f"{', started ' + time.strftime('%H:%M:%S', time.localtime(t.started)) if t.started else ''}, "
                    f"{TERMINAL_WHERE}).",
                    hint="Wait for it to finish, or stop it where it was started (Ctrl-C there saves a checkpoint; "
                         "it can be resumed).",
                )
        if existing is not None:
            target = existing
        elif exact_name:
            target = named_run_dir(runs, recipe_obj.name)
        else:
            target = new_run_dir(runs, recipe_obj.name)
        if not resuming and target.is_dir() and any(target.iterdir()):
            raise UserError(f"{target} is not empty and holds no run; a new run needs a new or empty folder.")
        target.mkdir(parents=True, exist_ok=True)
        if not resuming:
            from finetuner.run_marker import mark_run_folder

            mark_run_folder(target)  # finetuner made this folder for the run: `finetuner run` may write into it
            recipe_obj.model_copy(update={"output_dir": str(target)}).save(target / "recipe.yaml")
        log_path = target / LOG_NAME
        # the job runs in finetuner's own working folder (finetuner.workdir), never inside the run folder, which may
        # come from someone else and hold what libraries read from their working folder (./wandb/settings: issue 66);
        # neither is on its sys.path (finetuner.children)
        cmd = module_command("finetuner", "run", str(target / "recipe.yaml"), "-o", str(target), "--quiet",
                             *(["--trust-checkpoints"] if trust_checkpoints else []),
                             *(["--tracking-resume"] if tracking_resume else []))
        report = target / REPORT_NAME
        report.unlink(missing_ok=True)  # what an earlier attempt reported is not this one's
        # a job started within the web UI's scope reads its data files and pictures within it (finetuner.data.scope)
        env = safe_env(read_scope.child_env(dict(os.environ, PYTHONUNBUFFERED="1", **{protocol.REPORT_ENV: str(report)})))
        with open(log_path, "ab") as log:
            log.write(f"\n$ {' '.join(cmd)}  # {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
            log.flush()
            proc = spawn_job(cmd, str(work_dir()), env, log.fileno())
        _CHILDREN[proc.pid] = proc
        job = Job(proc.pid, str(target), target.name, device, time.time(), str(log_path), cmd,
                  proc_start=process_start_time(proc.pid))
        jobs.append(job.to_dict())
    return job


def stop_job(job_or_run: Job | str | Path, runs_dir: str | Path | None = None, wait: float = 0.0) -> bool:
    """Ask a job to stop (SIGINT: checkpoint, then exit 130). Returns False if it was not running.

    A run folder with no job (a ``finetuner run`` started in a terminal) is stopped the same way,
    through the process that holds its lock. With ``wait > 0``, waits up to that many seconds for
    the process to end.
    """
    if isinstance(job_or_run, Job):
        pid = job_or_run.pid
        if not _is_job_process(job_or_run.to_dict()):  # ended, and its pid perhaps given to another process
            return False
    else:
        job = job_for(job_or_run, runs_dir)
        pid = job.pid if job is not None else run_folder_holder(Path(job_or_run).resolve())
    if pid is None or not _alive(pid):
        return False
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait
    while wait > 0 and time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    return True


def wait_job(job: Job, timeout: float) -> bool:
    """Wait until the job's process ends; True if it did within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _is_job_process(job.to_dict()):
            return True
        time.sleep(0.1)
    return not _is_job_process(job.to_dict())


# --------------------------------------------------------------------------- status
@dataclass
class RunStatus:
    """A run as its ``events.jsonl`` tells it (plus whether its process is alive)."""

    run_dir: str
    name: str
    state: RunState  # see finetuner.runs.schema.RUN_STATES
    running: bool = False
    pid: int | None = None
    step: int = 0
    max_steps: int | None = None
    eta_s: float | None = None
    elapsed_s: float | None = None
    tokens_per_s: float | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    predicted_bytes: int | None = None
    measured_peak_bytes: int | None = None
    measured_what: str | None = None
    device: str | None = None
    method: str | None = None
    #: the objective trained (sft, dpo, orpo, simpo, kto): the start event's, sft for runs from before it was written
    objective: str | None = None
    #: the data file(s) its recipe trains on (``data.path`` of its recipe.yaml, as written there)
    data: list[str] = field(default_factory=list)
    #: a preference run's implicit rewards (docs/events.md): each field of its step events
    #: (reward_accuracy, reward_margin, reward_chosen, reward_rejected) and of its eval events
    #: (eval_reward_*) as (step, value) in step order; empty for SFT
    rewards: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: a GRPO run's rewards: the mean total reward of each step's completions (``reward``) and of the
    #: held-out evaluations (``eval_reward``), and each reward function's means by name, as (step, value)
    group_rewards: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: a GRPO run's latest sampled completions (its last step event's ``completions``) and their step
    completions: list[dict[str, Any]] | None = None
    completions_step: int | None = None
    error: str | None = None
    metrics: dict[str, Any] | None = None
    samples: list[dict[str, Any]] | None = None
    adapter_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    modified: float = 0.0
    #: running in a process no job started (a ``finetuner run`` in a terminal: :data:`TERMINAL_WHERE`), which a front
    #: end shows but does not stop
    terminal: bool = False
    #: the phase running between the steps (loading, tokenizing, replay answers, an evaluation, a checkpoint, the
    #: probe, the samples) as one line (:func:`finetuner.phases.line`); None when none is running
    phase: str | None = None

    @property
    def progress(self) -> float:
        return min(1.0, self.step / self.max_steps) if self.max_steps else 0.0

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else None

    @property
    def has_checkpoint(self) -> bool:
        ck = Path(self.run_dir) / "checkpoints"
        return ck.is_dir() and any(p.name.startswith("step-") for p in ck.iterdir())

    @property
    def has_adapter(self) -> bool:
        return (Path(self.run_dir) / "adapter").is_dir()

    @property
    def resumable(self) -> bool:
        return not self.running and self.state in RESUMABLE_STATES and self.has_checkpoint


def run_status(run_dir: str | Path, runs_dir: str | Path | None = None, job: Job | None = None) -> RunStatus:
    """Read a run folder's events into a :class:`RunStatus`.

    The state is :func:`finetuner.runs.schema.run_state`'s, with the run counted as running while
    its job's process is alive or any process (e.g. ``finetuner run`` in a terminal) holds the folder.
    """
    rd = Path(run_dir).resolve()
    events_path = rd / "events.jsonl"
    if job is None:
        job = job_for(rd, runs_dir or rd.parent)
    holder = None if job is not None else run_folder_holder(rd)
    running = job is not None or run_folder_busy(rd)
    st = RunStatus(str(rd), rd.name, "new", running=running, pid=job.pid if job else holder, terminal=running and job is None)
    try:
        st.modified = max(p.stat().st_mtime for p in (rd, events_path) if p.exists())
    except ValueError:
        pass
    losses: dict[int, float] = {}
    evals: dict[int, float] = {}
    rewards: dict[str, dict[int, float]] = {}
    group_rewards: dict[str, dict[int, float]] = {}
    tracker = RunStateTracker()
    for ev in read_events(events_path):
        tracker.feed(ev)
        kind = ev.get("event")
        if kind == "start":
            st.max_steps = ev.get("max_steps")
            st.device, st.method = ev.get("device"), ev.get("method")
            st.objective = ev.get("objective") or DEFAULT_OBJECTIVE
            st.step = ev.get("resumed_from_step") or 0
            st.error = None
            pred = ev.get("predicted") or {}
            st.predicted_bytes = pred.get("allocated_bytes") or pred.get("total_bytes")
            if ev.get("resumed_from_step"):
                st.notes.append(f"resumed from step {ev['resumed_from_step']}")
        elif kind == "step":
            st.step = ev.get("step", st.step)
            st.max_steps = ev.get("max_steps", st.max_steps)
            st.eta_s, st.elapsed_s = ev.get("eta_s"), ev.get("elapsed_s")
            st.tokens_per_s = ev.get("tokens_per_s")
            if ev.get("loss") is not None:
                losses[int(ev["step"])] = float(ev["loss"])
            _add_rewards(rewards, ev, "reward_")
            _add_group_rewards(group_rewards, ev, "")
            if ev.get("completions"):
                st.completions, st.completions_step = ev["completions"], int(ev["step"])
            peak = ev.get("mem_peak")
            if peak is not None:
                st.measured_peak_bytes = max(st.measured_peak_bytes or 0, int(peak))
        elif kind == "eval":
            if ev.get("eval_loss") is not None:
                evals[int(ev["step"])] = float(ev["eval_loss"])
            _add_rewards(rewards, ev, "eval_reward_")
            _add_group_rewards(group_rewards, ev, "eval_")
        elif kind == "replay" and ev.get("reason") not in ROUTINE_REASONS:  # answered again, or not cached: why
            st.notes.append(str(ev.get("message")))
        elif kind == "oom_backoff":
            st.notes.append(
                f"out of memory at step {ev.get('step')}: micro-batch {ev.get('old_micro_batch_size')} → {ev.get('micro_batch_size')}"
            )
        elif kind == "phase":
            st.phase = None if ev.get("state") == "end" else phases.line(ev)
        elif kind == "slow_steps":  # the steps are much slower than planned: the measured rate
            st.notes.append(str(ev.get("message")))
        elif kind == "done":
            st.step = ev.get("step", st.step)
            st.metrics = ev.get("metrics") or {}
            st.adapter_dir = ev.get("adapter_dir")
            if st.metrics.get("held_out_note"):  # which adapter the run kept (the UI's Train tab shows the notes)
                st.notes.append(st.metrics["held_out_note"])
            kept = kept_line(st.metrics.get("general_probe"))
            if kept:  # what the fine-tune forgot of what the base knew
                st.notes.append(kept)
            calls = calls_line(st.metrics.get("tool_calls"))
            if calls:  # what it learned of calling tools: the held-out calls, base and fine-tune
                st.notes.append(f"Held-out tool calls: {calls}")
            mem = st.metrics.get("memory") or {}
            st.measured_peak_bytes = mem.get("measured_peak_bytes", st.measured_peak_bytes)
            st.predicted_bytes = mem.get("predicted_peak_bytes", st.predicted_bytes)
            st.measured_what = mem.get("measured")
            st.eta_s = 0
        elif kind == "samples":
            st.samples = ev.get("samples")
        elif kind == "error":
            st.error = ev.get("message")
            st.phase = None
    st.losses, st.evals = sorted(losses.items()), sorted(evals.items())
    recipe = _recipe_fields(rd)
    path = recipe.get("data", {}).get("path") if isinstance(recipe.get("data"), dict) else None
    st.data = [str(p) for p in (path if isinstance(path, list) else [path] if path else [])]
    if st.objective is None and isinstance(recipe.get("objective"), str):  # not started yet: as the recipe asks
        st.objective = recipe["objective"]
    st.rewards = {k: sorted(v.items()) for k, v in rewards.items()}
    st.group_rewards = {k: sorted(v.items()) for k, v in group_rewards.items()}
    st.state = tracker.state(st.running)
    if st.state == "new" and job is None and (rd / LOG_NAME).is_file():  # a job ran here and ended without any event
        st.state = "error"
        st.error = _reported_error(rd)
    return st


def _recipe_fields(run_dir: Path) -> dict[str, Any]:
    """The run's recipe.yaml as written (not validated: a run's listing must not fail on an old or
    broken recipe); empty when it is missing or unreadable."""
    import yaml

    try:
        raw = yaml.safe_load((run_dir / "recipe.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _add_rewards(rewards: dict[str, dict[int, float]], ev: dict[str, Any], prefix: str) -> None:
    """The fields of ``ev`` named ``prefix...`` (a preference run's rewards) at its step; a value
    that is not a finite number (NaN is written as null, infinities as strings) is left out."""
    if ev.get("step") is None:
        return
    for key, value in ev.items():
        if key.startswith(prefix) and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            rewards.setdefault(key, {})[int(ev["step"])] = float(value)


def _add_group_rewards(out: dict[str, dict[int, float]], ev: dict[str, Any], prefix: str) -> None:
    """A GRPO event's rewards at its step (docs/events.md): ``{prefix}reward`` (the mean total) under
    ``{prefix}reward`` and each function's mean (``{prefix}rewards``) under ``{prefix}reward:NAME``;
    values that are not finite numbers are left out."""
    if ev.get("step") is None:
        return
    step = int(ev["step"])

    def put(key: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.setdefault(key, {})[step] = float(value)

    put(f"{prefix}reward", ev.get(f"{prefix}reward"))
    per_function = ev.get(f"{prefix}rewards")
    if isinstance(per_function, dict):
        for name, value in per_function.items():
            put(f"{prefix}reward:{name}", value.get("mean") if isinstance(value, dict) else value)


def _reported_error(run_dir: Path) -> str:
    """Why a job that wrote no event ended: the last error its process reported (:data:`REPORT_NAME`),
    else that it ended before it started (killed, or it died before it could report)."""
    errors = [m for m in protocol.read_report(run_dir / REPORT_NAME) if m["kind"] == "error"]
    if errors:
        return protocol.error_text(errors[-1])
    return f"the run ended before it started (its output is in {run_dir / LOG_NAME})"


def list_runs(runs_dir: str | Path | None = None) -> list[RunStatus]:
    """The run folders under ``runs_dir`` (those with events.jsonl or recipe.yaml), newest first."""
    runs = Path(runs_dir or default_runs_dir())
    if not runs.is_dir():
        return []
    jobs = {j.run_dir: j for j in running_jobs(runs)}
    out = []
    for d in runs.iterdir():
        if d.is_dir() and not d.name.startswith(".") and ((d / "events.jsonl").is_file() or (d / "recipe.yaml").is_file()):
            out.append(run_status(d, runs, job=jobs.get(str(d.resolve()))))
    return sorted(out, key=lambda s: s.modified, reverse=True)

"""How many threads torch's CPU operations use (``torch.set_num_threads``), chosen for the machine as it is now.

An operation large enough to spread over torch's intra-op threads ends when its last thread ends. On cores that
other processes keep busy each thread waits for a time slice of the scheduler, so every such operation waits
milliseconds instead of microseconds: on 2 cores at load 6-16 the demo's steps took 1.4 s with torch's default 2
threads and 0.34 s with one (docs/benchmarks.md measures it). So a phase that runs the model (a run's steps, chosen
before its plan; the answers its replay, probe, tool-call and samples phases generate, each chosen as it begins; a
model loaded for ``chat``, ``eval`` or a merge: :func:`finetuner.infer.loading.load_model`) takes as many threads
as there are cores no other process is using, at least one:

* ``cores``: the cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``);
* ``load``: the tasks other processes have running or waiting to run now, read from the kernel's run queue
  (``procs_running`` in ``/proc/stat``, less this process's own running threads, the mean of
  :data:`SAMPLES` readings :data:`SAMPLE_GAP_S` apart; the 1-minute load average lags a minute behind), else
  the 1-minute load average where there is no ``/proc``; ``$FINETUNER_LOAD`` (a number) sets it instead;
* ``threads = max(1, min(cores, cores - floor(load + 0.5)))``: a core counts as taken when other processes keep
  it busy half the time or more.

The user's number wins: ``training.threads`` (an integer; ``auto``, the default, chooses as above), else the
environment's ``OMP_NUM_THREADS``. The choice (:class:`Choice`) says its reason; the run's ``start`` event and
console line state it, and the speed model plans with it (a calibration is made and kept per thread count:
:func:`finetuner.planning.calibrate.device_key`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from finetuner.errors import UserError

#: Environment variable that sets the load other processes put on the cores (the tasks they keep running),
#: instead of measuring it: to reproduce a decision, or to plan for a load the machine will have.
LOAD_ENV = "FINETUNER_LOAD"
#: Readings of the run queue averaged, and the seconds between them.
SAMPLES = 5
SAMPLE_GAP_S = 0.02

AUTO = "auto"
#: The phases of a run that generate answers with the model: each chooses its threads as it begins (the load may
#: have changed since the steps began; :meth:`finetuner.training.trainer.Trainer.phase`).
GENERATING_PHASES = ("replay", "probe", "tool_calls", "samples")


@dataclass(frozen=True)
class Choice:
    """Threads chosen for a phase: how many, of how many cores, at what load, who chose (``auto``,
    ``training.threads`` or ``OMP_NUM_THREADS``) and why, in words."""

    threads: int
    cores: int
    load: float
    source: str
    reason: str
    #: what ``auto`` would take at this load (the same as ``threads`` when auto chose)
    auto_threads: int

    def line(self) -> str:
        """The console's words: ``threads: 1 of 2 cores (load 6.4: other processes keep the cores busy)``."""
        return threads_line(asdict(self))

    def to_dict(self) -> dict:
        """The ``threads`` object of the ``start`` event and of metrics.json."""
        return {**asdict(self), "load": round(self.load, 2)}


def threads_line(entry: dict) -> str:
    """:meth:`Choice.line` of a choice as the ``start`` event holds it (:meth:`Choice.to_dict`)."""
    n, cores = entry["threads"], entry["cores"]
    return f"threads: {n} of {cores} core{'s' if cores != 1 else ''} ({entry['reason']})"


def cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _procs_running() -> int | None:
    """The kernel's count of tasks running or ready to run now (``/proc/stat``), None without it."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _own_running() -> int:
    """This process's threads in state R (running or runnable) now: its own share of the run queue."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:].startswith("R"):  # the state follows the command's name in parentheses
            n += 1
    return max(n, 1)  # the thread reading is running


def measured_load() -> float:
    """The tasks other processes keep running or waiting to run on the cores now (see the module's docstring):
    ``$FINETUNER_LOAD``, else the run queue, else the 1-minute load average."""
    given = os.environ.get(LOAD_ENV)
    if given:
        try:
            value = float(given)
        except ValueError:
            value = -1.0
        if not value >= 0 or math.isinf(value):
            raise UserError(f"{LOAD_ENV}={given}: not a load (a number of tasks, 0 or more).",
                            hint=f"Unset {LOAD_ENV} to measure the machine's load, or set it to e.g. 2.")
        return value
    readings = []
    for i in range(SAMPLES):
        running = _procs_running()
        if running is None:
            return os.getloadavg()[0]
        readings.append(max(0, running - _own_running()))
        if i + 1 < SAMPLES:
            time.sleep(SAMPLE_GAP_S)
    return sum(readings) / len(readings)


def auto_threads(cores: int, load: float) -> int:
    """The threads ``auto`` takes on ``cores`` when other processes keep ``load`` tasks running."""
    return max(1, min(cores, cores - math.floor(load + 0.5)))


def _omp_threads(env: dict[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` as a number of threads (its first level when it lists several), None when unset."""
    raw = (env.get("OMP_NUM_THREADS") or "").strip()
    if not raw:
        return None
    try:
        n = int(raw.split(",")[0])
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"OMP_NUM_THREADS={raw}: not a number of threads.",
                        hint="Unset it (finetuner then chooses from the cores and the load), or set it to e.g. 1.")
    return n


def _load_words(cores: int, load: float) -> str:
    taken = math.floor(load + 0.5)
    if taken == 0:
        return f"load {load:.1f}: the cores are free" if load < 0.05 else f"load {load:.1f}: the cores are mostly free"
    if taken >= cores:
        return f"load {load:.1f}: other processes keep the cores busy"
    return f"load {load:.1f}: other processes keep {taken} of the {cores} cores busy"


def decide(requested: int | str | None, cores: int, load: float, env: dict[str, str] | None = None) -> Choice:
    """The threads for a phase: ``requested`` (``training.threads``: a number, or ``auto``/None), else
    ``OMP_NUM_THREADS`` in ``env`` (default: this process's environment), else :func:`auto_threads`."""
    env = os.environ if env is None else env
    auto = auto_threads(cores, load)
    if isinstance(requested, int) and not isinstance(requested, bool):
        if requested < 1:
            raise UserError(f"training.threads: {requested}: not a number of threads.", hint="Set it to auto or to 1 or more.")
        return Choice(requested, cores, load, "training.threads", _user_words("training.threads", requested, auto, load), auto)
    omp = _omp_threads(env)
    if omp is not None:
        return Choice(omp, cores, load, "OMP_NUM_THREADS", _user_words(f"OMP_NUM_THREADS={omp}", omp, auto, load), auto)
    return Choice(auto, cores, load, AUTO, _load_words(cores, load), auto)


def _user_words(who: str, threads: int, auto: int, load: float) -> str:
    if threads == auto:
        return f"{who}; load {load:.1f}"
    return f"{who}; at load {load:.1f} auto would take {auto}"


#: the last choice applied in this process (:func:`for_phase`), by phase
_chosen: dict[str, Choice] = {}


def for_phase(phase: str, requested: int | str | None = AUTO) -> Choice:
    """Measure the machine, choose the threads for ``phase`` (:func:`decide`) and set torch's to it."""
    choice = decide(requested, cores(), measured_load())
    apply(choice)
    _chosen[phase] = choice
    return choice


def apply(choice: Choice) -> None:
    """Set torch's intra-op threads to ``choice``'s; it is this process's choice from now (:func:`current`)."""
    import torch

    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    _chosen["last"] = choice


def slow_words(choice: Choice) -> str:
    """What a run whose steps are much slower than planned adds about its threads (on a CPU): the other processes'
    load now against the one its threads were chosen for, and, when more threads than ``auto`` would take now, the
    setting that takes fewer."""
    now = measured_load()
    auto = auto_threads(choice.cores, now)
    words = f" Other processes' load is {now:.1f} now; the run's threads ({choice.threads}) were chosen at load {choice.load:.1f} ({choice.source})."
    if choice.threads > auto:
        words += (f" At this load {auto} thread{'s' if auto != 1 else ''} would be faster: "
                  + ("the next run chooses again." if choice.source == AUTO else f"set training.threads: auto (or {auto})."))
    return words


def current() -> Choice | None:
    """The choice last applied in this process, None before any."""
    return _chosen.get("last")


def planned() -> Choice:
    """The choice a run here would take, without setting torch's (``finetuner plan`` imports no torch): the last one
    applied, else ``auto``'s now."""
    return current() or decide(AUTO, cores(), measured_load())


def ensure() -> Choice:
    """The choice this process runs with: the last one applied, else ``auto``'s now (``finetuner plan``,
    ``estimate`` and ``gpus`` plan and calibrate for the threads a run would take)."""
    return current() or for_phase("plan")

"""The run folder: where a run lives, and whether a new run may use it.

``runs/<name>/`` (or the recipe's ``output_dir``) holds ``recipe.yaml`` (resolved),
``events.jsonl``, ``checkpoints/``, ``adapter/``, ``metrics.json`` and ``tensorboard/``.
Nothing in it is ever deleted by starting a run: ``--no-resume`` moves an old run aside.

A folder is a run folder only when finetuner made it: it holds the marker :data:`RUN_MARKER`
(written when the folder is set up, by ``finetuner run`` or the UI's job start), or, for folders
made before the marker, both ``recipe.yaml`` and ``events.jsonl``. A non-empty folder that is not a
run folder is never written into; a finished run (``adapter/`` or ``metrics.json``) is never
replaced unless the user asks for it (``--no-resume``, which moves it aside after the recipe,
the model and the data have been checked).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetuner.checkpoint_layout import checkpoint_dirs, latest_checkpoint, load_trainer_state, remove_staging
from finetuner.errors import UserError
from finetuner.fileio import size_text
from finetuner.config.recipe import Recipe
from finetuner.config.recipe_yaml import load_yaml
from finetuner.run_marker import RUN_MARKER, is_run_folder, mark_run_folder
from finetuner.steps import total_steps
from finetuner.strategy_table import DEFAULT, find_row

#: Keys that must match for a checkpoint to be resumed with a recipe.
RESUME_KEYS = (
    "model.name",
    "model.revision",
    "method",
    "lora",
    "quantization",
    "data.path",
    "data.format",
    "data.columns",
    "data.max_seq_len",
    "data.packing",
    "data.train_on_prompt",
    "data.val_size",
    "training.seed",
    "training.optimizer",
)


def _get(d: dict[str, Any], dotted: str) -> Any:
    for k in dotted.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def recipe_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    diffs = [f"{k}: {_get(old, k)!r} → {_get(new, k)!r}" for k in RESUME_KEYS if _get(old, k) != _get(new, k)]
    eff_old = _get(old, "training.micro_batch_size") * _get(old, "training.gradient_accumulation")
    eff_new = _get(new, "training.micro_batch_size") * _get(new, "training.gradient_accumulation")
    if eff_old != eff_new:
        diffs.append(f"effective batch (micro_batch_size × gradient_accumulation): {eff_old} → {eff_new}")
    diffs += _sharding_differences(old, new)
    return diffs


def _sharding_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """A DeepSpeed ZeRO or FSDP checkpoint holds one shard per process: same strategy and process count to resume."""
    def where(d: dict[str, Any]) -> tuple[str, int]:
        dist = d.get("distributed") or {}
        return dist.get("strategy", DEFAULT), int(dist.get("num_processes", 1)) * int(dist.get("nodes", 1))

    (s_old, n_old), (s_new, n_new) = where(old), where(new)
    sharded = [row for s in (s_old, s_new) if (row := find_row(s)) is not None and row.sharded_checkpoints]
    if sharded and (s_old, n_old) != (s_new, n_new):
        kind = sharded[0].family
        return [f"distributed ({kind} checkpoints are sharded per process): {s_old} on {n_old} → {s_new} on {n_new}"]
    return []


def steps_asked(training: dict[str, Any], state: dict[str, Any], old_training: dict[str, Any]) -> int | None:
    """How many optimizer steps a recipe's ``training`` section asks of a run whose last checkpoint
    holds ``state`` (made with ``old_training``); None when that cannot be told without the data."""
    if training.get("max_steps"):
        return int(training["max_steps"])
    per_epoch = state.get("steps_per_epoch")
    if per_epoch is None and not old_training.get("max_steps") and state.get("max_steps"):
        per_epoch = state["max_steps"] / float(old_training.get("epochs") or 1.0)  # checkpoints from before 0.2
    if not per_epoch:
        return None
    return total_steps(float(training.get("epochs") or 1.0), per_epoch)


class RunFolderRefused(UserError):
    """The run folder may not be used by this run (a file, someone else's folder, a folder another
    process holds, a run this recipe cannot continue): nothing is written into it, not even the
    error (:func:`record_early_failure`); the run already in it stays as it was."""


class RunFinished(Exception):
    """The run folder already holds a finished run that the recipe would not extend: nothing to do."""

    def __init__(self, run_dir: Path, message: str):
        super().__init__(message)
        self.run_dir, self.message = run_dir, message


class RunAlreadyFinished(UserWarning):
    """Warned by :func:`finetuner.train` when it returns a finished run's result without training
    (:class:`RunFinished`): a script or a notebook says that nothing trained, and what would train
    (the message); the CLI silences it and prints the same message in its summary."""


def free_sibling(run_dir: Path) -> Path:
    """``run_dir`` itself if nothing is there, else the first free ``<name>-2``, ``<name>-3``... beside it:
    the folder to propose for a new run instead of one that holds a run."""
    run_dir = Path(run_dir)
    cand, i = run_dir, 1
    while cand.exists():
        i += 1
        cand = run_dir.with_name(f"{run_dir.name}-{i}")
    return cand


def shown(path: Path) -> str:
    """``path`` relative to the current folder when it is under it (as a user types it), else absolute."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def new_folder_hint(run_dir: Path) -> str:
    """How to start a new run without touching the finished one in ``run_dir``: a free folder beside it
    (as the CLI and the Python API take it)."""
    free = shown(free_sibling(run_dir))
    return f"--output {free} (Python: finetuner.train(..., output_dir={free!r}))"


def check_not_finished(run_dir: Path, recipe: Recipe, old: dict[str, Any], last: Path) -> None:
    """Before resuming ``run_dir`` (last checkpoint ``last``, saved recipe ``old``) with ``recipe``:
    raise :class:`RunFinished` when it already trained at least every step the recipe asks for and
    wrote its adapter (a rerun with the same or a smaller ``training.max_steps`` changes nothing and
    says where the model is), and a UserError when the recipe asks for fewer steps than were trained
    but the adapter is not written (an interrupted run)."""
    try:
        state = load_trainer_state(last)
    except (OSError, ValueError):
        return  # the trainer reports unreadable checkpoints and falls back to older ones
    done = int(state.get("step", 0))
    asked = steps_asked(recipe.to_dict()["training"], state, old.get("training") or {})
    if asked is None or asked > done:
        return
    how = (f"training.max_steps={asked}" if recipe.training.max_steps else f"training.epochs={recipe.training.epochs:g}")
    if (run_dir / "adapter").is_dir():  # finished: never trained again, never moved aside by a hint
        what = (f"it trained all {done} steps this recipe asks for ({how})" if asked == done else
                f"it already trained {done} steps, more than the {asked} that {how} asks for")
        raise RunFinished(run_dir, (
            f"{shown(run_dir)} is finished: {what}, and its model (the adapter) is in {shown(run_dir / 'adapter')}. "
            f"Nothing was trained or changed. To train it further, raise training.max_steps (or epochs) above {done}; "
            f"for a new run of {asked} steps, give it a folder of its own: {new_folder_hint(run_dir)}."))
    if asked < done:  # else the steps are done but the adapter is not written: resuming finishes it
        raise RunFolderRefused(
            f"{run_dir} already trained {done} steps; {how} asks for {asked}, so resuming it would train nothing "
            "(its recipe.yaml and checkpoints are left as they are).",
            hint=f"To train it further, ask for more than {done} steps (training.max_steps or training.epochs); to "
                 f"train a new run of {asked} steps, give it a folder of its own: {new_folder_hint(run_dir)}.",
        )


#: What a finished run leaves that a new run in its folder would replace.
RESULTS = ("adapter", "metrics.json")


def _some_entries(folder: Path, n: int = 4) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


class RunLock:
    """An exclusive lock on a run folder (``.lock``), held for the life of the process.

    ``flock`` locks vanish when their process dies, SIGKILL included, so there are no stale locks.
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunFolderRefused(
                f"Another finetuner process (pid {holder}) is using the run folder {self.path.parent}.",
                hint="Wait for it to finish or stop it, or pick another --output.",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _start_over_hint(run_dir: Path, results: list[str]) -> str:
    """What to do when a recipe cannot resume ``run_dir``: a folder of its own; ``--no-resume`` (which moves
    the old run aside) only for a run that is not finished (no ``results``): a finished one is never moved by a hint."""
    own = f"give the new run a folder of its own: {new_folder_hint(run_dir)}"
    if results:
        return f"{run_dir.name} is a finished run ({', '.join(results)}): {own}."
    return f"Use --no-resume to start over (the unfinished run is moved aside, not deleted), or {own}."


def prepare_run_dir(recipe: Recipe, resume: bool,
                    check_inputs: Callable[[Recipe], None] | None = None) -> tuple[Path, Recipe, list[str], RunLock]:
    """Lock, create or check the run folder; returns it, the recipe to run, notes, and the lock.

    Refused, with nothing written: a file; a non-empty folder finetuner did not make as a run folder
    (:func:`is_run_folder`); a run with checkpoints of a different recipe; a finished run whose
    checkpoints are gone (its results would be replaced). With ``resume=False`` an existing run is
    moved aside, but only after ``check_inputs(recipe)`` (the model and the data, read and checked)
    has passed: a bad data file or model leaves the run where it was.
    """
    run_dir = recipe.output_path()
    notes: list[str] = []
    lock = None
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderRefused(f"Output path {run_dir} is a file, not a folder.", hint="Choose another --output.")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        saved = run_dir / "recipe.yaml"
        if not is_run_folder(run_dir):
            raise RunFolderRefused(
                f"Output folder {run_dir} is not empty and holds no finetuner run (it holds {_some_entries(run_dir)}); "
                "finetuner will not write into it.",
                hint="Choose another --output (or output_dir), or empty that folder yourself.",
            )
        lock = RunLock(run_dir).acquire()
        try:
            if not resume:
                if check_inputs is not None:
                    try:
                        check_inputs(recipe)  # before anything moves: a bad model or data file leaves the run where it is
                    except UserError as e:  # ... and its events as they are: the failure is the new run's, which has no folder yet
                        raise RunFolderRefused(e.message, hint=e.hint) from None
                aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
                run_dir.rename(aside)
                lock.release()
                lock = None
                notes.append(f"--no-resume: the previous run in {run_dir} was moved to {aside}.")
            else:
                # a checkpoint cut short (a full disk, a kill) is given back before anything counts the free space
                for name, size in remove_staging(run_dir):
                    notes.append(f"Removed {name} ({size_text(size)}), a checkpoint that was never completed.")
                last = latest_checkpoint(run_dir)
                results = [name for name in RESULTS if (run_dir / name).exists()]
                if last is None and results:
                    raise RunFolderRefused(
                        f"{run_dir} holds a finished run ({', '.join(results)}) and no checkpoint to resume; finetuner "
                        "will not start a new run over it.",
                        hint=f"Give the new run a folder of its own: {new_folder_hint(run_dir)}.",
                    )
                if last is not None:
                    old = load_yaml(saved.read_text(encoding="utf-8"), str(saved)) if saved.is_file() else None
                    if not isinstance(old, dict) or not isinstance(old.get("training"), dict):
                        raise RunFolderRefused(f"{run_dir} has checkpoints but no readable recipe.yaml to resume them with.",
                                               hint=_start_over_hint(run_dir, results))
                    diffs = recipe_differences(old, recipe.to_dict())
                    if diffs:
                        raise RunFolderRefused(
                            f"{run_dir} holds a run with checkpoints made by a different recipe:\n  "
                            + "\n  ".join(diffs),
                            hint=_start_over_hint(run_dir, results),
                        )
                    check_not_finished(run_dir, recipe, old, last)
                    # the saved recipe holds the micro-batch actually in use (after any out-of-memory back-off)
                    saved_t = old.get("training", {})
                    t = recipe.training.model_copy(
                        update={k: saved_t[k] for k in ("micro_batch_size", "gradient_accumulation") if k in saved_t}
                    )
                    recipe = recipe.model_copy(update={"training": t})
                    notes.append(f"Resuming {run_dir} from {last.name}.")
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = lock or RunLock(run_dir).acquire()
    mark_run_folder(run_dir)
    recipe = recipe.model_copy(update={"output_dir": str(run_dir)})
    recipe.save(run_dir / "recipe.yaml")
    return run_dir, recipe, notes, lock


def events_size(run_dir: Path) -> int:
    """The size of the run folder's ``events.jsonl`` now (0 when there is none): what
    :func:`record_early_failure` compares with to tell whether the run wrote events of its own."""
    try:
        return (Path(run_dir) / "events.jsonl").stat().st_size
    except OSError:
        return 0


def record_early_failure(run_dir: Path, error: BaseException, events_before: int) -> bool:
    """Write the ``error`` event of a run that failed before it wrote any event of its own (a recipe value
    the planner refuses, a model folder without config.json, a launcher that cannot start its processes),
    so that whoever follows the run (the web UI's job runner, :func:`finetuner.follow`) reads why.

    Written only where it belongs: into a run folder finetuner made (:func:`is_run_folder`) that holds
    no finished run's results (a later attempt that never started does not mark a finished run failed),
    that no other process holds, and whose ``events.jsonl`` is still ``events_before`` bytes long (else the
    run wrote its events, its error among them). Never for :class:`RunFolderRefused`: the folder is not
    this run's to write into; a job's runner learns that error from its report
    (:data:`finetuner.worker_protocol.REPORT_ENV`). A folder that does not exist is not made for it.
    Returns whether the event was written."""
    from finetuner.runs.events import EventWriter

    run_dir = Path(run_dir)
    if isinstance(error, RunFolderRefused) or not run_dir.is_dir() or not is_run_folder(run_dir):
        return False
    if any((run_dir / name).exists() for name in RESULTS) or events_size(run_dir) != events_before:
        return False
    try:
        lock = RunLock(run_dir).acquire()
    except (UserError, OSError):  # another process holds it: its events are its own
        return False
    try:
        writer = EventWriter(run_dir / "events.jsonl")
        try:
            writer.error(error)
        finally:
            writer.close()
    except OSError:  # a full disk, often why the run failed: the error being raised is what the user sees
        return False
    finally:
        lock.release()
    return True


def checkpoint_bytes(model, optimizer: str) -> int:
    """Predicted size of one checkpoint: the trainable weights as saved, plus the optimizer state
    (the memory model's :func:`~finetuner.memory.storage.optimizer_state_bytes`, the same count it predicts on the GPU)."""
    from finetuner.memory.model import optimizer_state_bytes

    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in trainable)
    tensors = [(p.shape[0], p.numel() // max(1, p.shape[0]) if p.dim() > 1 else 1, 1) for p in trainable]
    return int(weights + optimizer_state_bytes(tensors, optimizer)) + 1_000_000


def disk_space_needed(run_dir: Path, model, optimizer: str, keep_last: int) -> tuple[int, int, int]:
    """``(one, to_write, need)``: one checkpoint's predicted size, how many more checkpoints the run
    folder will keep than it holds now, and the free space the run needs from here on: those, one
    more being written, and the final adapter. A resumed run's kept checkpoints are on disk already;
    one written after them replaces the oldest once it is complete."""
    one = checkpoint_bytes(model, optimizer)
    to_write = max(0, keep_last - len(checkpoint_dirs(run_dir)))
    return one, to_write, one * (to_write + 2)


def check_disk_space(run_dir: Path, model, optimizer: str, keep_last: int) -> None:
    """Fail before training, not mid-run, when the disk cannot hold the checkpoints and the adapter."""
    import shutil

    one, to_write, need = disk_space_needed(run_dir, model, optimizer, keep_last)
    free = shutil.disk_usage(run_dir).free
    if free < need:
        more = f"{to_write} checkpoint{'s' if to_write != 1 else ''} of {size_text(one)} each plus one being written" if to_write \
            else f"one checkpoint of {size_text(one)} being written (the {keep_last} kept are on disk already)"
        raise UserError(
            f"Not enough free disk space in {run_dir}: {size_text(free)} free, but {more} and the final adapter "
            f"need {size_text(need)}.",
            hint="Free some space, choose another --output, or lower checkpointing.keep_last.",
        )


#: what a run writes into its folder before its first step: nothing a user needs once the run failed there
SETUP_FILES = frozenset({".lock", RUN_MARKER, "recipe.yaml", "events.jsonl", "plan.json", "tensorboard",
                         "tracking.json", "wandb"})


def is_new_run_dir(run_dir: Path) -> bool:
    """True when ``run_dir`` does not exist or is an empty folder (a run there starts from nothing)."""
    run_dir = Path(run_dir)
    return not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir()))


def remove_failed_setup(run_dir: Path, existed: bool) -> bool:
    """After a run failed before its first step (a bad data row, a broken model folder, too little
    disk, Ctrl-C while tokenizing) in a folder that was new for it (:func:`is_new_run_dir`): remove
    what it wrote there, so no folder holding only an error is left behind; the folder itself too
    unless it ``existed`` (empty) before. Anything else in it (a checkpoint, a file of the user's)
    and the folder is left as it is. Returns whether it removed anything."""
    import shutil

    run_dir = Path(run_dir)
    try:
        entries = list(run_dir.iterdir())
    except OSError:
        return False
    if any(p.name not in SETUP_FILES or p.is_symlink() for p in entries):
        return False
    for p in entries:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if not existed:
        try:
            run_dir.rmdir()
        except OSError:
            pass
    return True

"""The entry point of a fine-tune: :func:`train`, where the Python API (``finetuner.train``) and the CLI come.

It resolves the recipe (its data ``auto`` values, the planner's choices for this device), refuses what cannot
finish, prepares the run folder, and runs a :class:`~finetuner.training.trainer.Trainer` in it (or hands a
multi-process run to :mod:`finetuner.training.launch`); a failure before the first event is still recorded in
the run's ``events.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from pathlib import Path

from finetuner.config.recipe import Recipe
from finetuner.data.follow import load_recipe
from finetuner.fileio import atomic_write_json
from finetuner.runs.events import Callback
from finetuner.runs.folder import (
    RunAlreadyFinished,
    RunFinished,
    events_size,
    is_new_run_dir,
    prepare_run_dir,
    record_early_failure,
    remove_failed_setup,
)
from finetuner.training.inputs import check_inputs
from finetuner.training.result import TrainResult
from finetuner.training.samples import answer_samples
from finetuner.training.trainer import Trainer

log = logging.getLogger(__name__)


def record_error(trainer: Trainer, error: BaseException) -> None:
    """The ``error`` event of a failed run; when it cannot be written (the disk is full: often why the
    run failed) the error being raised is what the user sees, not a second traceback chained to it."""
    try:
        trainer.events.error(error)
    except OSError as e:
        log.warning("Could not record the error in %s (%s).", trainer.events.path, e)


def finished_result(done: RunFinished) -> TrainResult:
    """What :func:`train` returns for a run folder that already holds the finished run."""
    metrics_file = done.run_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text(encoding="utf-8")) if metrics_file.is_file() else {}
    return TrainResult(done.run_dir, done.run_dir / "adapter", metrics, finished=done.message)


def train(
    recipe: Recipe | str | Path,
    callbacks: list[Callback] | None = None,
    output_dir: str | Path | None = None,
    resume: bool = True,
    stop_event: threading.Event | None = None,
    overrides: list[str] | None = None,
    profile_memory: bool = False,
    trust_checkpoints: bool = False,
    tracking_resume: bool = False,
) -> TrainResult:
    """Run a fine-tune. The Python API and the CLI both come here.

    Args:
        recipe: a :class:`Recipe` or the path of a recipe YAML.
        callbacks: functions called with every event dict as it is written.
        output_dir: the run folder (default: the recipe's ``output_dir`` or ``runs/<name>``).
        resume: continue from the last checkpoint in the run folder if there is one; with
            ``False`` an existing run folder is moved aside (never deleted) and a new run starts.
        stop_event: set it to stop after the current step (a checkpoint is saved).
        overrides: ``key.path=value`` strings applied when ``recipe`` is a path.
        profile_memory: record CUDA allocations for the first steps and write
            ``memory_snapshot.pickle`` to the run folder (view it at https://pytorch.org/memory_viz).
        trust_checkpoints: resume a multi-process run from sharded (FSDP, ZeRO) checkpoints that
            finetuner did not seal for this user (a run folder from elsewhere): loading them unpickles,
            which can run code (:mod:`finetuner.training.seal`).
        tracking_resume: report to the tracking runs the run folder's ``tracking.json`` names even when
            finetuner did not start them for this user (a run folder from elsewhere); without it such a run
            reports to new tracking runs (:mod:`finetuner.tracking.owned`).
    """
    entered = time.perf_counter()  # the run's wall clock (finetuner.training.prediction.measured_wait)
    # Less fragmentation on long runs near the memory limit (unless the user chose otherwise).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    recipe = load_recipe(recipe, overrides)
    if output_dir is not None:
        recipe = recipe.model_copy(update={"output_dir": str(Path(output_dir).expanduser().resolve())})
    from finetuner.training.launch import launch_training, needs_launch

    # A failure before the run writes its first event (the planner, the run folder, the launcher, the
    # trainer's construction) is still recorded in the run's events.jsonl, where it may be written.
    run_folder, events_before = recipe.output_path(), events_size(recipe.output_path())
    writes_events = not needs_launch(recipe) or recipe.distributed.node_rank == 0  # node 0 writes a shared run's events
    try:
        if needs_launch(recipe):  # distributed.*: the same training on several processes (torchrun)
            return launch_training(recipe, callbacks, resume, stop_event, profile_memory, trust_checkpoints, tracking_resume)
        from finetuner.planning.bounds import check_before_run
        from finetuner.planning.resolve import resolve_for_run

        from finetuner.planning.data_auto import resolve_data
        from finetuner.threads import for_phase

        # the threads for the steps, before the plan (its calibration is the one made with them)
        threads = for_phase("train", recipe.training.threads)
        recipe, resolved = resolve_data(recipe)  # data ``auto`` values → the plan's rules, on the recipe's own data
        recipe, plan = resolve_for_run(recipe, resume)  # ``auto`` values → the planner, for this device
        check_before_run(recipe)  # a micro-batch, a step or a run it cannot finish: refused before anything is made
        new_folder, existed = is_new_run_dir(recipe.output_path()), recipe.output_path().exists()
        run_dir, recipe, notes, lock = prepare_run_dir(recipe, resume, check_inputs)
        try:
            if plan is not None:
                atomic_write_json(run_dir / "plan.json", plan.to_dict())
            trainer = Trainer(recipe, run_dir, callbacks, stop_event, profile_memory=profile_memory)
            trainer.entered_at = entered
            trainer.tracking_resume = tracking_resume or None  # None: finetuner.tracking.owned.RESUME_ENV decides
            trainer.resolved = resolved
            trainer.threads = threads
        except BaseException:
            lock.release()
            if new_folder:
                remove_failed_setup(run_dir, existed)
            raise
    except RunFinished as done:
        warnings.warn(done.message, RunAlreadyFinished, stacklevel=2)  # the API's caller reads that nothing trained
        return finished_result(done)
    except BaseException as e:
        if writes_events:
            record_early_failure(run_folder, e, events_before)
        raise
    in_setup = True  # until the first step: a failure there leaves no folder behind (remove_failed_setup)
    for note in notes:
        log.warning(note)
    if plan is not None:
        trainer.events.emit("plan", gpu=plan.gpu.name, choice=plan.recipe_choice(), reasons=plan.reasons,
                            predicted_total_bytes=plan.estimate.total_bytes, device_bytes=plan.gpu.memory_bytes)
    try:
        trainer.setup()
        in_setup = False
        result = trainer.train()
        if recipe.samples.prompts and not result.stopped:
            answer_samples(trainer, result)
        return result
    except BaseException as e:  # a UserError, a Ctrl-C ("interrupted") or a bug: recorded, then raised
        if isinstance(e, Exception | KeyboardInterrupt):
            record_error(trainer, e)
        raise
    finally:
        trainer.cleanup()
        lock.release()
        if in_setup and new_folder:
            remove_failed_setup(run_dir, existed)

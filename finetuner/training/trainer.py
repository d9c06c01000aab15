"""The training recipe, readable top to bottom: setup → train → save → cleanup.

One optimizer step consumes a fixed list of example indices (``micro_batch_size ×
gradient_accumulation`` of a seeded per-epoch permutation), split into micro-batches. The loss
is the sum of token losses over the whole step divided by the number of trained tokens in the
step, so it does not depend on how the step is split into micro-batches: a run that halves its
micro-batch and doubles its accumulation follows the same loss curve.

The same :class:`Trainer` runs one process and every rank of a multi-process run: the step,
the optimizer step (clipping, fp16 loss scaling, the schedule), checkpoints, resume and the end
of the run are written once, here; :class:`finetuner.training.distributed.DistributedTrainer`
overrides only the hooks where several processes differ (wrapping the model, gradient
synchronisation, summing over ranks, rank-0-only writes), asking its strategy object
(:mod:`finetuner.training.strategies`: ddp, zero, fsdp) where strategies differ.

The trainer is the loop; its services have modules of their own: the optimizer (:mod:`.optimizer`), each step's
examples (:mod:`.schedule`), the out-of-memory back-off (:mod:`.backoff`), the guards before a save (:mod:`.guards`),
the best evaluation (:mod:`.best`), the model's answers (:mod:`.samples`: replay, the general probe, the samples),
the run's prediction and its measured wait (:mod:`.prediction`), the final folder (:mod:`.final`), ``--profile-memory`` (:mod:`.memory_profile`); a run enters at
:func:`finetuner.training.run.train`.

The trainer knows nothing of any UI: it writes events (:mod:`finetuner.runs.events`) and checks a
stop flag between steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
from pathlib import Path
from typing import Any

import finetuner.device as dev
from finetuner.training import checkpoint as ckpt_io
from finetuner.data import cache as data_cache
from finetuner.data.pipeline import PreparedData
from finetuner.data.thinking import prompt_switches, resolved as thinking_resolved
from finetuner.errors import UserError
from finetuner.runs.events import Callback, EventWriter, device_memory
from finetuner.training.faults import FaultPlan
from finetuner.training.final import save_final
from finetuner.rewards.limits import RewardStopped
from finetuner.training import optimizer as optim
from finetuner.training.backoff import back_off, train_step_with_backoff
from finetuner.training.best import BestEvaluation, keeps_best, shipped
from finetuner.training.guards import check_finite_weights, disk_full_guard, divergence_hint
from finetuner.training.memory_profile import dump_memory_profile, start_memory_profile
from finetuner.training.oom import StepOutOfMemory, describe, is_out_of_memory
from finetuner.training.optimizer import build_optimizer, build_scheduler
from finetuner.training.prediction import measured_wait, memory_comparison, predict_run, predicted_speed_of, predicted_wait
from finetuner.training.samples import general_probe, held_out_tool_calls, mix_replay_rows
from finetuner.training.schedule import StepSchedule, split_step
from finetuner.fileio import atomic_write_json
from finetuner.model.gguf_base import info_for
from finetuner.data.images import PictureCollator
from finetuner.model.loading import check_vision_training, count_parameters, load_base_model, prepare_for_training
from finetuner.data.run_inputs import text_inputs
from finetuner.model.vision import refuse_pictures_only
from finetuner.model.offload import save_on_cpu
from finetuner.objectives import build_objective
from finetuner.config.recipe import Recipe
from finetuner.config.runtime import Runtime, resolve_runtime
from finetuner.memory.model import with_run_loss_chunk
from finetuner.training.result import TrainResult
from finetuner.training.step_rate import StepRate
from finetuner.steps import optimizer_steps
from finetuner.runs.folder import check_disk_space
from finetuner.phases import Phase
import finetuner.threads as threads
from finetuner.units import gib_text

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the recipe
class Trainer:
    """A fine-tune from a resolved recipe to an adapter in the run folder."""

    #: steps recorded by ``--profile-memory`` before the snapshot is written
    PROFILE_STEPS = 3
    #: continue tracking runs this user's finetuner did not start (``--tracking-resume``; None: finetuner.tracking.owned.RESUME_ENV)
    tracking_resume: bool | None = None

    def __init__(
        self,
        recipe: Recipe,
        run_dir: Path,
        callbacks: list[Callback] | None = None,
        stop_event: threading.Event | None = None,
        profile_memory: bool = False,
    ):
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.events = EventWriter(self.run_dir / "events.jsonl", callbacks)
        self.stop_event = stop_event or threading.Event()
        self.tb = None
        self.reporters = None  # the other trackers (finetuner.tracking), set up with TensorBoard
        self.faults = FaultPlan()
        if self.faults.wants_kill_in("events"):  # KILL@events:STEP: halfway through that step's line
            self.events.midway = lambda record: record["event"] == "step" and self.faults.in_write("events", record["step"], self.rank)
        #: the micro-batch sizes that ran out of memory (:func:`~finetuner.training.backoff.back_off`)
        self.tried_micro: list[int] = []
        self.profile_memory = profile_memory
        #: this process's place in the run: one process is rank 0 of 1
        self.rank, self.world_size = 0, 1
        #: where the run's wall clock starts (:func:`train` sets its own entry), when the first step began, and
        #: the seconds spent in evaluations and in writing checkpoints and the adapter, in ``data.replay``'s answers
        #: before the first step and in the general probe after the adapter is saved (:func:`finetuner.training.prediction.measured_wait`)
        self.entered_at, self.first_step_at = time.perf_counter(), None
        self.eval_seconds, self.save_seconds, self.replay_seconds, self.probe_seconds = 0.0, 0.0, 0.0, 0.0
        self.tool_call_seconds = 0.0  # the held-out tool calls asked at the end (samples.held_out_tool_calls)
        #: what the recipe's data ``auto`` values became and why (finetuner.planning.data_auto; :func:`train` sets
        #: it), said in the ``start`` event
        self.resolved: dict[str, dict[str, Any]] = {}
        #: torch's threads for the steps (:func:`train` chooses them before its plan) and each generating phase's
        self.threads: threads.Choice | None = None
        self.phase_threads: dict[str, dict[str, Any]] = {}
        from finetuner.planning.wait import first_load

        #: whether loading the model will download it or convert its GGUF file (its predicted load time): known
        #: only before the load, which fills those caches, and predicted after it
        self.loaded_as = first_load(recipe.model.name)

    # ---------------------------------------------------------------- setup
    def base_placement(self) -> str | None:
        """Where this process loads the base model (:func:`~finetuner.model.loading.load_base_model`'s
        ``place``): None, on its device."""
        return None

    def setup(self) -> None:
        import torch

        r = self.recipe
        self.threads = self.threads or threads.for_phase("train", r.training.threads)
        self.rt: Runtime = resolve_runtime(r)
        torch.manual_seed(r.training.seed)
        random.seed(r.training.seed)
        # the tokenizer, and an image-text-to-text model's processor when the data has pictures
        self.tokenizer, self.processor = text_inputs(r)
        self.objective = build_objective(r, self.run_dir)  # what is trained: finetuner.objectives
        r = self.recipe = self.objective.adopt(r)
        with self.phase("tokenize", unit="rows"):  # the rows counted as datasets.map reaches them (data.pipeline)
            self.data: PreparedData = self.objective.prepare_data(self.tokenizer, self.processor)
        if self.data.stats.cache == "hit":  # the entry may name other copies of these files: record the user's
            data_cache.relocate(self.data.stats, r.data)
        pictures = self.processor is not None and bool(self.data.stats.pictures)
        check_vision_training(r, pictures)  # before the model loads
        if not pictures:
            refuse_pictures_only(r)
        with self.phase("load", predicted_s=self._before_load()):
            self.model = prepare_for_training(load_base_model(r, self.rt, self.base_placement(), pictures), r,
                                              self.rt.tiled_mlp, pictures)
        self.objective.model_loaded(self.model)
        began = time.perf_counter()
        self.replay = mix_replay_rows(self)
        self.replay_seconds = time.perf_counter() - began
        threads.apply(self.threads)  # the steps' threads again for the prediction and the steps (the replay chose its own)
        self.fused_ce = None
        if self.rt.kernels == "liger":
            from finetuner.model.kernels import fused_linear_cross_entropy

            self.fused_ce = fused_linear_cross_entropy()
        if self.rt.compile:
            from finetuner.model.kernels import compile_layers

            compile_layers(self.model)
        self.collate = self.objective.collator(self.tokenizer.pad_token_id)
        if pictures:
            self.collate = PictureCollator(self.collate, self.processor)
        # loss_chunk_size: auto, the number the memory model predicts with (the run's recipe records it)
        r = self.recipe = with_run_loss_chunk(r, self.model)
        t = r.training
        self.schedule = StepSchedule(len(self.data.train), t.effective_batch_size, t.seed)
        self.max_steps = t.max_steps or (
            optimizer_steps(None, t.epochs, len(self.data.train), t.effective_batch_size) * self.objective.steps_per_batch)
        self.optimizer = build_optimizer(self.model, t, self.rt.is_cuda)
        self.scheduler = build_scheduler(self.optimizer, t, self.max_steps)
        self.scaler = dev.grad_scaler(self.rt.device, self.rt.precision)
        self.step_loss = self.objective.step_loss_module(self.model, t.loss_chunk_size, self.fused_ce)
        self.objective.prepare(self)  # e.g. the step-0 model's reference scores, before any checkpoint is applied
        self.step, self.tokens_seen, self.elapsed_before, self.losses = 0, 0, 0.0, []
        self.resumed_from = None
        self._distribute()
        self._resume()
        check_disk_space(self.run_dir, self.model, t.optimizer, r.checkpointing.keep_last)
        trackers = r.logging.trackers
        if "tensorboard" in trackers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if any(t != "tensorboard" for t in trackers):  # MLflow, W&B, Trackio: readers of the events from "start" on
            from finetuner.tracking.report import Reporters
            from finetuner.training.seal import private_key  # marks the tracking runs it starts as this user's

            self.reporters = Reporters(trackers, self.run_dir, self.run_dir.name, self.tracking_resume, private_key)
            self.events.callbacks.append(self.reporters)
        trainable, total = count_parameters(self.model)
        from finetuner.planning.recipe_data import label_fraction_of

        label_fraction = label_fraction_of(r)  # as the plan and `finetuner estimate` measure it
        predicted = predict_run(r, self.rt, self.max_steps, label_fraction, self.loaded_as,
                                bool(self.replay and self.replay["from_cache"]))
        self.prediction = predicted.memory if predicted is not None else None
        self.predicted_peak = self.prediction.allocated_bytes if self.prediction else None
        self.predicted_speed = predicted_speed_of(predicted)
        gguf = info_for(r.model.name)
        self.events.emit(
            "start",
            run_dir=str(self.run_dir),
            name=r.name,
            resumed_from_step=self.resumed_from,
            max_steps=self.max_steps,
            steps_per_epoch=self.schedule.steps_per_epoch,
            device=self.rt.device,
            base_dtype=self.rt.base_dtype,
            precision=self.rt.precision,
            attention=getattr(self.model.config, "_attn_implementation", self.rt.attention),
            kernels=self.rt.kernels,
            loss_path=self.rt.loss_path,
            loss_chunk_size=t.loss_chunk_size,
            compile=self.rt.compile,
            tiled_mlp=self.rt.tiled_mlp,
            method=r.method,
            objective=r.objective,
            trainable_params=trainable,
            total_params=total,
            micro_batch_size=t.micro_batch_size,
            gradient_accumulation=t.gradient_accumulation,
            data=self.data.stats.to_dict(),
            predicted=self.prediction.to_dict() if self.prediction else None,
            predicted_speed=self.predicted_speed,
            gguf=gguf.to_event() if gguf is not None else None,
            resolved={**self.resolved, **thinking_resolved(self.data.stats.thinking)},
            threads=self.threads.to_dict(),
            **device_memory(self.rt.device),
        )

    # ---------------------------------------------------------------- phases
    def phase(self, name: str, total: int | None = None, unit: str = "", predicted_s: float | None = None) -> Phase:
        """A phase of this run that is not a step (:mod:`finetuner.phases`), said in ``phase`` events. One that
        generates answers chooses its threads for the load of the moment (:data:`finetuner.threads.GENERATING_PHASES`)."""
        if name in threads.GENERATING_PHASES:
            self.phase_threads[name] = threads.for_phase(name, self.recipe.training.threads).to_dict()
        return Phase(name, self._say_phase, total=total, unit=unit, predicted_s=predicted_s)

    def _say_phase(self, rec: dict[str, Any]) -> None:
        self.events.emit("phase", phase=rec["phase"], label=rec["label"], state=rec["state"], done=rec["done"],
                         total=rec["total"], unit=rec["unit"], tokens=rec["tokens"], elapsed_s=rec["elapsed_s"],
                         eta_s=rec["eta_s"], eta_from=rec["eta_from"], planned_s=rec["planned_s"])

    def _before_load(self) -> float | None:
        """The load's predicted seconds (the download's too), from the prediction made before it (the run's own is
        made after the replay rows are mixed in, which need the model); None when the models cannot say."""
        from finetuner.planning.recipe_data import label_fraction_of

        r = self.recipe
        rows = len(self.data.train)
        steps = r.training.max_steps or optimizer_steps(None, r.training.epochs, rows, r.training.effective_batch_size)
        predicted = predict_run(r, self.rt, steps, label_fraction_of(r), self.loaded_as)
        self.early_speed = predicted_speed_of(predicted)  # also the replay's, made before the run's own prediction
        parts = predicted_wait(self.early_speed or {}) or {}
        return parts["load"] + parts.get("download", 0.0) if "load" in parts else None

    def predicted_part(self, part: str, count: str | None = None) -> float | None:
        """One of a part of the run's predicted wait (:mod:`finetuner.planning.wait`): the part's seconds over its
        ``count`` (e.g. one evaluation's); None without a prediction."""
        wait = (getattr(self, "predicted_speed", None) or getattr(self, "early_speed", None) or {}).get("wait") or {}
        secs = (wait.get("parts_s") or {}).get(part)
        n = (wait.get("counts") or {}).get(count, 1) if count else 1
        return None if secs is None or not n else secs / n

    # ---------------------------------------------------------------- hooks for several processes
    # One process: these do nothing (or the plain thing); DistributedTrainer overrides them.
    def _distribute(self) -> None:
        """Wrap ``self.step_loss`` for several processes (before resuming); one process: nothing."""

    def _gradient_sync(self, last: bool):
        """The context of one backward pass; ``last``: the step's last pass on this rank."""
        return contextlib.nullcontext()

    def _backward(self, loss) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _stop_asked_here(self) -> bool:  # a stop asked for, as this process sees it (no collective call)
        return self.stop_event.is_set()

    def _agreed(self, flag: bool) -> bool:  # ``flag`` as the run's processes agree on it: here, itself
        return flag

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        """The step's sums (its loss sum, its token count, the objective's own sums) over
        all ranks, in one all-reduce; one process: as they are."""
        return values

    def _out_of_memory_anywhere(self, failure: str | None) -> str | None:
        """After each micro-batch: what ran out of memory on any rank (one process: here), or None."""
        return failure

    def _sync_gradients(self) -> None:
        """After a step's passes all fit: make the ranks' gradients the same; one process: nothing."""

    def evaluation(self):
        """The context of evaluation's forward passes (which call the model's parts, not the step's
        loss module); one process: nothing."""
        return contextlib.nullcontext()

    def _write_json(self, name: str, data: Any) -> None:
        """Write a JSON file into the run folder (in a multi-process run, rank 0 only)."""
        atomic_write_json(self.run_dir / name, data)

    def _read_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        """Every part of ``ckpt`` this trainer resumes from (raises ``CheckpointUnreadable``)."""
        return ckpt_io.read_checkpoint(ckpt)

    def _apply_checkpoint(self, ckpt: Path, parts: dict[str, Any]) -> dict[str, Any]:
        return ckpt_io.apply_checkpoint(parts, self.model, self.optimizer, self.scheduler, self.scaler, self.recipe.method == "full")

    def _resume(self) -> None:
        """Continue from the newest readable checkpoint; unreadable ones are reported and skipped."""
        for ckpt in reversed(ckpt_io.checkpoint_dirs(self.run_dir)):
            try:
                parts = self._read_checkpoint(ckpt)
            except ckpt_io.CheckpointUnreadable as e:
                log.warning("Checkpoint %s cannot be read (%s); trying the one before it.", ckpt, e)
                self.events.emit("checkpoint_invalid", path=str(ckpt), reason=str(e))
                continue
            state = self._apply_checkpoint(ckpt, parts)
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            self.elapsed_before, self.losses = state["elapsed_s"], state["losses"]
            self.objective.load_state(state.get("objective") or {})
            self.resumed_from = self.step
            return

    # ---------------------------------------------------------------- one step
    def autocast(self):
        """The autocast context of a forward pass in the run's precision (fp32: none)."""
        return dev.autocast(self.rt.device, None if self.rt.precision == "fp32" else self.rt.torch_dtype(self.rt.precision))

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A collated batch with its tensors on the run's device."""
        return {k: (v.to(self.rt.device) if hasattr(v, "to") else v) for k, v in batch.items()}

    def step_examples(self, step: int) -> list[dict[str, Any]]:
        """The examples ``step`` trains on: the schedule's (each batch of it used for the objective's
        ``steps_per_batch`` steps), through the objective's step hook (an objective that generates
        returns the generated rows)."""
        scheduled = self.schedule.indices(step // self.objective.steps_per_batch)
        return self.objective.before_step(self, step, [self.data.train[i] for i in scheduled])

    def train_step(self, step: int, examples: list[dict[str, Any]] | None = None) -> tuple[float, int, float | None]:
        """One optimizer step over this rank's micro-batches of the step (one process: all of them);
        ``examples``: the step's (default: :meth:`step_examples`).

        Returns (mean token loss, real tokens processed, grad norm), over all ranks. Every rank
        runs as many backward passes as the rank with the most micro-batches (a missing one is a
        zero-weight pass on one example) so that the ranks' collectives stay in step. After each
        pass the ranks agree whether any ran out of memory (:meth:`_out_of_memory_anywhere`); if
        one did, every rank raises :class:`StepOutOfMemory` before the gradients are synchronised
        (:meth:`_sync_gradients`) or the optimizer steps.
        """
        t = self.recipe.training
        examples = self.step_examples(step) if examples is None else examples
        shares = split_step(len(examples), t.micro_batch_size, self.world_size)
        mine, n_passes = shares[self.rank], max(len(s) for s in shares)
        n_target = self.objective.start_step(examples)
        total_loss, tokens = 0.0, 0
        if not self.model.training:  # train() walks every module: only when evaluation switched it off
            self.model.train()
        for k in range(n_passes):
            failure = None
            try:
                loss_sum, n_tokens = self._micro_step(examples, mine[k] if k < len(mine) else None, n_target, k == n_passes - 1)
                if k == 0:
                    self.faults.in_step(step + 1, self.rank)
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                failure = describe(e)  # the text only: the error's traceback holds the pass's tensors
            failure = self._out_of_memory_anywhere(failure)
            if failure is not None:
                raise StepOutOfMemory(failure)
            total_loss += loss_sum
            tokens += n_tokens
        self._sync_gradients()
        grad_norm = self._optimizer_step()
        sums = self._sum_over_ranks([total_loss, float(tokens), *self.objective.step_totals()])
        total_loss, tokens = sums[0], round(sums[1])
        self.objective.set_step_totals(sums[2:])  # e.g. the rewards of all the step's examples, not only this rank's
        return total_loss / max(n_target, 1), tokens, grad_norm

    def _micro_step(self, examples, bounds: tuple[int, int] | None, n_target: int, last: bool) -> tuple[float, int]:
        """Forward and backward of one micro-batch (``bounds`` of ``examples``; None: a zero-weight pass
        on one example); returns its token-loss sum and tokens. Its tensors die with this call."""
        t = self.recipe.training
        start, end = bounds or (0, 1)
        mb = self.to_device(self.collate(examples[start:end]))
        padding = self.objective.uncounted() if bounds is None else contextlib.nullcontext()
        with self._gradient_sync(last=last), padding:  # a zero-weight pass adds nothing to the step's rewards
            with self.autocast(), save_on_cpu(t.offload_activations and not t.gradient_checkpointing, self.rt.is_cuda):
                loss_sum = self.step_loss(mb)
            # the gradient of the global token-loss sum over the global token count: DDP and ZeRO
            # average the ranks' gradients, so each rank's part is weighted by the number of ranks
            loss = loss_sum * (self.world_size if bounds else 0) / max(n_target, 1)
            self._backward(loss)
        return (float(loss_sum.detach()), mb["num_tokens"]) if bounds else (0.0, 0)

    def trainable_params(self, refresh: bool = False) -> list:
        """The parameters the optimizer trains (kept: walking every parameter each step costs ~1 ms on CPU;
        ``refresh`` after a strategy replaced them)."""
        if refresh or getattr(self, "_trainable", None) is None:
            self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        return self._trainable

    def _optimizer_step(self) -> float | None:
        return optim.optimizer_step(self.optimizer, self.scheduler, self.trainable_params(), self.recipe.training.max_grad_norm, self.scaler)

    def _back_off(self, step: int, message: str) -> None:
        """After an out-of-memory error in ``step`` (:func:`~finetuner.training.backoff.train_step_with_backoff`):
        halve the micro-batch (:func:`~finetuner.training.backoff.back_off`); several processes add their strategy's
        verdict."""
        back_off(self, step, message)

    def predicted_note(self) -> str:
        predicted = getattr(self, "predicted_peak", None)
        return f"The memory model predicted a peak of {gib_text(predicted, 1)}." if predicted else ""

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> float | None:
        """The objective's validation loss (None without validation data); its other fields are kept
        for the ``eval`` event and the metrics."""
        val = self.data.val
        phase = (self.phase("eval", total=len(val), unit="rows", predicted_s=self.predicted_part("evaluations", "evaluations"))
                 if val else contextlib.nullcontext())
        with phase:
            loss, self.eval_extra = self.objective.evaluate(self)  # each objective counts its rows (phases.advance)
        return loss

    def _eval_and_log(self) -> float | None:
        began = time.perf_counter()
        try:
            val = self.evaluate()
        finally:
            self.eval_seconds += time.perf_counter() - began
        extra = getattr(self, "eval_extra", {})
        if val is not None or extra:  # an objective without a validation loss may still report (GRPO's rewards)
            self.events.emit("eval", step=self.step, eval_loss=val, eval_ppl=math.exp(min(val, 50)) if val is not None else None,
                             **extra)
            if self.tb and val is not None:
                self.tb.add_scalar("eval/loss", val, self.step)
        return val

    # ---------------------------------------------------------------- checkpoints
    def _trainer_state(self, elapsed: float) -> dict[str, Any]:
        t = self.recipe.training
        return {
            "step": self.step,
            "max_steps": self.max_steps,
            "steps_per_epoch": self.schedule.steps_per_epoch,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": elapsed,
            "losses": self.losses,
            "objective": self.objective.state(),
            "micro_batch_size": t.micro_batch_size,
            "gradient_accumulation": t.gradient_accumulation,
        }

    def save_checkpoint(self, elapsed: float) -> Path:
        check_finite_weights(self)
        began = time.perf_counter()
        try:
            with disk_full_guard(self.run_dir, self.model, self.recipe, ckpt_io.staging_dir(self.run_dir, self.step)), \
                    self.phase("checkpoint", predicted_s=self.predicted_part("checkpoints", "checkpoints")):
                path = self._write_checkpoint(elapsed)
        finally:
            self.save_seconds += time.perf_counter() - began
        self.events.emit("checkpoint", step=self.step, path=str(path))
        return path

    def _midway_through_save(self) -> None:
        """Called inside a checkpoint write, after the weights: where ``KILL@save:STEP`` strikes."""
        self.faults.in_write("save", self.step, self.rank)

    def _write_checkpoint(self, elapsed: float) -> Path:
        """Write the checkpoint of this step (:mod:`finetuner.training.checkpoint`); returns its folder."""
        return ckpt_io.save_checkpoint(
            self.run_dir,
            self.step,
            self.model,
            self.optimizer,
            self.scheduler,
            self._trainer_state(elapsed),
            self.recipe.checkpointing.keep_last,
            scaler=self.scaler,
            recipe_yaml=self.recipe.to_yaml(),
            midway=self._midway_through_save,
        )

    # ---------------------------------------------------------------- the loop
    def _stopped(self) -> TrainResult:
        """The run stopped on request, its checkpoint written: the ``stopped`` event and the result."""
        self.events.emit("stopped", step=self.step, max_steps=self.max_steps)
        return TrainResult(self.run_dir, self.run_dir / "adapter", {"step": self.step}, stopped=True, losses=self.losses)

    def _say_if_slow(self, rate: StepRate) -> None:
        """The ``slow_steps`` event and a warning, once, when the timed steps are much slower than planned."""
        slow = rate.slow_message()
        if slow is None:
            return
        message, measured = slow
        message += threads.slow_words(self.threads) if not self.rt.is_cuda else ""  # on a CPU: the load and the threads
        self.events.emit("slow_steps", step=self.step, measured_step_s=round(measured, 5),
                         planned_step_s=rate.planned_step_s, factor=round(measured / rate.planned_step_s, 2),
                         message=message)
        if self.rank == 0:  # one line for the run, as its one event
            log.warning("%s", message)

    def train(self) -> TrainResult:
        r = self.recipe
        start = time.perf_counter()
        window_step_s, window_tokens = 0.0, 0
        #: seconds inside the steps themselves (a GRPO step's rollout included; evaluations, checkpoints and
        #: samples not) and the tokens they trained: the run's tokens/s, as the speed model predicts it
        self.step_seconds, self.tokens_here = 0.0, 0
        last_saved = self.step
        eval_loss = None
        stopped = early = False
        self.best = BestEvaluation(keeps_best(r, self.world_size))
        profiling = self.profile_memory and start_memory_profile(self.rt)
        rate = StepRate((self.predicted_speed or {}).get("step_s"), self.max_steps, start, self.resumed_from or 0)
        while self.step < self.max_steps:
            if profiling and self.step - (self.resumed_from or 0) == self.PROFILE_STEPS:
                profiling = dump_memory_profile(self.run_dir, self.events, self.step)
            if self.stop_event.is_set():
                stopped = True
                break
            step_began = time.perf_counter()
            if self.first_step_at is None:
                self.first_step_at = step_began
            try:  # the objective's step hook runs user code (GRPO's reward functions): what it stops loses nothing
                examples = self.step_examples(self.step)
            except RewardStopped:  # a stop arrived while a reward function ran: this step is abandoned
                stopped = True
                break
            except UserError:
                if self.step > last_saved:
                    self.save_checkpoint(self.elapsed_before + time.perf_counter() - start)
                raise
            loss, tokens, grad_norm = train_step_with_backoff(self, self.step, examples)
            took = time.perf_counter() - step_began
            self.step_seconds += took
            self.tokens_here += tokens
            window_step_s += took
            t = self.recipe.training  # the micro-batch may have been backed off
            if not math.isfinite(loss):
                raise UserError(
                    f"The loss became {loss} at step {self.step + 1}; no checkpoint was written after it.",
                    hint=divergence_hint(self.recipe, self.rt.precision, self.losses, first_step=self.step == (self.resumed_from or 0) and not self.losses),
                )
            self.step += 1
            self.tokens_seen += tokens
            window_tokens += tokens
            self.losses.append(round(loss, 6))
            now = time.perf_counter()
            elapsed = self.elapsed_before + now - start
            rate.record(self.step, took, now)
            self._say_if_slow(rate)
            lr = self.scheduler.get_last_lr()[0]
            mem = device_memory(self.rt.device)
            if self.tb:
                self.tb.add_scalar("train/loss", loss, self.step)
                self.tb.add_scalar("train/lr", lr, self.step)
                for k, v in mem.items():
                    self.tb.add_scalar(f"memory/{k}_gib", v / 2**30, self.step)
            if self.step % r.logging.every == 0 or self.step == self.max_steps:
                tps = window_tokens / max(window_step_s, 1e-9)  # real tokens per second of the steps since the last line
                window_step_s, window_tokens = 0.0, 0
                eta, eta_from = rate.eta(self.step, now)
                self.events.emit(
                    "step",
                    step=self.step,
                    max_steps=self.max_steps,
                    epoch=round(self.schedule.epoch_of(self.step), 4),
                    loss=loss,
                    lr=lr,
                    grad_norm=grad_norm,
                    tokens=tokens,
                    tokens_seen=self.tokens_seen,
                    tokens_per_s=round(tps, 2),
                    elapsed_s=round(elapsed, 3),
                    eta_s=round(eta, 1),
                    eta_from=eta_from,
                    micro_batch_size=t.micro_batch_size,
                    **self.objective.step_metrics(),
                    **mem,
                )
            save_every = r.checkpointing.save_every
            if save_every and self.step % save_every == 0 and self.step < self.max_steps:
                self.save_checkpoint(elapsed)  # before the evaluation, which runs user code (GRPO's rewards)
                last_saved = self.step
            if t.eval_every and self.step % t.eval_every == 0 and self.step < self.max_steps:
                try:
                    eval_loss = self._eval_and_log()
                except RewardStopped:  # a stop arrived while a reward function scored the held-out prompts
                    stopped = True
                    break
                except UserError:  # a reward function failed on the held-out prompts: the steps are kept
                    if self.step > last_saved:
                        self.save_checkpoint(elapsed)
                    raise
                self.best.track(eval_loss, self.step, self.trainable_params())
                if t.early_stopping_patience and self.best.evals_since >= t.early_stopping_patience:
                    early = True  # the final save and evaluation below run as at the last step
                    break
            self.faults.after_step(self.step, self.rank, stopping=self._stop_asked_here, agree=self._agreed)
        if profiling:  # a run (or what was left of it) shorter than PROFILE_STEPS
            dump_memory_profile(self.run_dir, self.events, self.step)
        elapsed = self.elapsed_before + time.perf_counter() - start
        if stopped:
            if self.step > last_saved or ckpt_io.latest_checkpoint(self.run_dir) is None:
                self.save_checkpoint(elapsed)
            return self._stopped()
        if self.step > last_saved:
            self.save_checkpoint(elapsed)
        try:
            eval_loss = self._eval_and_log()
        except RewardStopped:  # stopped during the final evaluation: every step is trained and saved
            return self._stopped()
        self.best.track(eval_loss, self.step, self.trainable_params())
        check_finite_weights(self)
        began = time.perf_counter()
        best = self.best.summary(eval_loss, self.step, early, self.recipe.training.early_stopping_patience)
        if best.get("adapter_step") not in (None, self.step):  # the held-out loss rose after its best
            self.save_final(name="adapter-last")
            self.best.restore(self.trainable_params())
        adapter_dir = self.save_final()
        self.save_seconds += time.perf_counter() - began
        # the weights in memory are adapter/'s now: the probe, the tool calls and the samples answer with them
        self.answers_from = shipped(best, self.step, self.recipe.method != "full")
        began = time.perf_counter()
        probe = general_probe(self)
        self.probe_seconds = time.perf_counter() - began
        tool_calls = held_out_tool_calls(self)
        self.tool_call_seconds = tool_calls["seconds"] if tool_calls else 0.0
        metrics = {
            "steps": self.step,
            "train_loss_first": self.losses[0] if self.losses else None,
            "train_loss_last": self.losses[-1] if self.losses else None,
            "eval_loss": best.get("eval_loss", eval_loss),
            "eval_ppl": math.exp(min(best.get("eval_loss", eval_loss), 50)) if eval_loss is not None else None,
            **{k: v for k, v in best.items() if k != "eval_loss"},
            "answers_from": self.answers_from,
            "tokens_seen": self.tokens_seen,
            "train_seconds": round(elapsed, 2),
            "tokens_per_s": round(self.tokens_here / max(self.step_seconds, 1e-9), 2),  # the steps' own time
            "step_seconds": round(self.step_seconds, 2),
            **getattr(self, "eval_extra", {}),
            "data": self.data.stats.to_dict(),
            **device_memory(self.rt.device),
        }
        if self.replay is not None:
            metrics["replay"] = self.replay
        if probe is not None:
            from finetuner.infer.probe import entry_of

            metrics["general_probe"] = entry_of(probe)
        if tool_calls is not None:
            metrics["tool_calls"] = tool_calls
        metrics["threads"] = {"train": self.threads.to_dict(), **self.phase_threads}
        metrics["memory"] = memory_comparison(self.prediction, metrics["mem_peak"], self.rt)
        pred = getattr(self, "predicted_speed", None) or {}
        metrics["time"] = {"predicted": predicted_wait(pred), "measured": measured_wait(self)}
        self._write_json("metrics.json", metrics)
        ran = max(1, self.step - (self.resumed_from or 0))
        self.events.emit("done", step=self.step, adapter_dir=str(adapter_dir), metrics=metrics,
                         predicted_tokens_per_s=pred.get("tokens_per_s"), measured_tokens_per_s=metrics["tokens_per_s"],
                         predicted_step_s=pred.get("step_s"), measured_step_s=round(self.step_seconds / ran, 5),
                         predicted_wait_s=metrics["time"]["predicted"], measured_wait_s=metrics["time"]["measured"])
        return TrainResult(self.run_dir, adapter_dir, metrics, losses=self.losses)

    def prompt_switches(self) -> dict[str, Any]:
        """The chat template's keyword arguments for the prompts the run answers: the form its rows trained in."""
        return prompt_switches(self.data.chat_template, self.data.stats.thinking)

    def save_final(self, weights: dict[str, Any] | None = None, name: str = "adapter") -> Path:
        """The adapter (or full model) and tokenizer as a ``save_pretrained`` folder ``name`` in the run, atomically
        (:func:`finetuner.training.final.save_final`); ``weights``: the trained weights to save when the model's own
        are sharded (a state dict)."""
        return save_final(self, weights, name)

    def cleanup(self) -> None:
        if self.tb:
            self.tb.close()
        if self.reporters is not None:
            self.reporters.close()
        self.events.close()

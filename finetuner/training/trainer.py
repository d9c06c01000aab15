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

The trainer knows nothing of any UI: it writes events (:mod:`finetuner.runs.events`) and checks a
stop flag between steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from finetuner.training import checkpoint as ckpt_io
from finetuner.data import cache as data_cache
from finetuner.data.pipeline import PreparedData
from finetuner.data.thinking import prompt_switches, resolved as thinking_resolved
from finetuner.errors import OutOfMemory, UserError
from finetuner.runs.events import Callback, EventWriter, device_memory
from finetuner.training.faults import FaultPlan
from finetuner.rewards.limits import RewardStopped
from finetuner.training.oom import StepOutOfMemory, describe, is_out_of_memory, smaller_micro_batch
from finetuner.fileio import atomic_write_json
from finetuner.model.gguf_base import info_for
from finetuner.data.images import PictureCollator
from finetuner.model.loading import check_vision_training, count_parameters, load_base_model, prepare_for_training
from finetuner.model.vision import refuse_pictures_only, text_inputs
from finetuner.model.offload import save_on_cpu
from finetuner.objectives import build_objective
from finetuner.quiet import quieted
from finetuner.config.recipe import Recipe, TrainingSection
from finetuner.config.runtime import Runtime, resolve_runtime
from finetuner.training.result import TrainResult
from finetuner.training.step_rate import StepRate
from finetuner.planning.sizing import optimizer_steps, steps_per_epoch
from finetuner.runs.folder import (
    RunAlreadyFinished,
    RunFinished,
    check_disk_space,
    events_size,
    is_new_run_dir,
    prepare_run_dir,
    record_early_failure,
    remove_failed_setup,
)
from finetuner.training.inputs import check_inputs
from finetuner.phases import Phase

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- pieces
def build_optimizer(model, cfg: TrainingSection, on_cuda: bool):
    """The optimizer named by ``training.optimizer`` over the trainable parameters."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError("No trainable parameters.", hint="Check lora.target_modules matches modules of this model.")
    name, lr, wd = cfg.optimizer, cfg.lr, cfg.weight_decay
    if name == "adamw_torch":
        # the fused kernel exists for CPU too (one pass over all tensors instead of a loop per tensor)
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=wd)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, weight_decay=wd, scale_parameter=False, relative_step=False, warmup_init=False)
    from finetuner.model.loading import require_bitsandbytes

    bnb = require_bitsandbytes(f"training.optimizer: {name}")
    cls = {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }[name]
    return cls(params, lr=lr, weight_decay=wd)


def build_scheduler(optimizer, cfg: TrainingSection, total_steps: int):
    from transformers import get_scheduler

    if cfg.warmup_steps is not None:
        warmup = cfg.warmup_steps
    else:
        warmup = math.ceil((0.03 if cfg.warmup_ratio is None else cfg.warmup_ratio) * total_steps)
    return get_scheduler(cfg.scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def optimizer_step(optimizer, scheduler, params, max_grad_norm: float | None, scaler=None) -> float:
    """One optimizer step after the step's backward passes; returns the gradient norm before clipping.

    With a loss scaler (``torch.amp.GradScaler``, fp16) the gradients are unscaled first, so the
    norm and the clipping are those of the true gradients, and the scaler skips the update when
    they hold an inf or a NaN (and lowers its scale). The schedule advances and the gradients are
    cleared either way. Every trainer, on one process or on several, steps through here (a
    DeepSpeed engine excepted: it clips, scales and steps itself).
    """
    import torch

    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else float("inf")))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def local_part(t):
    """This process's part of a parameter: a sharded one's (DTensor) local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def split_step(n_examples: int, micro_batch_size: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Each rank's micro-batches of one optimizer step, as ``(start, end)`` slices of its examples.

    One process cuts the step's examples into micro-batches of ``micro_batch_size``. When their
    number divides by ``world_size``, rank ``r`` takes micro-batches ``r, r + W, ...`` (the same
    micro-batches, just spread out); otherwise the examples are cut into ``W`` contiguous shares
    (sizes differ by at most one) and each share into micro-batches. Ranks may get different
    numbers of micro-batches (or none).
    """
    bounds = [(i, min(i + micro_batch_size, n_examples)) for i in range(0, n_examples, micro_batch_size)]
    if len(bounds) % world_size == 0:
        return [bounds[r::world_size] for r in range(world_size)]
    base, extra = divmod(n_examples, world_size)
    out, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        out.append([(i, min(i + micro_batch_size, end)) for i in range(start, end, micro_batch_size)])
        start = end
    return out


class StepSchedule:
    """Which examples each optimizer step uses: chunks of a seeded permutation per epoch."""

    def __init__(self, n_examples: int, effective_batch: int, seed: int):
        self.n, self.eff, self.seed = n_examples, effective_batch, seed
        self.steps_per_epoch = steps_per_epoch(n_examples, effective_batch)  # as the plan counts them
        self._perm_epoch, self._perm = -1, []

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            self._perm = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._perm)
            self._perm_epoch = epoch
        return self._perm[k * self.eff : (k + 1) * self.eff]

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch


def predict_run(recipe: Recipe, rt: Runtime, max_steps: int, label_fraction: float = 1.0,
                loaded_as: tuple[bool, bool] | None = None, replay_cached: bool | None = None):
    """This run's :func:`finetuner.planning.predict.predict` on this device, with the trainer's runtime and its own
    count of optimizer steps (what ``finetuner plan`` and ``estimate`` say of the recipe), or None if the models
    cannot say. ``loaded_as``: whether the model was to be downloaded and converted when the run began
    (:func:`finetuner.planning.wait.first_load`, recorded before the load); ``replay_cached``: whether
    ``data.replay``'s answers came from its cache (the replay made before the prediction fills it)."""
    try:
        import torch

        from finetuner.config.hardware import run_profile
        from finetuner.planning.predict import predict

        # reading a model the cache lacks (its layer traced under LoRA) may draw random numbers: never the run's own,
        # so that its weights' init and dropout masks do not depend on what the cache held
        with torch.random.fork_rng(devices=[]):
            return predict(recipe, run_profile(rt.device), runtime=rt, label_fraction=label_fraction, steps=max_steps,
                           loaded_as=loaded_as, replay_cached=replay_cached)
    except Exception as e:  # noqa: BLE001 - an architecture the memory model does not know must not stop training
        log.info("No memory prediction for this run: %s", e)
        return None


def predicted_speed_of(prediction) -> dict[str, Any] | None:
    """The start event's ``predicted_speed`` (:meth:`finetuner.planning.predict.Prediction.speed_dict`: tokens/s,
    the step, the steps alone, the whole wait by part), or None if the speed model cannot say."""
    if prediction is None:
        return None
    try:
        return prediction.speed_dict()
    except Exception as e:  # noqa: BLE001 - a prediction must not stop training
        log.info("No speed prediction for this run: %s", e)
        return None


def predicted_wait(predicted_speed: dict[str, Any]) -> dict[str, float] | None:
    """The start event's predicted wait (``predicted_speed["wait"]``) in the measured wait's keys: its parts
    and ``total`` (the whole run); None without one."""
    wait = predicted_speed.get("wait")
    if not wait:
        return None
    return {**wait["parts_s"], "total": wait["wall_s"]}


def memory_comparison(prediction, measured_peak: int, rt: Runtime) -> dict[str, Any]:
    """Predicted vs measured peak; on CPU the measurement is the process RSS (not comparable 1:1)."""
    out: dict[str, Any] = {"measured_peak_bytes": measured_peak, "measured": "torch.cuda.max_memory_allocated" if rt.is_cuda else "process peak RSS"}
    if prediction is not None:
        out["predicted_peak_bytes"] = prediction.allocated_bytes
        if rt.is_cuda:
            out["error_pct"] = round(100.0 * (prediction.allocated_bytes - measured_peak) / max(measured_peak, 1), 2)
    return out


# --------------------------------------------------------------------------- the recipe
class Trainer:
    """A fine-tune from a resolved recipe to an adapter in the run folder."""

    #: steps recorded by ``--profile-memory`` before the snapshot is written
    PROFILE_STEPS = 3

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
        self.faults = FaultPlan()
        if self.faults.wants_kill_in("events"):  # KILL@events:STEP: halfway through that step's line
            self.events.midway = lambda record: record["event"] == "step" and self.faults.in_write("events", record["step"], self.rank)
        self._tried_micro: list[int] = []
        self.profile_memory = profile_memory
        #: this process's place in the run: one process is rank 0 of 1
        self.rank, self.world_size = 0, 1
        #: where the run's wall clock starts (:func:`train` sets its own entry), when the first step began, and
        #: the seconds spent in evaluations and in writing checkpoints and the adapter, in ``data.replay``'s answers
        #: before the first step and in the general probe after the adapter is saved (:meth:`measured_wait`)
        self.entered_at, self.first_step_at = time.perf_counter(), None
        self.eval_seconds, self.save_seconds, self.replay_seconds, self.probe_seconds = 0.0, 0.0, 0.0, 0.0
        #: what the recipe's data ``auto`` values became and why (finetuner.planning.data_auto; :func:`train` sets
        #: it), said in the ``start`` event
        self.resolved: dict[str, dict[str, Any]] = {}
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
        self.objective.on_model(self.model)
        began = time.perf_counter()
        self.replay = self._mix_replay()
        self.replay_seconds = time.perf_counter() - began
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
        t = r.training
        self.schedule = StepSchedule(len(self.data.train), t.effective_batch_size, t.seed)
        self.max_steps = t.max_steps or (
            optimizer_steps(None, t.epochs, len(self.data.train), t.effective_batch_size) * self.objective.steps_per_batch)
        self.optimizer = build_optimizer(self.model, t, self.rt.is_cuda)
        self.scheduler = build_scheduler(self.optimizer, t, self.max_steps)
        self.scaler = torch.amp.GradScaler("cuda") if (self.rt.precision == "fp16" and self.rt.is_cuda) else None
        self.step_loss = self.objective.step_loss_module(self.model, t.loss_chunk_size, self.fused_ce)
        self.objective.prepare(self)  # e.g. the step-0 model's reference scores, before any checkpoint is applied
        self.step, self.tokens_seen, self.elapsed_before, self.losses = 0, 0, 0.0, []
        self.resumed_from = None
        self._distribute()
        self._resume()
        check_disk_space(self.run_dir, self.model, t.optimizer, r.checkpointing.keep_last)
        if r.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
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
            **device_memory(self.rt.device),
        )

    # ---------------------------------------------------------------- phases
    def phase(self, name: str, total: int | None = None, unit: str = "", predicted_s: float | None = None) -> Phase:
        """A phase of this run that is not a step (:mod:`finetuner.phases`), said in ``phase`` events."""
        return Phase(name, self._say_phase, total=total, unit=unit, predicted_s=predicted_s)

    def _say_phase(self, rec: dict[str, Any]) -> None:
        self.events.emit("phase", phase=rec["phase"], label=rec["label"], state=rec["state"], done=rec["done"],
                         total=rec["total"], unit=rec["unit"], elapsed_s=rec["elapsed_s"], eta_s=rec["eta_s"],
                         eta_from=rec["eta_from"])

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

    def _predicted_part(self, part: str, count: str | None = None) -> float | None:
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
        return ckpt_io.apply_checkpoint(parts, self.model, self.optimizer, self.scheduler, self.scaler, self._full)

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
        import torch

        if self.rt.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda" if self.rt.is_cuda else "cpu", dtype=self.rt.torch_dtype(self.rt.precision))

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
        return optimizer_step(self.optimizer, self.scheduler, self.trainable_params(), self.recipe.training.max_grad_norm, self.scaler)

    def train_step_with_backoff(self, step: int, examples: list[dict[str, Any]] | None = None) -> tuple[float, int, float | None]:
        """:meth:`train_step`, retried with half the micro-batch and twice the accumulation on OOM.

        The failure is recorded inside the ``except`` block and the memory freed after it: while
        the error is being handled its traceback keeps the failed step's frames, and their tensors,
        alive. An out-of-memory error after the passes (in the optimizer step) is retried the
        same way on one process; on several the ranks have not agreed on it and the run ends.
        """
        import torch

        rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if self.rt.is_cuda else None)
        while True:
            try:
                return self.train_step(step, examples)
            except StepOutOfMemory as e:
                failure = e.message
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                failure = describe(e)
                if self.world_size > 1:  # the other ranks may have stepped: this rank ends the run
                    raise OutOfMemory(
                        f"Out of device memory in step {step + 1} on rank {self.rank} of {self.world_size} processes, "
                        f"after the step's micro-batches ({failure}); a smaller micro-batch does not lower that memory.",
                        hint="Use a ZeRO strategy with distributed.offload: optimizer, a paged or 8-bit optimizer, or "
                        "method: qlora; `finetuner plan --gpus N` finds settings that fit.",
                    ) from None
            self._free_after_oom()
            self._back_off(step, failure)
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state_all(rng[1])

    def _back_off(self, step: int, message: str) -> None:
        """After an out-of-memory error in ``step``: halve the micro-batch (same effective batch),
        or raise :class:`OutOfMemory` with advice when it is 1 already. On several processes every
        rank comes here with the same values (they agreed on the error); rank 0 writes."""
        t = self.recipe.training
        eff = t.effective_batch_size
        new_micro = smaller_micro_batch(t.micro_batch_size, eff)
        if new_micro is None:
            where = f" on {self.world_size} processes" if self.world_size > 1 else ""
            raise OutOfMemory(
                f"Out of device memory in step {step + 1}{where} even with micro_batch_size 1 "
                f"(tried {', '.join(map(str, self._tried_micro + [1]))}). {self.predicted_note()}",
                hint="Turn on training.gradient_checkpointing, use method: qlora, a paged or 8-bit optimizer, "
                "or a shorter data.max_seq_len; `finetuner plan` finds settings that fit this card.",
            )
        self._tried_micro.append(t.micro_batch_size)
        new = t.model_copy(update={"micro_batch_size": new_micro, "gradient_accumulation": eff // new_micro})
        self.events.emit(
            "oom_backoff",
            step=step + 1,
            old_micro_batch_size=t.micro_batch_size,
            old_gradient_accumulation=t.gradient_accumulation,
            micro_batch_size=new.micro_batch_size,
            gradient_accumulation=new.gradient_accumulation,
            message=message[:300],
        )
        log.warning(
            "Out of memory in step %d: micro-batch %d → %d, accumulation %d → %d (same effective batch).",
            step + 1, t.micro_batch_size, new.micro_batch_size, t.gradient_accumulation, new.gradient_accumulation,
        )
        self.recipe = self.recipe.model_copy(update={"training": new})
        if self.rank == 0:
            self.recipe.save(self.run_dir / "recipe.yaml")  # a resume uses the values that fit

    def _start_memory_profile(self) -> bool:
        if not self.profile_memory:
            return False
        if not self.rt.is_cuda:
            log.warning("--profile-memory records CUDA allocations; this run is on %s, so nothing is recorded.", self.rt.device)
            return False
        import torch

        torch.cuda.memory._record_memory_history(max_entries=200_000)
        return True

    def _dump_memory_profile(self) -> bool:
        """Write the snapshot (open it at https://pytorch.org/memory_viz) and stop recording."""
        import torch

        path = self.run_dir / "memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.events.emit("memory_snapshot", step=self.step, path=str(path))
        return False

    def _free_after_oom(self) -> None:
        """Give back what the failed attempt held (called after its ``except`` block has ended, when
        nothing refers to its tensors any more): its gradients, reference cycles, the CUDA cache."""
        import gc

        import torch

        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.rt.is_cuda:
            torch.cuda.empty_cache()

    def predicted_note(self) -> str:
        predicted = getattr(self, "predicted_peak", None)
        return f"The memory model predicted a peak of {predicted / 2**30:.1f} GiB." if predicted else ""

    @property
    def _full(self) -> bool:
        return self.recipe.method == "full"

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> float | None:
        """The objective's validation loss (None without validation data); its other fields are kept
        for the ``eval`` event and the metrics."""
        val = self.data.val
        phase = (self.phase("eval", total=len(val), unit="rows", predicted_s=self._predicted_part("evaluations", "evaluations"))
                 if val else contextlib.nullcontext())
        with phase:
            loss, self.eval_extra = self.objective.evaluate(self)  # each objective counts its rows (phases.advance)
        return loss

    def _keeps_best(self) -> bool:
        """``training.keep_best`` applies: SFT's held-out loss, an adapter (a snapshot of it is small), and each
        process holding whole adapters (one process or DDP; sharded strategies hold pieces)."""
        r = self.recipe
        return (r.training.keep_best and not self._full and r.objective == "sft"
                and (self.world_size == 1 or r.distributed.strategy == "ddp"))

    def _track_best(self, val: float | None) -> None:
        """After an evaluation: the lowest held-out loss so far, its step and (``keep_best``) a CPU copy of the
        adapter then; the evaluations since it (``early_stopping_patience``)."""
        if val is None:
            return
        if self.best is None or val < self.best[0]:
            self.best, self.evals_since_best = (val, self.step), 0
            if self._keeps_best():
                self.best_weights = [p.detach().to("cpu", copy=True) for p in self.trainable_params()]
        else:
            self.evals_since_best += 1

    def _restore_best(self) -> None:
        for p, w in zip(self.trainable_params(), self.best_weights):
            p.data.copy_(w.to(p.device, p.dtype))

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
        self._check_finite_weights()
        began = time.perf_counter()
        try:
            with self._disk_full_guard(ckpt_io.staging_dir(self.run_dir, self.step)), \
                    self.phase("checkpoint", predicted_s=self._predicted_part("checkpoints", "checkpoints")):
                path = self._write_checkpoint(elapsed)
        finally:
            self.save_seconds += time.perf_counter() - began
        self.events.emit("checkpoint", step=self.step, path=str(path))
        return path

    def _check_finite_weights(self) -> None:
        """Before a checkpoint or the adapter is written (on every rank, which agree): a trained
        weight that is NaN or inf ends the run instead, so no checkpoint a resume would load again,
        and no adapter, ever holds one; the run folder keeps its last good checkpoint."""
        import torch

        bad = [n for n, p in self.model.named_parameters() if p.requires_grad and local_part(p).numel()
               and not bool(torch.isfinite(local_part(p)).all())]
        if not self._sum_over_ranks([float(len(bad))])[0]:
            return
        shown = f" ({', '.join(bad[:2])}{f' and {len(bad) - 2} more' if len(bad) > 2 else ''})" if bad else ""
        last = ckpt_io.latest_checkpoint(self.run_dir)
        kept = f"the run folder keeps its last good checkpoint ({last.name})" if last is not None else "the run folder has no checkpoint yet"
        raise UserError(
            f"After step {self.step} the trained weights hold NaN or inf values{shown}; nothing was saved ({kept}).",
            hint=self.divergence_hint(),
        )

    def divergence_hint(self, first_step: bool = False) -> str:
        """What most likely made the loss or the weights non-finite, from what this run did: the
        first step already (the base model or the data), fp16, a high learning rate, no clipping,
        a loss that was climbing before."""
        t, causes = self.recipe.training, []
        if first_step:  # nothing was updated yet: not the learning rate
            causes.append(
                "the loss is not finite at the first step, before any update: the base model's own outputs are (check "
                f"its weights in {self.recipe.model.name}, or try training.precision: fp32)")
        if self.rt.precision == "fp16":
            causes.append("fp16 overflows easily: use training.precision bf16 (on GPUs that have it) or fp32")
        if first_step:
            return "Likely cause: " + "; ".join(causes) + "."
        if t.lr > 1e-2 or (t.lr > 2e-3 and self.recipe.method == "full"):
            causes.append(f"training.lr {t.lr:g} is very high for {self.recipe.method} (LoRA trains at 1e-4 to 2e-3, "
                          "a full fine-tune at 1e-6 to 5e-5): lower it")
        if t.max_grad_norm is None:
            causes.append("gradient clipping is off: set training.max_grad_norm: 1.0")
        finite = [x for x in self.losses if math.isfinite(x)]
        if len(finite) >= 2 and finite[-1] > 2 * min(finite):
            causes.append(f"the loss was climbing ({min(finite):.3g} → {finite[-1]:.3g}): the training diverged; lower "
                          "training.lr or raise warmup_steps")
        if not causes:
            causes.append(f"lower training.lr ({t.lr:g}) or raise warmup_steps; try training.precision: fp32 to rule out rounding")
        return "Likely cause: " + "; ".join(causes) + "."

    def _disk_full_guard(self, path: Path, weights_only: bool = False):
        """A full disk while writing ``path`` (a checkpoint, the adapter) ends the run with one line
        saying how much to free and how to resume, instead of the writers' chained tracebacks."""
        from finetuner.fileio import disk_full_as_user_error
        from finetuner.runs.folder import checkpoint_bytes, disk_space_needed

        last = ckpt_io.latest_checkpoint(self.run_dir)
        since = f"from its last checkpoint ({last.name})" if last is not None else "from the start"
        then = (f"resume with `finetuner run {self.run_dir / 'recipe.yaml'} -o {self.run_dir}` (the run continues "
                f"{since}; lowering checkpointing.keep_last also saves space)")
        if weights_only:  # the final adapter: the resume that writes it again needs only its room
            need = checkpoint_bytes(self.model, "sgd")
        else:  # what the resume's own check asks for (check_disk_space)
            need = disk_space_needed(self.run_dir, self.model, self.recipe.training.optimizer, self.recipe.checkpointing.keep_last)[2]
        return disk_full_as_user_error(path, then, need)

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
        self.best, self.best_weights, self.evals_since_best = None, None, 0
        profiling = self._start_memory_profile()
        rate = StepRate((self.predicted_speed or {}).get("step_s"), self.max_steps, start, self.resumed_from or 0)
        while self.step < self.max_steps:
            if profiling and self.step - (self.resumed_from or 0) == self.PROFILE_STEPS:
                profiling = self._dump_memory_profile()
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
            loss, tokens, grad_norm = self.train_step_with_backoff(self.step, examples)
            took = time.perf_counter() - step_began
            self.step_seconds += took
            self.tokens_here += tokens
            window_step_s += took
            t = self.recipe.training  # the micro-batch may have been backed off
            if not math.isfinite(loss):
                raise UserError(
                    f"The loss became {loss} at step {self.step + 1}; no checkpoint was written after it.",
                    hint=self.divergence_hint(first_step=self.step == (self.resumed_from or 0) and not self.losses),
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
                self._track_best(eval_loss)
                if t.early_stopping_patience and self.evals_since_best >= t.early_stopping_patience:
                    early = True  # the final save and evaluation below run as at the last step
                    break
            self.faults.after_step(self.step, self.rank, stopping=self.stop_event.is_set)
        if profiling:  # a run (or what was left of it) shorter than PROFILE_STEPS
            self._dump_memory_profile()
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
        self._track_best(eval_loss)
        self._check_finite_weights()
        began = time.perf_counter()
        best = self._best_summary(eval_loss, early)
        if best.get("adapter_step") not in (None, self.step):  # the held-out loss rose after its best
            self.save_final(name="adapter-last")
            self._restore_best()
        adapter_dir = self.save_final()
        self.save_seconds += time.perf_counter() - began
        began = time.perf_counter()
        probe = self._general_probe()
        self.probe_seconds = time.perf_counter() - began
        metrics = {
            "steps": self.step,
            "train_loss_first": self.losses[0] if self.losses else None,
            "train_loss_last": self.losses[-1] if self.losses else None,
            "eval_loss": best.get("eval_loss", eval_loss),
            "eval_ppl": math.exp(min(best.get("eval_loss", eval_loss), 50)) if eval_loss is not None else None,
            **{k: v for k, v in best.items() if k != "eval_loss"},
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
        metrics["memory"] = memory_comparison(self.prediction, metrics["mem_peak"], self.rt)
        pred = getattr(self, "predicted_speed", None) or {}
        metrics["time"] = {"predicted": predicted_wait(pred), "measured": self.measured_wait()}
        self._write_json("metrics.json", metrics)
        ran = max(1, self.step - (self.resumed_from or 0))
        self.events.emit("done", step=self.step, adapter_dir=str(adapter_dir), metrics=metrics,
                         predicted_tokens_per_s=pred.get("tokens_per_s"), measured_tokens_per_s=metrics["tokens_per_s"],
                         predicted_step_s=pred.get("step_s"), measured_step_s=round(self.step_seconds / ran, 5),
                         predicted_wait_s=metrics["time"]["predicted"], measured_wait_s=metrics["time"]["measured"])
        return TrainResult(self.run_dir, adapter_dir, metrics, losses=self.losses)

    def _chat(self, system: str | None):
        """The model in memory as a :class:`~finetuner.infer.chat.ChatModel` (its adapter switchable)."""
        from finetuner.infer.chat import ChatModel
        from finetuner.infer.loading import Source

        r = self.recipe
        context = min(2048, int(getattr(self.model.config, "max_position_embeddings", None) or 2048))
        return ChatModel(model=self.model, tokenizer=self.tokenizer, template=self.data.chat_template,
                         device=str(self.rt.device), source=Source(self.run_dir, "run", r.model.name, recipe=r),
                         system=system, max_context=context, switches=self.prompt_switches())

    def prompt_switches(self) -> dict[str, Any]:
        """The chat template's keyword arguments for the prompts the run answers: the form its rows trained in."""
        return prompt_switches(self.data.chat_template, self.data.stats.thinking)

    @contextlib.contextmanager
    def _answering(self):
        """Greedy answers from the model in memory: eval mode (no dropout), the KV cache on; restored after."""
        config = self.model.config
        was_training, use_cache = self.model.training, config.use_cache
        self.model.eval()
        config.use_cache = True
        try:
            yield
        finally:
            config.use_cache = use_cache
            self.model.train(was_training)

    def _mix_replay(self) -> dict[str, Any] | None:
        """``data.replay``: the base model's answers to general prompts (the model in memory before any step, the
        adapter off, without the user's system prompt) mixed into the training rows (:mod:`finetuner.data.replay`).
        None when the recipe asks for none."""
        r = self.recipe
        if not r.data.replay:  # the recipe allows it for SFT on one process only
            return None
        from finetuner.data.replay import BATCH, MAX_NEW_TOKENS, ROUTINE_REASONS, base_model, mix_replay

        chat = self._chat(system=None)  # never the user's system prompt

        def answer(prompts: list[str]) -> list[str]:
            log.info("data.replay: the base model answers %d general prompts", len(prompts))
            with self._answering(), self.phase("replay", total=len(prompts), unit="answers",
                                               predicted_s=self._predicted_part("replay")):
                return chat.greedy_replies([[{"role": "user", "content": p}] for p in prompts], adapter=False,
                                           max_new_tokens=MAX_NEW_TOKENS, batch=BATCH)

        base = base_model(r.model.name, r.model.revision, self.rt.base_dtype, self.model, self.tokenizer,
                          self.data.chat_template, self.prompt_switches())
        self.data, info = mix_replay(self.data, r.data, self.tokenizer, base, r.training.seed, answer)
        # the answers made again for a reason (another base, a damaged file) or left uncached: a warning (the CLI
        # prints it; the progress printer says the routine ones)
        (log.info if info["reason"] in ROUTINE_REASONS else log.warning)("%s", info["message"])
        self.events.emit("replay", rows=info["rows"], ratio=info["ratio"], from_cache=info["from_cache"],
                         reason=info["reason"], changed=info["changed"], message=info["message"], cache=info["cache"],
                         weights=info["weights"], prompts_file=info["prompts_file"])
        return info

    def _general_probe(self):
        """What the fine-tune kept (:mod:`finetuner.infer.probe`): the base (the adapter switched off) and the
        fine-tune answer ``training.general_probe`` general questions with the model in memory; None when the run
        has no adapter to switch off, is spread over processes, or is set to ask none. A failure is a warning:
        the trained adapter is saved already."""
        from finetuner.infer.probe import run_probe_count

        r = self.recipe
        n = run_probe_count(r.training.general_probe, cuda=self.rt.is_cuda)
        if not n or self._full or self.world_size != 1 or not hasattr(self.model, "disable_adapter"):
            return None
        from finetuner.infer.probe import probe_chat

        from finetuner.data.pipeline import run_system_prompt

        # as the run's model is asked (chat's default and the Modelfile's SYSTEM too)
        chat = self._chat(system=run_system_prompt(r.data.system_prompt, self.data.stats.to_dict()))
        try:
            with self._answering(), self.phase("probe", unit="answers", predicted_s=self._predicted_part("probe")):
                return probe_chat(chat, str(self.run_dir), limit=n)  # counts its answers (phases.expect, advance)
        except Exception as e:  # noqa: BLE001 - the run is trained and saved; the probe is a report on it
            log.warning("The general probe failed (%s: %s); `finetuner eval %s --general` runs it again.",
                        type(e).__name__, e, self.run_dir)
            return None

    def _best_summary(self, last: float | None, early: bool) -> dict[str, Any]:
        """The metrics of the best evaluation: ``best_eval_loss``/``best_step``; with ``keep_best`` the
        adapter's step and loss (``adapter_step``, ``eval_loss``: the best's when the last is not) and the last
        evaluation's (``eval_loss_last``); ``stopped_early``; ``held_out_note``: one line when the held-out loss
        rose from its best."""
        out: dict[str, Any] = {"stopped_early": early} if self.recipe.training.early_stopping_patience else {}
        if self.best is None or last is None:
            return out
        loss, step = self.best
        out.update(best_eval_loss=loss, best_step=step)
        if step == self.step:
            return out
        if self._keeps_best() and self.best_weights is not None:
            out.update(eval_loss=loss, eval_loss_last=last, adapter_step=step,
                       held_out_note=f"held-out loss rose from {loss:.4f} at step {step} to {last:.4f} at step {self.step}: "
                                     f"the adapter is step {step}'s (the last is adapter-last/)")
        else:
            out["held_out_note"] = (f"held-out loss rose from {loss:.4f} at step {step} to {last:.4f} at step {self.step}; "
                                    "the adapter is the last step's")
        return out

    def measured_wait(self, samples_s: float = 0.0) -> dict[str, float]:
        """This process's wall time by part, as :mod:`finetuner.planning.wait` predicts it: ``load`` from
        :attr:`entered_at` (the run's start) to the first step (the download, the libraries, the model, the
        data) less ``replay`` (``data.replay``'s answers, made in that time), ``steps``, ``evaluations``,
        ``checkpoints`` (the adapter included), ``probe`` (the general probe), ``samples`` and ``total``
        (from the start until now; the parts are inside it, the rest is the loop's own bookkeeping). A resumed
        run measures what this process did."""
        now = time.perf_counter()
        first = self.first_step_at if self.first_step_at is not None else now
        return {"load": round(first - self.entered_at - self.replay_seconds, 3), "replay": round(self.replay_seconds, 3),
                "steps": round(self.step_seconds, 3), "evaluations": round(self.eval_seconds, 3),
                "checkpoints": round(self.save_seconds, 3), "probe": round(self.probe_seconds, 3),
                "samples": round(samples_s, 3), "total": round(now - self.entered_at, 3)}

    def save_final(self, weights: dict[str, Any] | None = None, name: str = "adapter") -> Path:
        """The adapter (or full model) and tokenizer as a ``save_pretrained`` folder ``name`` in the run, atomically;
        ``weights``: the trained weights to save when the model's own are sharded (a state dict)."""
        import shutil

        from finetuner.fileio import give_back, publish_dir

        final = self.run_dir / name
        tmp = self.run_dir / f".tmp-{name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        with self._disk_full_guard(tmp, weights_only=True), self.phase("save"):  # its message once the space is given back
            try:
                with quieted():  # transformers' "Writing model shards" bar
                    ckpt_io.save_weights(self.model, tmp, weights)
                    self.tokenizer.chat_template = self.data.chat_template
                    self.tokenizer.save_pretrained(tmp)
                    if self.processor is not None:  # a picture run: the processor (image settings, template) goes along
                        self.processor.save_pretrained(tmp)
            except BaseException as e:
                give_back(tmp, e)  # the space of the half-written adapter
                raise
        if final.exists():
            old = self.run_dir / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            publish_dir(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            publish_dir(tmp, final)
        return final

    def answer_samples(self, result: TrainResult) -> None:
        """``samples.prompts`` answered by the fine-tune and the base (after ``done``): into ``metrics.json``, with
        their time, and the ``samples`` event."""
        from finetuner.infer.generate import compare_samples
        from finetuner.planning.wait import sample_answers

        r = self.recipe
        began = time.perf_counter()
        answers = sample_answers(len(r.samples.prompts), "full" if not hasattr(self.model, "disable_adapter") else r.method)
        with self.phase("samples", total=answers, unit="answers", predicted_s=self._predicted_part("samples")):
            samples = compare_samples(self.model, self.tokenizer, self.data.chat_template, r.samples, self.rt,
                                      self.prompt_switches())
        took = time.perf_counter() - began
        result.metrics["samples"] = samples
        if "time" in result.metrics:  # the samples' time, and the total with them
            result.metrics["time"]["measured"] = self.measured_wait(took)
        atomic_write_json(self.run_dir / "metrics.json", result.metrics)
        self.events.emit("samples", samples=samples, samples_s=round(took, 3))

    def cleanup(self) -> None:
        if self.tb:
            self.tb.close()
        self.events.close()


# --------------------------------------------------------------------------- entry point
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
    """
    entered = time.perf_counter()  # the run's wall clock (Trainer.measured_wait)
    # Less fragmentation on long runs near the memory limit (unless the user chose otherwise).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not isinstance(recipe, Recipe):
        recipe = Recipe.from_yaml(recipe, overrides)
    elif overrides:
        recipe = Recipe.from_dict(recipe.to_dict(), overrides)
    if output_dir is not None:
        recipe = recipe.model_copy(update={"output_dir": str(Path(output_dir).expanduser().resolve())})
    from finetuner.training.launch import launch_training, needs_launch

    # A failure before the run writes its first event (the planner, the run folder, the launcher, the
    # trainer's construction) is still recorded in the run's events.jsonl, where it may be written.
    run_folder, events_before = recipe.output_path(), events_size(recipe.output_path())
    writes_events = not needs_launch(recipe) or recipe.distributed.node_rank == 0  # node 0 writes a shared run's events
    try:
        if needs_launch(recipe):  # distributed.*: the same training on several processes (torchrun)
            return launch_training(recipe, callbacks, resume, stop_event, profile_memory, trust_checkpoints)
        from finetuner.planning.bounds import check_before_run
        from finetuner.planning.resolve import resolve_for_run

        from finetuner.planning.data_auto import resolve_data

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
            trainer.resolved = resolved
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
            trainer.answer_samples(result)
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

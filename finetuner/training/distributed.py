"""One rank of a multi-process run: ``python -m finetuner.training.distributed RUN_DIR`` under torchrun.

:mod:`finetuner.training.launch` prepares the run folder and starts torchrun; each process it starts
comes here, reads the resolved ``recipe.yaml`` and trains with :class:`DistributedTrainer`: the
single-process :class:`~finetuner.training.trainer.Trainer` (its step, optimizer step, fp16 loss
scaling, checkpoints, resume and end of run) with these differences, each an override of one of
its hooks:

- **process group**: gloo on CPU, NCCL on GPUs (one GPU per process, ``LOCAL_RANK``);
- **wrapping**: ``ddp`` through accelerate's ``Accelerator`` (torch DDP), ``zero1``/``zero2``/
  ``zero3`` through ``deepspeed.initialize`` with the run folder's ``distributed/deepspeed.json``
  (ZeRO-Offload: optimizer states in CPU memory, stepped by ``DeepSpeedCPUAdam`` or torch AdamW).
  accelerate's own DeepSpeed integration is not used because under torchrun on CPU it sees a
  world of one process (measured with accelerate 1.15);
- **data**: each optimizer step's examples are split across ranks
  (:func:`~finetuner.training.trainer.split_step`), and the loss is the global token-loss sum over
  the global number of trained tokens, so N processes compute the same gradient as one process
  with the same effective batch; the step's loss and tokens (and a preference objective's reward
  sums) are summed over the ranks in one all-reduce, so rank 0 reports the whole step;
- **gradient synchronisation**: under DDP every backward pass runs under ``no_sync`` and, once
  the ranks have agreed that all the step's passes fit, the accumulated gradients are averaged
  over the ranks (an all-reduce in buckets, :func:`average_gradients`): no collective runs inside
  a pass, so a rank that fails in one cannot leave the others waiting in it. A DeepSpeed engine
  is told where the accumulation boundary is and runs its own backward and step (it clips, and
  with fp16 scales the loss, itself). Under DDP the optimizer step is the single-process one,
  fp16 ``GradScaler`` included: the gradients it unscales are already the same on every rank, so
  every rank skips or takes the same steps;
- **rank 0 only** writes ``events.jsonl``, TensorBoard, checkpoints (each rank adds its RNG
  state, and under ZeRO its shard), the adapter and ``metrics.json``; ZeRO-3 parameters are gathered for saving;
- **checkpoints**: every rank adds its own RNG state (``rng_rank{N}.pt``) and resumes with it, so
  its dropout masks after a resume are those of an uninterrupted run; the ranks agree whether
  each could read its parts of a checkpoint before any resumes from it. DDP's are the ordinary
  format; ZeRO's hold ``deepspeed/`` instead of
  ``optimizer.pt`` (the engine's sharded states, one file per rank, see
  :mod:`finetuner.training.checkpoint`) and resume with the same strategy and world size;
- **stopping**: ranks agree every step (an all-reduce) whether any saw ``<run>/.stop`` or a
  signal, so they stop at the same step and save one checkpoint together;
- **out of memory**: after each micro-batch the ranks agree (an all-reduce of a flag) whether any
  of them ran out of memory. Under DDP, if one did, every rank drops the step's gradients, halves
  its micro-batch and doubles its accumulation the same way (the same effective batch and the
  same split of the step's examples) and runs the step again; rank 0 alone writes the
  ``oom_backoff`` event and ``recipe.yaml``. A DeepSpeed engine cannot change course inside a
  step (ZeRO-2 has already reduced the micro-batches' gradients into its partitions, ZeRO-3
  gathers parameters inside the forward pass), so under ZeRO rank 0 writes the backed-off values
  to ``recipe.yaml`` and the ranks end the run together with exit status 3; running the same
  command again resumes from the last checkpoint with them (the launcher writes
  ``deepspeed.json`` from them). An out-of-memory error inside a collective (ZeRO's gathers and
  reductions; DDP has none inside a pass) or in the optimizer step cannot be agreed on: that
  rank ends the run (torchrun stops the others).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetuner.config.recipe import Recipe
from finetuner.errors import OutOfMemory, UserError
from finetuner.training import checkpoint as ckpt_io
from finetuner.training.launch import STOP_FILE
from finetuner.training.trainer import Trainer, build_scheduler

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- pieces
@dataclass(frozen=True)
class RankContext:
    """Where this process stands in the run."""

    rank: int
    world_size: int
    local_rank: int
    cuda: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class AgreedStop:
    """A stop flag all ranks agree on: set on one rank (or the launcher's stop file) stops all.

    :meth:`is_set` is a collective call; the trainer calls it once per step on every rank.
    """

    def __init__(self, run_dir: Path):
        self.stop_file = Path(run_dir) / STOP_FILE
        self.local = threading.Event()

    def set(self) -> None:
        self.local.set()

    def is_set(self) -> bool:
        import torch

        (flag,) = all_reduce_values([1 if (self.local.is_set() or self.stop_file.exists()) else 0], torch.int32, "max")
        return bool(flag)


class _NoEvents:
    """Ranks other than 0 write no events."""

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        return {"event": event, **fields}

    def error(self, exc: BaseException) -> dict[str, Any]:
        return {"event": "error"}

    def close(self) -> None:
        pass


def _disable_deepspeed_shm_allreduce() -> None:
    """Use gloo's all-reduce on CPU instead of DeepSpeed's shared-memory kernel.

    DeepSpeed builds that C++ kernel the first time a CPU process group starts (1-2 minutes on two
    cores); gloo computes the same reduction.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_rank(recipe: Recipe) -> RankContext:
    """Join the process group torchrun set up the environment for."""
    import datetime

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and recipe.device != "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    if recipe.distributed.deepspeed:
        import deepspeed

        if not cuda:
            _disable_deepspeed_shm_allreduce()
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    return RankContext(dist.get_rank(), dist.get_world_size(), local_rank, cuda)


def average_gradients(params, world_size: int, bucket_bytes: int = 64 * 2**20) -> None:
    """Average the gradients of ``params`` over the ranks in place: one all-reduce per bucket of
    about ``bucket_bytes`` (what DDP does in its synchronising backward pass, done here after it)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    bucket: list = []
    size = 0
    for i, g in enumerate(grads):
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes or i == len(grads) - 1 or grads[i + 1].dtype != g.dtype:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat)
            flat /= world_size
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            bucket, size = [], 0


def all_reduce_values(values: list, dtype, op: str = "sum") -> list:
    """A few numbers reduced over the ranks (``op``: ``sum``, ``min`` or ``max``), in one all-reduce.
    The tensor lives where the process group's backend reduces: the current GPU under NCCL (which
    has no CPU tensors), the CPU under gloo."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    stats = torch.tensor(values, dtype=dtype, device=device)
    dist.all_reduce(stats, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return stats.tolist()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


# --------------------------------------------------------------------------- the trainer
class DistributedTrainer(Trainer):
    """:class:`Trainer` on one rank of a DDP or DeepSpeed ZeRO run: only the hooks that differ."""

    def __init__(self, recipe: Recipe, run_dir: Path, ctx: RankContext):
        self.ctx = ctx
        if not ctx.is_main and recipe.logging.tensorboard:
            recipe = recipe.model_copy(update={"logging": recipe.logging.model_copy(update={"tensorboard": False})})
        super().__init__(recipe, run_dir, stop_event=AgreedStop(run_dir))
        self.rank, self.world_size = ctx.rank, ctx.world_size
        if not ctx.is_main:
            self.events.close()
            self.events = _NoEvents()
        self.strategy = recipe.distributed.strategy
        self.engine = None  # the DeepSpeed engine
        self.wrapped = None  # what forward goes through: DDP module or DeepSpeed engine

    def setup(self) -> None:
        super().setup()
        d = self.recipe.distributed
        self.events.emit(
            "distributed",
            strategy=d.strategy,
            offload=d.offload,
            world_size=self.ctx.world_size,
            nodes=d.nodes,
            backend="nccl" if self.ctx.cuda else "gloo",
            engine="deepspeed" if self.engine is not None else f"accelerate ({type(self.wrapped).__name__})",
            optimizer=type(self.optimizer).__name__,
            configs=sorted(str(p) for p in (self.run_dir / "distributed").glob("*.*") if p.suffix != ".log"),
        )

    # ---------------------------------------------------------------- wrapping
    def _distribute(self) -> None:
        """Wrap the step's loss module (called by :meth:`Trainer.setup` before resuming)."""
        if self.rt.is_cuda != self.ctx.cuda:
            raise UserError("device: the ranks and the launcher disagree about using the GPU.")
        if self.recipe.distributed.deepspeed:
            self._wrap_deepspeed()
        else:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=not self.ctx.cuda)
            self.wrapped = self.accelerator.prepare_model(self.step_loss)
        self.step_loss = self.wrapped

    def _wrap_deepspeed(self) -> None:
        import json

        import deepspeed

        d, t = self.recipe.distributed, self.recipe.training
        config = json.loads((self.run_dir / "distributed" / "deepspeed.json").read_text(encoding="utf-8"))
        if d.offload != "none" and d.cpu_adam:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = DeepSpeedCPUAdam(params, lr=t.lr, weight_decay=t.weight_decay, adamw_mode=True)
            self.scheduler = build_scheduler(self.optimizer, t, self.max_steps)
        self.engine, _, _, _ = deepspeed.initialize(model=self.step_loss, optimizer=self.optimizer, config=config)
        self.wrapped = self.engine
        self.scaler = None  # the engine scales an fp16 loss itself (deepspeed.json: "fp16")

    # ---------------------------------------------------------------- one step
    def _gradient_sync(self, last: bool):
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(last)
            return contextlib.nullcontext()
        return self.wrapped.no_sync()  # accumulate locally: _sync_gradients averages once the ranks agree

    def _out_of_memory_anywhere(self, failure: str | None) -> str | None:
        import torch

        # the lowest rank that failed, or world_size
        (failed,) = all_reduce_values([self.rank if failure is not None else self.world_size], torch.int64, "min")
        if failed == self.world_size:
            return None
        return failure if failure is not None else f"out of memory on rank {failed}"

    def _sync_gradients(self) -> None:
        if self.engine is None:
            if getattr(self, "_trainable", None) is None:
                self._trainable = [p for p in self.model.parameters() if p.requires_grad]
            average_gradients(self._trainable, self.world_size)

    def _backward(self, loss) -> None:
        if self.engine is not None:
            self.engine.backward(loss, scale_wrt_gas=False)
        else:
            super()._backward(loss)

    def _optimizer_step(self) -> float | None:
        if self.engine is None:
            return super()._optimizer_step()
        self.engine.step()
        self.scheduler.step()
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        import torch

        return all_reduce_values(values, torch.float64)

    def _back_off(self, step: int, message: str) -> None:
        """All ranks agreed on an out-of-memory error in ``step``: back off like one process (the same
        values on every rank, rank 0 writes them). A DeepSpeed engine cannot continue with them, so
        under ZeRO the run then ends, to resume with them (see the module's docstring)."""
        before = self.recipe.training.micro_batch_size
        super()._back_off(step, message)
        if self.engine is None:
            return
        t = self.recipe.training
        if ckpt_io.latest_checkpoint(self.run_dir) is not None:
            how = "run the same command again: it resumes from the last checkpoint with them"
        else:
            how = (f"no checkpoint is saved yet: run again with --set training.micro_batch_size={t.micro_batch_size} "
                   f"--set training.gradient_accumulation={t.gradient_accumulation}")
        raise OutOfMemory(
            f"Out of device memory in step {step + 1} on {self.world_size} processes (micro_batch_size {before}; {message}). "
            f"A DeepSpeed engine cannot lower its micro-batch while it runs: the run folder's recipe.yaml now has "
            f"micro_batch_size {t.micro_batch_size} and gradient_accumulation {t.gradient_accumulation} (the same "
            f"effective batch); {how}. {self._predicted_note()}".rstrip(),
            hint="Turn on training.gradient_checkpointing, add distributed.offload, or use a shorter data.max_seq_len; "
            "`finetuner plan --gpus N` finds settings that fit.",
        )

    # ---------------------------------------------------------------- outputs
    def _write_json(self, name: str, data: Any) -> None:
        if self.ctx.is_main:
            super()._write_json(name, data)

    def _trainer_state(self, elapsed: float) -> dict[str, Any]:
        return {**super()._trainer_state(elapsed), "world_size": self.ctx.world_size, "strategy": self.strategy}

    @contextlib.contextmanager
    def _gathered(self):
        """ZeRO-3: the full trainable (or, for full fine-tuning, all) parameters on every rank."""
        if self.strategy != "zero3":
            yield
            return
        import deepspeed

        params = [p for p in self.model.parameters() if p.requires_grad or self._full]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield

    def _write_checkpoint(self, elapsed: float) -> Path:
        """Rank 0 starts the staging folder; every rank writes its own RNG state into it (and under ZeRO
        its shard of the engine's state); rank 0 writes the rest (under DDP every rank holds the same
        weights and optimizer states) and publishes the checkpoint once all have written."""
        main = self.ctx.is_main
        tmp = ckpt_io.start_checkpoint(self.run_dir, self.step) if main else ckpt_io.staging_dir(self.run_dir, self.step)
        _barrier()
        if self.engine is not None:
            self.engine.save_checkpoint(str(tmp / ckpt_io.ENGINE_DIR), tag="state", save_latest=False, exclude_frozen_parameters=not self._full)
        if not main:
            ckpt_io.write_rng_state(tmp, self.rank)
        with self._gathered():
            if main:
                ckpt_io.write_checkpoint_parts(
                    tmp, self.model, self.optimizer if self.engine is None else None, self.scheduler, self._trainer_state(elapsed),
                    scaler=self.scaler, recipe_yaml=self.recipe.to_yaml(), midway=self._midway_through_save, rank=self.rank,
                )
        _barrier()
        if main:
            ckpt_io.publish_checkpoint(self.run_dir, self.step, self.recipe.checkpointing.keep_last)
        _barrier()
        return self.run_dir / "checkpoints" / f"step-{self.step:08d}"

    def _read_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        """This rank's parts of ``ckpt`` (its own RNG state); the ranks agree whether all could read
        theirs, so that they all resume from the same checkpoint."""
        import torch

        failure = None
        try:
            parts = ckpt_io.read_checkpoint(ckpt, engine=self.engine is not None, rank=self.rank, world_size=self.world_size)
        except ckpt_io.CheckpointUnreadable as e:
            failure = e
        (failed,) = all_reduce_values([self.rank if failure is not None else self.world_size], torch.int64, "min")
        if failure is not None:
            raise failure
        if failed != self.world_size:
            raise ckpt_io.CheckpointUnreadable(f"{ckpt.name}: unreadable on rank {failed}")
        if self.engine is None:
            return parts
        saved_by = parts["state"].get("world_size")
        if saved_by != self.ctx.world_size:
            raise UserError(
                f"{ckpt} was saved by {saved_by} processes; this run has {self.ctx.world_size}.",
                hint="ZeRO checkpoints shard the optimizer per process: resume with the same --gpus, or --no-resume.",
            )
        return parts

    def _apply_checkpoint(self, ckpt: Path, parts: dict[str, Any]) -> dict[str, Any]:
        if self.engine is not None:  # the weights and the optimizer's shards
            self.engine.load_checkpoint(
                str(ckpt / ckpt_io.ENGINE_DIR), tag="state", load_module_strict=False, load_lr_scheduler_states=False
            )
        return super()._apply_checkpoint(ckpt, parts)

    def save_final(self) -> Path:
        with self._gathered():
            final = super().save_final() if self.ctx.is_main else self.run_dir / "adapter"
        _barrier()
        return final

    def cleanup(self) -> None:
        """Close the event and TensorBoard writers, then take this rank out of the run in order:
        the DeepSpeed engine releases its hooks, buffers and optimizer (DeepSpeedCPUAdam's C++
        state), and the rank leaves the process group (:func:`leave_process_group`), all while the
        interpreter is whole."""
        super().cleanup()
        if self.engine is not None:
            self.engine.destroy()
        leave_process_group()


def leave_process_group() -> None:
    """Destroy the process group before the interpreter shuts down.

    A rank that exits with its process group alive leaves gloo's worker threads holding finished
    work and the tensors it used; freeing such a tensor once Python has begun tearing itself down
    needs the GIL that is no longer there, and the process dies with SIGABRT after the run is done
    (pytorch/pytorch#179291 describes it; torch does not destroy the group at exit by itself, and
    its documentation asks every process to call ``destroy_process_group``). Finished work is
    collected first, so its handles go while Python can still release them.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- entry point
def _die_with_torchrun() -> None:
    """SIGKILL this rank if torchrun (its parent) dies: no orphan holding memory (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_torchrun()
    faulthandler.enable()  # a rank that dies by a signal leaves every thread's Python stack in launch.log
    run_dir = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING if rank == 0 else logging.ERROR, format=f"[rank {rank}] %(levelname)s: %(message)s")
    from finetuner.quiet import quiet_libraries

    quiet_libraries()
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    recipe = Recipe.from_yaml(run_dir / "recipe.yaml")
    ctx = init_rank(recipe)
    trainer = DistributedTrainer(recipe, run_dir, ctx)
    # SIGINT/SIGTERM sent to a rank itself: stop with the others after this step
    signal.signal(signal.SIGINT, lambda *_: trainer.stop_event.set())
    try:
        trainer.setup()
        result = trainer.train()
        if ctx.is_main and recipe.samples.prompts and not result.stopped:
            if trainer.strategy == "zero3":
                log.warning("Samples are not generated for zero3 runs (the parameters are sharded); load the adapter to try it.")
            else:
                from finetuner.fileio import atomic_write_json
                from finetuner.infer.generate import compare_samples

                samples = compare_samples(trainer.model, trainer.tokenizer, trainer.data.chat_template, recipe.samples, trainer.rt)
                result.metrics["samples"] = samples
                atomic_write_json(run_dir / "metrics.json", result.metrics)
                trainer.events.emit("samples", samples=samples)
        return 0
    except UserError as e:
        trainer.events.error(e)
        log.error("%s", e)
        return 2
    except Exception as e:
        trainer.events.error(e)
        raise
    finally:
        trainer.cleanup()


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a multi-process run: ``python -m finetuner.training.distributed RUN_DIR`` under torchrun.

:mod:`finetuner.training.launch` prepares the run folder and starts torchrun; each process it starts
comes here, reads the resolved ``recipe.yaml`` and trains with :class:`DistributedTrainer`: the
single-process :class:`~finetuner.training.trainer.Trainer` (its step, optimizer step, fp16 loss
scaling, checkpoints, resume and end of run) with these differences, each an override of one of
its hooks. Where strategies differ the trainer asks the run's strategy object, one module each in
:mod:`finetuner.training.strategies` (keyed by ``distributed.strategy``), and never asks which runs:

- **process group**: gloo on CPU, NCCL on GPUs (one GPU per process, ``LOCAL_RANK``);
- **wrapping** (``Strategy.wrap``): ``ddp`` through accelerate's ``Accelerator`` (torch DDP,
  :mod:`~finetuner.training.strategies.ddp`); ``zero1``/``zero2``/``zero3`` through
  ``deepspeed.initialize`` (:mod:`~finetuner.training.strategies.zero`); ``fsdp`` through torch's
  FSDP2 ``fully_shard``, one unit per decoder layer (:mod:`~finetuner.training.strategies.fsdp`,
  which also checks that QLoRA's 4-bit weights stay 4-bit once sharded);
- **data**: each optimizer step's examples are split across ranks
  (:func:`~finetuner.training.schedule.split_step`), and the loss is the global token-loss sum over
  the global number of trained tokens, so N processes compute the same gradient as one process
  with the same effective batch; the step's loss and tokens (and a preference objective's reward
  sums) are summed over the ranks in one all-reduce, so rank 0 reports the whole step;
- **gradient synchronisation** (``Strategy.gradient_sync``, ``backward``, ``sync_gradients``,
  ``optimizer_step``): DDP runs every pass under ``no_sync`` and averages once the ranks have
  agreed that all the step's passes fit; a DeepSpeed engine runs its own backward and step; FSDP
  reduce-scatters in each pass and clips by the norm of the whole gradient;
- **rank 0 only** writes ``events.jsonl``, TensorBoard, checkpoints, the adapter and
  ``metrics.json``; sharded weights (ZeRO-3, FSDP) are gathered for saving (``Strategy.gathered``),
  so the adapter is always a normal peft folder. A rank that fails says why on its output too
  (:func:`~finetuner.training.rank_output.report_failure`), which the launcher reads: its error
  reaches the user when rank 0 could not write it (another rank failed first, a full disk);
- **checkpoints**: every rank adds its own RNG state (``rng_rank{N}.pt``) and its share of the
  strategy's sharded state (``Strategy.write_shards``: ZeRO's ``deepspeed/``, FSDP's ``fsdp/``
  through ``torch.distributed.checkpoint``) and resumes with them; the ranks agree whether each
  could read its parts of a checkpoint before any resumes from it. DDP's are the ordinary format;
  sharded ones resume with the same strategy and world size, and only when rank 0 finds them sealed
  by this user (:mod:`finetuner.training.seal`: resuming them unpickles; ``--trust-checkpoints`` opts in);
- **stopping**: ranks agree every step (an all-reduce) whether any saw ``<run>/.stop`` or a
  signal, so they stop at the same step and save one checkpoint together;
- **out of memory**: after each micro-batch the ranks agree (an all-reduce of a flag) whether any
  of them ran out of memory. If one did, every rank drops the step's gradients, halves its
  micro-batch and doubles its accumulation the same way (the same effective batch and the same
  split of the step's examples) and runs the step again (DDP, FSDP); rank 0 alone writes the
  ``oom_backoff`` event and ``recipe.yaml``. A DeepSpeed engine cannot change course inside a
  step, so under ZeRO the ranks end the run together with exit status 3 and the same command
  resumes from the last checkpoint with the backed-off values (``Strategy.after_back_off``). An
  out-of-memory error inside a collective (ZeRO's and FSDP's gathers and reductions; DDP has none
  inside a pass) or in the optimizer step cannot be agreed on: that rank ends the run (torchrun
  stops the others).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import finetuner.device as dev
from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.training import checkpoint as ckpt_io
from finetuner.training import seal
from finetuner.training.launch import STOP_FILE
from finetuner.training.rank_output import report_failure
from finetuner.training.strategies import Strategy, strategy_class
from finetuner.training.run import record_error
from finetuner.training.samples import answer_samples
from finetuner.training.trainer import Trainer

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

    def asked_here(self) -> bool:
        """Whether this rank was asked to stop (its flag, the stop file): no collective call."""
        return self.local.is_set() or self.stop_file.exists()

    def is_set(self) -> bool:
        import torch

        (flag,) = all_reduce_values([1 if self.asked_here() else 0], torch.int32, "max")
        return bool(flag)


class _NoEvents:
    """Ranks other than 0 write no events."""

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        return {"event": event, **fields}

    def error(self, exc: BaseException) -> dict[str, Any]:
        return {"event": "error"}

    def close(self) -> None:
        pass


def init_rank(recipe: Recipe) -> RankContext:
    """Join the process group torchrun set up the environment for."""
    import datetime

    import torch.distributed as dist

    cuda = recipe.device != dev.CPU and dev.available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        dev.use(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=dev.backend(dev.CUDA if cuda else dev.CPU), timeout=datetime.timedelta(minutes=30))
    strategy_class(recipe.distributed.strategy).join(cuda)
    return RankContext(dist.get_rank(), dist.get_world_size(), local_rank, cuda)


def all_reduce_values(values: list, dtype, op: str = "sum") -> list:
    """A few numbers reduced over the ranks (``op``: ``sum``, ``min`` or ``max``), in one all-reduce.
    The tensor lives where the process group's backend reduces: the current GPU under NCCL (which
    has no CPU tensors), the CPU under gloo."""
    import torch
    import torch.distributed as dist

    device = dev.reduce_device(dist.get_backend())
    stats = torch.tensor(values, dtype=dtype, device=device)
    dist.all_reduce(stats, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return stats.tolist()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


# --------------------------------------------------------------------------- the trainer
class DistributedTrainer(Trainer):
    """:class:`Trainer` on one rank of a multi-process run: only the hooks that differ, each asking
    the run's :class:`~finetuner.training.strategies.base.Strategy` where strategies differ."""

    def __init__(self, recipe: Recipe, run_dir: Path, ctx: RankContext):
        self.ctx = ctx
        if not ctx.is_main and recipe.logging.trackers:  # only rank 0 reports (TensorBoard, MLflow, W&B, Trackio)
            recipe = recipe.model_copy(update={"logging": recipe.logging.model_copy(update={"report_to": [], "tensorboard": None})})
        super().__init__(recipe, run_dir, stop_event=AgreedStop(run_dir))
        self.rank, self.world_size = ctx.rank, ctx.world_size
        if not ctx.is_main:
            self.events.close()
            self.events = _NoEvents()
        self.strategy: Strategy = strategy_class(recipe.distributed.strategy)(self)
        self.wrapped = None  # what forward goes through: the strategy's wrapping of the step's loss module

    def base_placement(self) -> str | None:
        return self.strategy.base_placement()

    def setup(self) -> None:
        if self.ctx.is_main and self.strategy.unpickles_checkpoints:
            seal.private_key()  # a damaged or readable sealing key stops the run before the model loads, not at its first save
        super().setup()
        d = self.recipe.distributed
        self.events.emit(
            "distributed",
            strategy=d.strategy,
            offload=d.offload,
            world_size=self.ctx.world_size,
            nodes=d.nodes,
            backend="nccl" if self.ctx.cuda else "gloo",
            engine=self.strategy.describe(),
            **self.strategy.event_fields(),
            optimizer=type(self.optimizer).__name__,
            configs=sorted(str(p) for p in (self.run_dir / "distributed").glob("*.*") if p.suffix != ".log"),
        )

    # ---------------------------------------------------------------- wrapping
    def _distribute(self) -> None:
        """Wrap the step's loss module (called by :meth:`Trainer.setup` before resuming)."""
        if self.rt.is_cuda != self.ctx.cuda:
            raise UserError("device: the ranks and the launcher disagree about using the GPU.")
        self.wrapped = self.strategy.wrap(self.step_loss)
        self.step_loss = self.wrapped

    # ---------------------------------------------------------------- one step
    def _gradient_sync(self, last: bool):
        return self.strategy.gradient_sync(last)

    def _out_of_memory_anywhere(self, failure: str | None) -> str | None:
        import torch

        # the lowest rank that failed, or world_size
        (failed,) = all_reduce_values([self.rank if failure is not None else self.world_size], torch.int64, "min")
        if failed == self.world_size:
            return None
        return failure if failure is not None else f"out of memory on rank {failed}"

    def _sync_gradients(self) -> None:
        self.strategy.sync_gradients()

    def evaluation(self):
        return self.strategy.whole_forward()

    def _backward(self, loss) -> None:
        self.strategy.backward(loss)

    def _optimizer_step(self) -> float | None:
        return self.strategy.optimizer_step()

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        import torch

        return all_reduce_values(values, torch.float64)

    def _stop_asked_here(self) -> bool:
        return self.stop_event.asked_here()

    def _agreed(self, flag: bool) -> bool:
        import torch

        (any_rank,) = all_reduce_values([1 if flag else 0], torch.int32, "max")
        return bool(any_rank)

    def _back_off(self, step: int, message: str) -> None:
        """All ranks agreed on an out-of-memory error in ``step``: back off like one process (the same
        values on every rank, rank 0 writes them); the strategy ends the run if it cannot go on with them."""
        before = self.recipe.training.micro_batch_size
        super()._back_off(step, message)
        self.strategy.after_back_off(step, before, message)

    # ---------------------------------------------------------------- outputs
    def _write_json(self, name: str, data: Any) -> None:
        if self.ctx.is_main:
            super()._write_json(name, data)

    def _trainer_state(self, elapsed: float) -> dict[str, Any]:
        return {**super()._trainer_state(elapsed), "world_size": self.ctx.world_size, "strategy": self.recipe.distributed.strategy}

    def _write_checkpoint(self, elapsed: float) -> Path:
        """Rank 0 starts the staging folder; every rank writes its own RNG state into it (and its share
        of the strategy's sharded state); rank 0 writes the rest and publishes the checkpoint once all
        have written."""
        main = self.ctx.is_main
        tmp = ckpt_io.start_checkpoint(self.run_dir, self.step) if main else ckpt_io.staging_dir(self.run_dir, self.step)
        _barrier()
        try:
            return self._write_staged(tmp, elapsed, main)
        except Exception as e:  # a full disk, say: rank 0 gives the half-written checkpoint's space back (the others end with it)
            if main:
                from finetuner.fileio import give_back

                give_back(tmp, e)
            raise

    def _write_staged(self, tmp: Path, elapsed: float, main: bool) -> Path:
        self.strategy.write_shards(tmp)
        if not main:
            ckpt_io.write_rng_state(tmp, self.rank)
        with self.strategy.gathered() as weights:
            if main:
                ckpt_io.write_checkpoint_parts(
                    tmp, self.model, self.optimizer if self.strategy.saves_optimizer else None, self.scheduler,
                    self._trainer_state(elapsed), scaler=self.scaler, recipe_yaml=self.recipe.to_yaml(),
                    midway=self._midway_through_save, rank=self.rank, weights=weights,
                )
        _barrier()
        if main:
            if self.strategy.unpickles_checkpoints:  # every rank has written its share: seal what a resume unpickles
                seal.write(tmp)
            ckpt_io.publish_checkpoint(self.run_dir, self.step, self.recipe.checkpointing.keep_last)
        _barrier()
        return self.run_dir / "checkpoints" / f"step-{self.step:08d}"

    def _read_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        """This rank's parts of ``ckpt`` (its own RNG state); the ranks agree whether all could read
        theirs, so that they all resume from the same checkpoint."""
        import torch

        self._check_seal(ckpt)
        failure = None
        try:
            parts = self.strategy.read_parts(ckpt)
        except ckpt_io.CheckpointUnreadable as e:
            failure = e
        (failed,) = all_reduce_values([self.rank if failure is not None else self.world_size], torch.int64, "min")
        if failure is not None:
            raise failure
        if failed != self.world_size:
            raise ckpt_io.CheckpointUnreadable(f"{ckpt.name}: unreadable on rank {failed}")
        return parts

    def _check_seal(self, ckpt: Path) -> None:
        """Before any rank unpickles a sharded checkpoint: rank 0 checks its seal (:func:`seal.check`) and
        the ranks agree on the verdict: go on, take the checkpoint before (a file changed since it was
        written), or stop (not sealed by this user, and not trusted)."""
        import torch

        if not self.strategy.unpickles_checkpoints:
            return
        verdict, error = 0, None
        if self.ctx.is_main:
            try:
                seal.check(ckpt)
            except ckpt_io.CheckpointUnreadable as e:
                verdict, error = 1, e
            except seal.NotOurs as e:
                verdict, error = 2, e
        (agreed,) = all_reduce_values([verdict], torch.int64, "max")
        if error is not None:
            raise error
        if agreed == 1:
            raise ckpt_io.CheckpointUnreadable(f"{ckpt.name}: changed since it was written (rank 0 checked its seal)")
        if agreed == 2:
            raise seal.NotOurs(f"{ckpt} is not sealed by this user (rank 0 checked it).")

    def _apply_checkpoint(self, ckpt: Path, parts: dict[str, Any]) -> dict[str, Any]:
        self.strategy.load_shards(ckpt, parts)
        return super()._apply_checkpoint(ckpt, parts)

    def save_final(self, weights: dict[str, Any] | None = None, name: str = "adapter") -> Path:
        """Rank 0 saves the weights the strategy gathered (``weights`` is for one process only)."""
        with self.strategy.gathered() as gathered:
            final = super().save_final(gathered, name) if self.ctx.is_main else self.run_dir / name
        _barrier()
        return final

    def cleanup(self) -> None:
        """Close the event and TensorBoard writers, then take this rank out of the run in order:
        the strategy releases its engine (hooks, buffers, optimizer: DeepSpeedCPUAdam's C++
        state), and the rank leaves the process group (:func:`leave_process_group`), all while the
        interpreter is whole."""
        super().cleanup()
        if self.wrapped is not None:
            self.strategy.close()
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
            if not trainer.strategy.whole_model_on_rank0:
                log.warning("Samples are not generated for %s runs (the parameters are sharded); load the adapter to try it.",
                            recipe.distributed.strategy)
            else:
                answer_samples(trainer, result)
        return 0
    except UserError as e:
        _report(trainer, e)
        log.error("%s", e)
        if not ctx.is_main:
            wait_for_the_error_event(run_dir / "events.jsonl")
        return 2
    except Exception as e:
        _report(trainer, e)
        raise
    finally:
        trainer.cleanup()


def _report(trainer: DistributedTrainer, error: BaseException) -> None:
    """Report why this rank stops: to the launcher through the ranks' output (:func:`report_failure`: no disk
    on the way), and, on rank 0, as the run's ``error`` event where the run folder's disk can take it."""
    report_failure(error, trainer.rank)
    record_error(trainer, error)


#: how long a rank other than 0 waits, on a stop all ranks agreed on, for rank 0 to write the run's error event
ERROR_EVENT_WAIT_S = 10.0


def wait_for_the_error_event(events: Path, timeout: float = ERROR_EVENT_WAIT_S) -> bool:
    """Whether rank 0 wrote the run's error event within ``timeout`` seconds. A rank that exits first on a stop the
    ranks agreed on (an out-of-memory step under ZeRO) makes torchrun end the others at once: rank 0 could be ended
    before it wrote the event the launcher reads the stop from (seen in CI: exit 2 instead of 3). An error of this
    rank alone waits the whole ``timeout``, once, on its way out."""
    import time

    from finetuner.runs.events import read_events

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(e.get("event") == "error" for e in read_events(events)):
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return False


if __name__ == "__main__":
    sys.exit(main())

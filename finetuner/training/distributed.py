"""One rank of a multi-process run: ``python -m finetuner.training.distributed RUN_DIR`` under torchrun.

:mod:`finetuner.training.launch` prepares the run folder and starts torchrun; each process it starts
comes here, reads the resolved ``recipe.yaml`` and trains with :class:`DistributedTrainer`, the
single-process :class:`~finetuner.training.trainer.Trainer` with these differences:

- **process group**: gloo on CPU, NCCL on GPUs (one GPU per process, ``LOCAL_RANK``);
- **wrapping**: ``ddp`` through accelerate's ``Accelerator`` (torch DDP), ``zero1``/``zero2``/
  ``zero3`` through ``deepspeed.initialize`` with the run folder's ``distributed/deepspeed.json``
  (ZeRO-Offload: optimizer states in CPU memory, stepped by ``DeepSpeedCPUAdam`` or torch AdamW).
  accelerate's own DeepSpeed integration is not used because under torchrun on CPU it sees a
  world of one process (measured with accelerate 1.15);
- **data**: each optimizer step's examples are split across ranks (whole micro-batches when
  their number divides by the world size, else contiguous shares cut into micro-batches), every
  rank runs the same number of forward/backward passes (a missing one is a zero-weight pass), and
  the loss is the global token-loss sum over the global number of trained tokens, so N processes
  compute the same gradient as one process with the same effective batch;
- **rank 0 only** writes ``events.jsonl``, TensorBoard, checkpoints, the adapter and
  ``metrics.json``; ZeRO-3 parameters are gathered for saving;
- **checkpoints**: DDP's are the ordinary format; ZeRO's add ``deepspeed/`` (the engine's
  sharded optimizer states, one file per rank) and resume with the same strategy and world size;
- **stopping**: ranks agree every step (an all-reduce) whether any saw ``<run>/.stop`` or a
  signal, so they stop at the same step and save one checkpoint together.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetuner.data.pipeline import IGNORE_INDEX
from finetuner.errors import UserError
from finetuner.training.launch import STOP_FILE
from finetuner.model.offload import save_on_cpu
from finetuner.config.recipe import Recipe
from finetuner.training.trainer import Trainer, token_loss_sum

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


def split_step(n_examples: int, micro_batch_size: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Each rank's micro-batches of one optimizer step, as ``(start, end)`` slices of its examples.

    The single-process trainer cuts the step's examples into micro-batches of
    ``micro_batch_size``. When their number divides by ``world_size``, rank ``r`` takes
    micro-batches ``r, r + W, ...`` (the same micro-batches, just spread out); otherwise the
    examples are cut into ``W`` contiguous shares (sizes differ by at most one) and each share
    into micro-batches. Ranks may get different numbers of micro-batches (or none).
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


class _StepLoss:
    """Built lazily (needs torch): the module DDP/DeepSpeed wrap, so their hooks see every forward."""

    @staticmethod
    def build(model, chunk_size: int, fused_ce):
        import torch

        class StepLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, batch: dict[str, Any]):
                loss_sum, _ = token_loss_sum(self.model, batch, chunk_size, fused_ce)
                return loss_sum

        return StepLoss()


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
        import torch.distributed as dist

        flag = torch.tensor([1 if (self.local.is_set() or self.stop_file.exists()) else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class _NoEvents:
    """Ranks other than 0 write no events."""

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        return {"event": event, **fields}

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


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


# --------------------------------------------------------------------------- the trainer
class DistributedTrainer(Trainer):
    """:class:`Trainer` on one rank of a DDP or DeepSpeed ZeRO run."""

    def __init__(self, recipe: Recipe, run_dir: Path, ctx: RankContext):
        self.ctx = ctx
        if not ctx.is_main and recipe.logging.tensorboard:
            recipe = recipe.model_copy(update={"logging": recipe.logging.model_copy(update={"tensorboard": False})})
        super().__init__(recipe, run_dir, stop_event=AgreedStop(run_dir))
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
        """Wrap the model (called by :meth:`Trainer.setup` before resuming)."""
        if self.rt.is_cuda != self.ctx.cuda:
            raise UserError("device: the ranks and the launcher disagree about using the GPU.")
        step_loss = _StepLoss.build(self.model, self.recipe.training.loss_chunk_size, getattr(self, "fused_ce", None))
        if self.recipe.distributed.deepspeed:
            self._wrap_deepspeed(step_loss)
        else:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=not self.ctx.cuda)
            self.wrapped = self.accelerator.prepare_model(step_loss)

    def _wrap_deepspeed(self, step_loss) -> None:
        import json

        import deepspeed

        from finetuner.training.trainer import build_scheduler

        d, t = self.recipe.distributed, self.recipe.training
        config = json.loads((self.run_dir / "distributed" / "deepspeed.json").read_text(encoding="utf-8"))
        if d.offload != "none" and d.cpu_adam:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = DeepSpeedCPUAdam(params, lr=t.lr, weight_decay=t.weight_decay, adamw_mode=True)
            self.scheduler = build_scheduler(self.optimizer, t, self.max_steps)
        self.engine, _, _, _ = deepspeed.initialize(model=step_loss, optimizer=self.optimizer, config=config)
        self.wrapped = self.engine

    # ---------------------------------------------------------------- one step
    def train_step(self, step: int) -> tuple[float, int, float | None]:
        """One optimizer step over this rank's share of the step's micro-batches."""
        import torch
        import torch.distributed as dist

        t = self.recipe.training
        W = self.ctx.world_size
        examples = [self.data.train[i] for i in self.schedule.indices(step)]
        shares = split_step(len(examples), t.micro_batch_size, W)
        mine, n_passes = shares[self.ctx.rank], max(len(s) for s in shares)
        n_target = sum(int((self.collate([ex])["labels"][:, 1:] != IGNORE_INDEX).sum()) for ex in examples)
        total_loss, tokens = 0.0, 0
        self.model.train()
        for k in range(n_passes):
            real = k < len(mine)
            start, end = mine[k] if real else (0, 1)  # a zero-weight pass keeps the collectives in step
            mb = self._to_device(self.collate(examples[start:end]))
            last = k == n_passes - 1
            if self.engine is not None:
                self.engine.set_gradient_accumulation_boundary(last)
            with self._sync(last), self._autocast(), save_on_cpu(t.offload_activations and not t.gradient_checkpointing, self.rt.is_cuda):
                loss_sum = self.wrapped(mb)
                # DDP and ZeRO average gradients over the ranks: scale by W to get the global sum
                loss = loss_sum * ((W if real else 0) / max(n_target, 1))
                if self.engine is not None:
                    self.engine.backward(loss, scale_wrt_gas=False)
                else:
                    loss.backward()
            if real:
                total_loss += float(loss_sum.detach())
                tokens += mb["num_tokens"]
            del loss, loss_sum, mb
            if k == 0:
                self.faults.in_step(step + 1)
        grad_norm = self._optimizer_step()
        self.scheduler.step()
        stats = torch.tensor([total_loss, float(tokens)], dtype=torch.float64)
        dist.all_reduce(stats)
        return float(stats[0]) / max(n_target, 1), int(stats[1]), grad_norm

    def _sync(self, last: bool):
        if self.engine is None and not last:
            return self.wrapped.no_sync()  # accumulate locally; the last pass all-reduces
        return contextlib.nullcontext()

    def _optimizer_step(self) -> float | None:
        import torch

        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return None if norm is None else float(norm)
        t = self.recipe.training
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

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

    def save_checkpoint(self, elapsed: float) -> Path:
        if self.engine is None:  # DDP: every rank holds the same state; rank 0 saves it
            path = super().save_checkpoint(elapsed) if self.ctx.is_main else None
            _barrier()
            return path or self.run_dir / "checkpoints" / f"step-{self.step:08d}"
        return self._save_deepspeed_checkpoint(elapsed)

    def _save_deepspeed_checkpoint(self, elapsed: float) -> Path:
        import torch

        from finetuner.training import checkpoint as ckpt_io
        from finetuner.fileio import atomic_write_json, publish_dir

        root = self.run_dir / "checkpoints"
        final, tmp = root / f"step-{self.step:08d}", root / f".tmp-step-{self.step:08d}"
        if self.ctx.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        self.engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=not self._full)
        with self._gathered():
            if self.ctx.is_main:
                self.model.save_pretrained(tmp / "adapter", safe_serialization=True)
        _barrier()
        if self.ctx.is_main:
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save({"cpu": torch.get_rng_state()}, tmp / "rng.pt")
            (tmp / "recipe.yaml").write_text(self.recipe.to_yaml(), encoding="utf-8")
            atomic_write_json(tmp / "trainer_state.json", self._trainer_state(elapsed))
            if final.exists():
                shutil.rmtree(final)
            publish_dir(tmp, final)
            for old in ckpt_io.checkpoint_dirs(self.run_dir)[: -self.recipe.checkpointing.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            self.events.emit("checkpoint", step=self.step, path=str(final))
        _barrier()
        return final

    def _resume(self) -> None:
        if self.engine is None:
            return super()._resume()
        import torch

        from finetuner.training import checkpoint as ckpt_io

        for ckpt in reversed(ckpt_io.checkpoint_dirs(self.run_dir)):
            state = ckpt_io.load_trainer_state(ckpt)
            if not (ckpt / "deepspeed").is_dir():
                self.events.emit("checkpoint_invalid", path=str(ckpt), reason="not a DeepSpeed checkpoint")
                continue
            if state.get("world_size") != self.ctx.world_size:
                raise UserError(
                    f"{ckpt} was saved by {state.get('world_size')} processes; this run has {self.ctx.world_size}.",
                    hint="ZeRO checkpoints shard the optimizer per process: resume with the same --gpus, or --no-resume.",
                )
            self.engine.load_checkpoint(
                str(ckpt / "deepspeed"), tag="state", load_module_strict=False, load_lr_scheduler_states=False
            )
            self.scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
            torch.set_rng_state(torch.load(ckpt / "rng.pt", weights_only=True)["cpu"])
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            self.elapsed_before, self.losses = state["elapsed_s"], state["losses"]
            self.resumed_from = self.step
            return

    def save_final(self) -> Path:
        with self._gathered():
            final = super().save_final() if self.ctx.is_main else self.run_dir / "adapter"
        _barrier()
        return final


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
        trainer.events.emit("error", message=str(e), type=type(e).__name__, user_error=True)
        log.error("%s", e)
        return 2
    except Exception as e:
        trainer.events.emit("error", message=f"{type(e).__name__}: {e}", type=type(e).__name__, user_error=False)
        raise
    finally:
        trainer.cleanup()


if __name__ == "__main__":
    sys.exit(main())

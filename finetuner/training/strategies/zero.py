"""``zero1``/``zero2``/``zero3``: DeepSpeed ZeRO through ``deepspeed.initialize``.

The run folder's ``distributed/deepspeed.json`` (written by the launcher) configures the engine;
with ZeRO-Offload the optimizer states live in CPU memory, stepped by ``DeepSpeedCPUAdam`` or
torch AdamW. accelerate's own DeepSpeed integration is not used because under torchrun on CPU it
sees a world of one process (measured with accelerate 1.15). The engine is told where the
accumulation boundary is and runs its own backward and step (it clips, and with fp16 scales the
loss, itself). It cannot lower its micro-batch while it runs: after an out-of-memory back-off the
run ends and the same command resumes with the new values. Checkpoints hold ``deepspeed/`` (the
engine's sharded states, one file per rank) instead of ``optimizer.pt``, and resume with the same
strategy and number of processes.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, ClassVar, Iterator

from finetuner.errors import OutOfMemory
from finetuner.strategy_table import DEEPSPEED_ENGINE, names_run_by, strategy_row
from finetuner.training import checkpoint as ckpt_io
from finetuner.training.strategies.base import Strategy, check_same_world

def _disable_deepspeed_shm_allreduce() -> None:
    """Use gloo's all-reduce on CPU instead of DeepSpeed's shared-memory kernel.

    DeepSpeed builds that C++ kernel the first time a CPU process group starts (1-2 minutes on two
    cores); gloo computes the same reduction.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class Zero(Strategy):
    """DeepSpeed ZeRO stage 1, 2 or 3 (``distributed.strategy``)."""

    names: ClassVar[tuple[str, ...]] = names_run_by(DEEPSPEED_ENGINE)

    @property
    def stage(self) -> int:
        return strategy_row(self.trainer.recipe.distributed.strategy).zero_stage

    @property
    def whole_model_on_rank0(self) -> bool:  # type: ignore[override]
        return self.stage < 3

    @classmethod
    def join(cls, cuda: bool) -> None:
        import deepspeed

        if not cuda:
            _disable_deepspeed_shm_allreduce()
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")

    def wrap(self, step_loss):
        import deepspeed

        from finetuner.training.optimizer import build_scheduler

        tr = self.trainer
        d, t = tr.recipe.distributed, tr.recipe.training
        config = json.loads((tr.run_dir / "distributed" / "deepspeed.json").read_text(encoding="utf-8"))
        if d.offload != "none" and d.cpu_adam:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            tr.optimizer = DeepSpeedCPUAdam(tr.trainable_params(), lr=t.lr, weight_decay=t.weight_decay, adamw_mode=True)
            tr.scheduler = build_scheduler(tr.optimizer, t, tr.max_steps)
        self.engine, _, _, _ = deepspeed.initialize(model=step_loss, optimizer=tr.optimizer, config=config)
        tr.scaler = None  # the engine scales an fp16 loss itself (deepspeed.json: "fp16")
        return self.engine

    def describe(self) -> str:
        return "deepspeed"

    def gradient_sync(self, last: bool):
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> float | None:
        self.engine.step()
        self.trainer.scheduler.step()
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def after_back_off(self, step: int, micro_before: int, message: str) -> None:
        tr = self.trainer
        t = tr.recipe.training
        if ckpt_io.latest_checkpoint(tr.run_dir) is not None:
            how = "run the same command again: it resumes from the last checkpoint with them"
        else:
            how = (f"no checkpoint is saved yet: run again with --set training.micro_batch_size={t.micro_batch_size} "
                   f"--set training.gradient_accumulation={t.gradient_accumulation}")
        raise OutOfMemory(
            f"Out of device memory in step {step + 1} on {tr.world_size} processes (micro_batch_size {micro_before}; {message}). "
            f"A DeepSpeed engine cannot lower its micro-batch while it runs: the run folder's recipe.yaml now has "
            f"micro_batch_size {t.micro_batch_size} and gradient_accumulation {t.gradient_accumulation} (the same "
            f"effective batch); {how}. {tr.predicted_note()}".rstrip(),
            hint="Turn on training.gradient_checkpointing, add distributed.offload, or use a shorter data.max_seq_len; "
            "`finetuner plan --gpus N` finds settings that fit.",
        )

    # ---------------------------------------------------------------- saving and resuming
    @contextlib.contextmanager
    def gathered(self) -> Iterator[dict[str, Any] | None]:
        """ZeRO-3: the full trainable (or, for full fine-tuning, all) parameters on every rank."""
        if self.stage < 3:
            yield None
            return
        import deepspeed

        tr = self.trainer
        params = [p for p in tr.model.parameters() if p.requires_grad or tr.recipe.method == "full"]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield None

    @property
    def saves_optimizer(self) -> bool:
        return False

    unpickles_checkpoints = True  # .metadata and byte items (DCP), state files (DeepSpeed): pickles

    def write_shards(self, tmp: Path) -> None:
        self.engine.save_checkpoint(str(tmp / ckpt_io.ENGINE_DIR), tag="state", save_latest=False,
                                    exclude_frozen_parameters=self.trainer.recipe.method != "full")

    def read_parts(self, ckpt: Path) -> dict[str, Any]:
        tr = self.trainer
        return ckpt_io.read_checkpoint(ckpt, engine=True, rank=tr.rank, world_size=tr.world_size)

    def load_shards(self, ckpt: Path, parts: dict[str, Any]) -> None:
        check_same_world(ckpt, parts, self.trainer.world_size, "ZeRO checkpoints shard the optimizer per process")
        self.engine.load_checkpoint(str(ckpt / ckpt_io.ENGINE_DIR), tag="state", load_module_strict=False,
                                    load_lr_scheduler_states=False)

    def close(self) -> None:
        self.engine.destroy()

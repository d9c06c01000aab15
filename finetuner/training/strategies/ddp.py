"""``ddp``: every rank holds the whole model; torch DDP through accelerate, gradients averaged once per step."""

from __future__ import annotations

from typing import ClassVar

from finetuner.strategy_table import DDP_ENGINE, names_run_by
from finetuner.training.strategies.base import Strategy


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


class DDP(Strategy):
    """Every backward pass runs under ``no_sync``; once the ranks have agreed that all the step's
    passes fit, the accumulated gradients are averaged (:func:`average_gradients`), so no
    collective runs inside a pass. The optimizer step is the single-process one (fp16
    ``GradScaler`` included: the gradients it unscales are the same on every rank)."""

    names: ClassVar[tuple[str, ...]] = names_run_by(DDP_ENGINE)

    def wrap(self, step_loss):
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=not self.trainer.ctx.cuda)
        self.wrapped = self.accelerator.prepare_model(step_loss)
        return self.wrapped

    def describe(self) -> str:
        return f"accelerate ({type(self.wrapped).__name__})"

    def gradient_sync(self, last: bool):
        return self.wrapped.no_sync()  # accumulate locally: sync_gradients averages once the ranks agree

    def sync_gradients(self) -> None:
        average_gradients(self.trainer.trainable_params(), self.trainer.world_size)

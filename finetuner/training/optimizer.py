"""The optimizer a recipe names, its learning-rate schedule, and one optimizer step: what every trainer steps
through, on one process or on several (:mod:`finetuner.training.strategies`)."""

from __future__ import annotations

import math

from finetuner.config.sections import TrainingSection
from finetuner.errors import UserError


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


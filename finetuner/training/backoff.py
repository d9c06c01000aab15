"""The out-of-memory back-off: a step that runs out of device memory is tried again with half the micro-batch and
twice the accumulation (the same effective batch), until it fits or the micro-batch is 1 already.

The trainer's loop steps through :func:`train_step_with_backoff`; :func:`back_off` is what one process does
after the error (:meth:`Trainer._back_off <finetuner.training.trainer.Trainer._back_off>`, which several
processes extend), and :func:`free_after_oom` gives back what the failed attempt held. ``trainer``: the run's
:class:`~finetuner.training.trainer.Trainer` (not imported here: it imports this module).
"""

from __future__ import annotations

import logging
from typing import Any

import finetuner.device as dev
from finetuner.errors import OutOfMemory
from finetuner.training.oom import StepOutOfMemory, describe, is_out_of_memory, smaller_micro_batch

log = logging.getLogger(__name__)


def train_step_with_backoff(trainer, step: int,
                            examples: list[dict[str, Any]] | None = None) -> tuple[float, int, float | None]:
    """:meth:`Trainer.train_step <finetuner.training.trainer.Trainer.train_step>`, retried with half the
    micro-batch and twice the accumulation on OOM.

    The failure is recorded inside the ``except`` block and the memory freed after it: while
    the error is being handled its traceback keeps the failed step's frames, and their tensors,
    alive. An out-of-memory error after the passes (in the optimizer step) is retried the
    same way on one process; on several the ranks have not agreed on it and the run ends.
    """
    import torch

    rng = (torch.get_rng_state(), dev.rng_state() if trainer.rt.is_cuda else None)
    while True:
        try:
            return trainer.train_step(step, examples)
        except StepOutOfMemory as e:
            failure = e.message
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            failure = describe(e)
            if trainer.world_size > 1:  # the other ranks may have stepped: this rank ends the run
                raise OutOfMemory(
                    f"Out of device memory in step {step + 1} on rank {trainer.rank} of {trainer.world_size} processes, "
                    f"after the step's micro-batches ({failure}); a smaller micro-batch does not lower that memory.",
                    hint="Use a ZeRO strategy with distributed.offload: optimizer, a paged or 8-bit optimizer, or "
                    "method: qlora; `finetuner plan --gpus N` finds settings that fit.",
                ) from None
        free_after_oom(trainer.optimizer, trainer.rt.is_cuda)
        trainer._back_off(step, failure)
        torch.set_rng_state(rng[0])
        dev.set_rng_state(rng[1])


def back_off(trainer, step: int, message: str) -> None:
    """After an out-of-memory error in ``step``: halve the micro-batch (same effective batch),
    or raise :class:`OutOfMemory` with advice when it is 1 already. On several processes every
    rank comes here with the same values (they agreed on the error); rank 0 writes."""
    t = trainer.recipe.training
    eff = t.effective_batch_size
    new_micro = smaller_micro_batch(t.micro_batch_size, eff)
    if new_micro is None:
        where = f" on {trainer.world_size} processes" if trainer.world_size > 1 else ""
        raise OutOfMemory(
            f"Out of device memory in step {step + 1}{where} even with micro_batch_size 1 "
            f"(tried {', '.join(map(str, trainer.tried_micro + [1]))}). {trainer.predicted_note()}",
            hint="Turn on training.gradient_checkpointing, use method: qlora, a paged or 8-bit optimizer, "
            "or a shorter data.max_seq_len; `finetuner plan` finds settings that fit this card.",
        )
    trainer.tried_micro.append(t.micro_batch_size)
    new = t.model_copy(update={"micro_batch_size": new_micro, "gradient_accumulation": eff // new_micro})
    trainer.events.emit(
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
    trainer.recipe = trainer.recipe.model_copy(update={"training": new})
    if trainer.rank == 0:
        trainer.recipe.save(trainer.run_dir / "recipe.yaml")  # a resume uses the values that fit


def free_after_oom(optimizer, is_cuda: bool) -> None:
    """Give back what the failed attempt held (called after its ``except`` block has ended, when
    nothing refers to its tensors any more): its gradients, reference cycles, the CUDA cache."""
    import gc

    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if is_cuda:
        dev.empty_cache()

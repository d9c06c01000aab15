"""What stands before a checkpoint or the adapter is written: no NaN or inf weight is ever saved
(:func:`check_finite_weights`, with :func:`divergence_hint` saying what most likely caused it), and a full disk
ends the run with one line saying how much to free and how to resume (:func:`disk_full_guard`). ``trainer``: the
run's :class:`~finetuner.training.trainer.Trainer` (not imported here: it imports this module)."""

from __future__ import annotations

import math
from pathlib import Path

from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.training import checkpoint as ckpt_io
from finetuner.training.optimizer import local_part


def check_finite_weights(trainer) -> None:
    """Before a checkpoint or the adapter is written (on every rank, which agree): a trained
    weight that is NaN or inf ends the run instead, so no checkpoint a resume would load again,
    and no adapter, ever holds one; the run folder keeps its last good checkpoint."""
    import torch

    bad = [n for n, p in trainer.model.named_parameters() if p.requires_grad and local_part(p).numel()
           and not bool(torch.isfinite(local_part(p)).all())]
    if not trainer._sum_over_ranks([float(len(bad))])[0]:
        return
    shown = f" ({', '.join(bad[:2])}{f' and {len(bad) - 2} more' if len(bad) > 2 else ''})" if bad else ""
    last = ckpt_io.latest_checkpoint(trainer.run_dir)
    kept = f"the run folder keeps its last good checkpoint ({last.name})" if last is not None else "the run folder has no checkpoint yet"
    raise UserError(
        f"After step {trainer.step} the trained weights hold NaN or inf values{shown}; nothing was saved ({kept}).",
        hint=divergence_hint(trainer.recipe, trainer.rt.precision, trainer.losses),
    )


def divergence_hint(recipe: Recipe, precision: str, losses: list[float], first_step: bool = False) -> str:
    """What most likely made the loss or the weights non-finite, from what this run did (its ``precision`` and
    the ``losses`` of its steps so far): the first step already (the base model or the data), fp16, a high
    learning rate, no clipping, a loss that was climbing before."""
    t, causes = recipe.training, []
    if first_step:  # nothing was updated yet: not the learning rate
        causes.append(
            "the loss is not finite at the first step, before any update: the base model's own outputs are (check "
            f"its weights in {recipe.model.name}, or try training.precision: fp32)")
    if precision == "fp16":
        causes.append("fp16 overflows easily: use training.precision bf16 (on GPUs that have it) or fp32")
    if first_step:
        return "Likely cause: " + "; ".join(causes) + "."
    if t.lr > 1e-2 or (t.lr > 2e-3 and recipe.method == "full"):
        causes.append(f"training.lr {t.lr:g} is very high for {recipe.method} (LoRA trains at 1e-4 to 2e-3, "
                      "a full fine-tune at 1e-6 to 5e-5): lower it")
    if t.max_grad_norm is None:
        causes.append("gradient clipping is off: set training.max_grad_norm: 1.0")
    finite = [x for x in losses if math.isfinite(x)]
    if len(finite) >= 2 and finite[-1] > 2 * min(finite):
        causes.append(f"the loss was climbing ({min(finite):.3g} → {finite[-1]:.3g}): the training diverged; lower "
                      "training.lr or raise warmup_steps")
    if not causes:
        causes.append(f"lower training.lr ({t.lr:g}) or raise warmup_steps; try training.precision: fp32 to rule out rounding")
    return "Likely cause: " + "; ".join(causes) + "."


def disk_full_guard(run_dir: Path, model, recipe: Recipe, path: Path, weights_only: bool = False):
    """A full disk while writing ``path`` (a checkpoint, the adapter) ends the run with one line
    saying how much to free and how to resume, instead of the writers' chained tracebacks."""
    from finetuner.fileio import disk_full_as_user_error
    from finetuner.runs.folder import checkpoint_bytes, disk_space_needed

    last = ckpt_io.latest_checkpoint(run_dir)
    since = f"from its last checkpoint ({last.name})" if last is not None else "from the start"
    then = (f"resume with `finetuner run {run_dir / 'recipe.yaml'} -o {run_dir}` (the run continues "
            f"{since}; lowering checkpointing.keep_last also saves space)")
    if weights_only:  # the final adapter: the resume that writes it again needs only its room
        need = checkpoint_bytes(model, "sgd")
    else:  # what the resume's own check asks for (check_disk_space)
        need = disk_space_needed(run_dir, model, recipe.training.optimizer, recipe.checkpointing.keep_last)[2]
    return disk_full_as_user_error(path, then, need)

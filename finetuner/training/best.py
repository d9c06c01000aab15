"""The best evaluation of a run: the lowest held-out loss so far and its step, with ``training.keep_best`` a CPU copy
of the adapter then (restored at the end when the held-out loss rose after it), the evaluations since it
(``training.early_stopping_patience``) and the summary that goes into ``metrics.json``."""

from __future__ import annotations

from typing import Any

from finetuner.config.recipe import Recipe
from finetuner.objectives.specs import spec_of


def keeps_best(recipe: Recipe, world_size: int) -> bool:
    """``training.keep_best`` applies: SFT's held-out loss, an adapter (a snapshot of it is small), and each
    process holding whole adapters (one process or DDP; sharded strategies hold pieces)."""
    return (recipe.training.keep_best and recipe.method != "full" and spec_of(recipe.objective).scorer == "loss"
            and (world_size == 1 or recipe.distributed.strategy == "ddp"))


class BestEvaluation:
    """The lowest held-out loss of a run so far (``loss_step``: the loss and its step, None before an
    evaluation), the adapter's weights then when ``keeps`` (:func:`keeps_best`), and the evaluations since."""

    def __init__(self, keeps: bool):
        self.keeps = keeps
        self.loss_step: tuple[float, int] | None = None
        self.weights: list | None = None
        self.evals_since = 0

    def track(self, val: float | None, step: int, params: list) -> None:
        """After an evaluation at ``step``: the lowest held-out loss so far, its step and (``keep_best``) a CPU copy
        of the trained ``params`` then; the evaluations since it (``early_stopping_patience``)."""
        if val is None:
            return
        if self.loss_step is None or val < self.loss_step[0]:
            self.loss_step, self.evals_since = (val, step), 0
            if self.keeps:
                self.weights = [p.detach().to("cpu", copy=True) for p in params]
        else:
            self.evals_since += 1

    def restore(self, params: list) -> None:
        """The best evaluation's weights back into the trained ``params``."""
        for p, w in zip(params, self.weights):
            p.data.copy_(w.to(p.device, p.dtype))

    def summary(self, last: float | None, step: int, early: bool, patience: int | None) -> dict[str, Any]:
        """The metrics of the best evaluation, the run at ``step`` with ``last`` its last held-out loss:
        ``best_eval_loss``/``best_step``; with ``keep_best`` the adapter's step and loss (``adapter_step``,
        ``eval_loss``: the best's when the last is not) and the last evaluation's (``eval_loss_last``);
        ``stopped_early`` (with a ``patience``); ``held_out_note``: one line when the held-out loss rose from
        its best."""
        out: dict[str, Any] = {"stopped_early": early} if patience else {}
        if self.loss_step is None or last is None:
            return out
        loss, best_step = self.loss_step
        out.update(best_eval_loss=loss, best_step=best_step)
        if best_step == step:
            return out
        if self.keeps and self.weights is not None:
            out.update(eval_loss=loss, eval_loss_last=last, adapter_step=best_step,
                       held_out_note=f"held-out loss rose from {loss:.4f} at step {best_step} to {last:.4f} at step {step}: "
                                     f"the adapter is step {best_step}'s (the last is adapter-last/)")
        else:
            out["held_out_note"] = (f"held-out loss rose from {loss:.4f} at step {best_step} to {last:.4f} at step {step}; "
                                    "the adapter is the last step's")
        return out


def shipped(best: dict[str, Any], step: int, adapter: bool) -> dict[str, Any]:
    """Which model the run ships in ``adapter/`` and its end-of-run answers (samples, general probe, tool-call scores)
    come from: ``best`` the run's :meth:`BestEvaluation.summary`, ``step`` its last step, ``adapter`` whether it
    trains an adapter (else the full model). ``line``: the summary's sentence saying it."""
    kept = best.get("adapter_step")
    at, why = (kept, "the lowest held-out loss (training.keep_best; the last step's is adapter-last/)") \
        if kept not in (None, step) else (step, "the last step")
    what = "adapter" if adapter else "model"
    return {"dir": "adapter", "step": at, "why": why,
            "line": f"Samples, general probe and tool-call scores: the {what} of step {at} (adapter/), {why}."}


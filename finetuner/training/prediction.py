"""A run's own prediction of its memory, speed and wait (:func:`finetuner.planning.predict.predict` on this
device, with the trainer's runtime), in the forms the ``start`` and ``done`` events and ``metrics.json`` hold."""

from __future__ import annotations

import logging
import time
from typing import Any

from finetuner.config.recipe import Recipe
from finetuner.device import platform_of
from finetuner.config.runtime import Runtime

log = logging.getLogger(__name__)


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
    out: dict[str, Any] = {"measured_peak_bytes": measured_peak, "measured": platform_of(rt.device).peak_counter}
    if prediction is not None:
        out["predicted_peak_bytes"] = prediction.allocated_bytes
        if rt.is_cuda:
            out["error_pct"] = round(100.0 * (prediction.allocated_bytes - measured_peak) / max(measured_peak, 1), 2)
    return out


def measured_wait(trainer, samples_s: float = 0.0) -> dict[str, float]:
    """The wall time of the ``trainer``'s process by part (a :class:`~finetuner.training.trainer.Trainer`), as
    :mod:`finetuner.planning.wait` predicts it: ``load`` from its ``entered_at`` (the run's start) to the first step
    (the download, the libraries, the model, the data) less ``replay`` (``data.replay``'s answers, made in that time), ``steps``, ``evaluations``,
    ``checkpoints`` (the adapter included), ``probe`` (the general probe), ``tool_calls`` (the held-out tool calls
    asked of the base and the fine-tune), ``samples`` and ``total``
    (from the start until now; the parts are inside it, the rest is the loop's own bookkeeping). A resumed
    run measures what this process did."""
    now = time.perf_counter()
    first = trainer.first_step_at if trainer.first_step_at is not None else now
    return {"load": round(first - trainer.entered_at - trainer.replay_seconds, 3), "replay": round(trainer.replay_seconds, 3),
            "steps": round(trainer.step_seconds, 3), "evaluations": round(trainer.eval_seconds, 3),
            "checkpoints": round(trainer.save_seconds, 3), "probe": round(trainer.probe_seconds, 3),
            "tool_calls": round(trainer.tool_call_seconds, 3), "samples": round(samples_s, 3), "total": round(now - trainer.entered_at, 3)}

"""What a run can finish: the micro-batch, the accumulation and the steps, bounded before anything loads.

The recipe's schema bounds each number alone (:data:`~finetuner.schema.MAX_WHOLE`); these bounds need
the memory model, the data and the speed model, so they are checked on the one prediction of the run
(:func:`~finetuner.planning.predict.predict`). ``finetuner run`` (and :func:`finetuner.train`, and so the web
UI's jobs) checks them before the run folder is made or the model loads; ``finetuner estimate``, ``finetuner
plan`` and the web UI's Start button check the same, through :func:`check_run`:

- **memory**: the rows of one micro-batch need memory of their own on every process, whatever shards the
  model; a micro-batch whose own share of the predicted peak is more than the largest device finetuner knows
  (its cards, this machine's CPU, the device planned for) is refused. The share, not the whole peak: a model
  too big for one card still runs sharded over several (``distributed.strategy: fsdp``).
- **rows**: a micro-batch, or a step (micro-batch x accumulation), larger than the data's training rows is
  refused. The trainer would take each row once per step and no more, so the number in the recipe (and in the
  run folder's copy) would not be what ran, and every prediction (memory, time) would be made for rows that do
  not exist. Clamping it instead would change the effective batch the run folder records, and the same
  command would then be refused as a different recipe when it resumes.
- **time**: a run predicted to take more than :data:`LONGEST_RUN_S` is refused; one that passes over its training rows more than :data:`MANY_PASSES` times runs, with a warning
  that says its predicted time.
"""

from __future__ import annotations

import logging
from typing import Any

from finetuner.config.hardware import GpuProfile, cpu_profile, list_profiles
from finetuner.objectives.specs import spec_of
from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.planning.recipe_data import training_rows
from finetuner.planning.predict import Prediction, predict
from finetuner.units import duration_text, gib_text

log = logging.getLogger(__name__)

#: passes over the training rows past which a run is warned about: fine-tunes take 1 to 10 (the planner's own
#: cap is 10 epochs, 3 for preference data); a hundred is long past the point where the model has learnt its
#: rows by heart, and more is likely a typo of max_steps (an extra zero or two)
MANY_PASSES = 100
#: the longest predicted run (its whole wait, :attr:`Prediction.wait`) that starts: a year. The speed model is
#: right to tens of percent, so a run predicted above it would not end within months even at a third of it
LONGEST_RUN_S = 365 * 24 * 3600.0


def largest_device(gpu: GpuProfile | None = None) -> GpuProfile:
    """The device with the most memory among the cards finetuner knows, this machine's CPU and ``gpu`` (the one
    planned for: a detected card, or a size such as ``192GB``)."""
    devices = [*list_profiles(), cpu_profile(), *([gpu] if gpu is not None else [])]
    return max(devices, key=lambda d: d.memory_bytes)


def check_memory(p: Prediction) -> None:
    """Refuse a micro-batch whose own memory (the predicted peak less the peak at a micro-batch of 1) is more
    than :func:`largest_device` holds."""
    t = p.recipe.training
    if not isinstance(t.micro_batch_size, int) or t.micro_batch_size <= 1:
        return
    one = p.recipe.model_copy(update={"training": t.model_copy(update={"micro_batch_size": 1})})
    alone = predict(one, p.gpu, shape=p.shape, label_fraction=p.label_fraction, runtime=p.runtime).memory.total_bytes
    share = p.memory.total_bytes - alone
    big = largest_device(p.gpu)
    if share > big.memory_bytes:
        raise UserError(
            f"training.micro_batch_size {t.micro_batch_size:,}: the memory model predicts {gib_text(p.memory.total_bytes, 1, grouped=True)} for "
            f"a step, {gib_text(share, 1, grouped=True)} of it for the micro-batch's rows, more than the largest device it knows "
            f"({big.name}, {gib_text(big.memory_bytes, 1, grouped=True)}): no card runs it.",
            hint="Lower training.micro_batch_size (or set it to auto: the planner chooses one that fits the card).",
        )


def check_rows(recipe: Recipe, rows: int | None) -> None:
    """Refuse a micro-batch or a step (``micro_batch_size x gradient_accumulation``) of more rows than the data's
    ``rows`` training rows (None: not known here, nothing to check)."""
    t = recipe.training
    if rows is None or not isinstance(t.micro_batch_size, int) or not isinstance(t.gradient_accumulation, int):
        return
    what = f"{rows:,} training {'prompts' if spec_of(recipe.objective).generates else 'rows'} of {recipe.data.path}"
    if t.micro_batch_size > rows:
        raise UserError(
            f"training.micro_batch_size {t.micro_batch_size:,} is more than the {what}: a micro-batch cannot hold more "
            "rows than the data has.", settings={"training.micro_batch_size": rows})
    eff = t.micro_batch_size * t.gradient_accumulation
    if eff > rows:
        key, largest = (("training.effective_batch", rows) if t.effective_batch is not None else
                        ("training.gradient_accumulation", rows // t.micro_batch_size))
        raise UserError(
            f"{key}: {t.micro_batch_size:,} x {t.gradient_accumulation:,} = {eff:,} rows a step is more than the {what}: "
            f"a step would take every row once, not {eff:,}.", settings={key: largest})


def check_length(p: Prediction, rows: int | None) -> list[str]:
    """Refuse a run predicted to take more than :data:`LONGEST_RUN_S`; the warning for one that passes over its
    ``rows`` training rows more than :data:`MANY_PASSES` times (none when the data or the speed cannot be read)."""
    t = p.recipe.training
    try:
        steps, wait = p.optimizer_steps, p.wait
    except Exception as e:  # noqa: BLE001 - a model the speed model does not know has no predicted time to bound
        log.info("No predicted time to bound: %s", e)
        return []
    if not steps or wait is None:
        return []
    key = f"training.max_steps {t.max_steps:,}" if t.max_steps else f"training.epochs {t.epochs:g}"
    eff = t.effective_batch_size
    run = (f"{steps:,} optimizer steps of {eff:,} row{'s' if eff != 1 else ''} (training.micro_batch_size "
           f"{t.micro_batch_size:,} x gradient_accumulation {t.gradient_accumulation:,})")
    if not wait.wall_s <= LONGEST_RUN_S:  # also NaN
        raise UserError(f"{key}: {run} are predicted to take ~{duration_text(wait.wall_s)} on {p.timed_on.name}: more than a "
                        "year, so the run would not end.",
                        hint="Lower training.max_steps (or training.epochs).")
    passes = steps * eff / rows if rows else 0.0
    if passes <= MANY_PASSES:
        return []
    return [f"{key}: {run} pass over the {rows:,} training rows {passes:,.0f} times (more than {MANY_PASSES}: the model "
            f"learns them by heart long before); predicted time on {p.timed_on.name}: ~{duration_text(wait.wall_s)}."]


def check_prediction(p: Prediction) -> list[str]:
    """Every bound on the run ``p`` predicts (:func:`check_memory`, :func:`check_rows`, :func:`check_length`):
    a :class:`UserError` for the first it breaks, else the warnings."""
    check_memory(p)
    rows = training_rows(p.recipe)
    check_rows(p.recipe, rows)
    return check_length(p, rows)


def check_run(recipe: Recipe, gpu: GpuProfile | str | None = None, **predict_args: Any) -> list[str]:
    """:func:`check_prediction` of a run of ``recipe`` on ``gpu`` (None: this CPU): what ``finetuner run`` checks
    before the model loads, ``estimate``, ``plan`` and the web UI's Start button before they answer. A recipe
    the memory model cannot predict (an architecture it does not know) is checked against its data alone."""
    try:
        p = predict(recipe, gpu, **predict_args)
    except Exception as e:  # noqa: BLE001 - an architecture the memory model does not know must not stop training
        log.info("No prediction to bound this run with: %s", e)
        check_rows(recipe, training_rows(recipe))
        return []
    return check_prediction(p)


def check_before_run(recipe: Recipe) -> None:
    """:func:`check_run` on the device a run of the resolved ``recipe`` trains on
    (:func:`~finetuner.config.hardware.run_profile`), its warnings logged: the trainer's and the launcher's
    check, before the run folder is made or the model loads."""
    from finetuner.config.hardware import run_profile

    for warning in check_run(recipe, run_profile(recipe.device)):
        log.warning(warning)

"""What a recipe's data make of its run, read as the trainer reads them: the share of tokens that carry a label,
the rows it trains on and holds out, its optimizer steps, its average micro-batch, and the whole run's wait.
The plan, ``finetuner estimate``, the trainer's predictions and the web UI all measure a recipe here (each data
file profiled once per version)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetuner.errors import UserError
from finetuner.objectives.specs import spec_of
from finetuner.config.hardware import GpuProfile
from finetuner.data.split import held_out_rows
from finetuner.memory.model import settings_from_recipe
from finetuner.model.shapes import ModelShape, resolve_shape
from finetuner.planning.lengths import BatchShape, batch_shape, prompt_batch
from finetuner.planning.speed import DeviceSpeed, StepTime
from finetuner.planning.wait import Wait, recipe_wait

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe


@functools.lru_cache(maxsize=16)
def _file_profile(path: str, mtime_ns: int, size: int, model: str, fmt: str,
                  columns: tuple[tuple[str, str], ...], prompts: bool = False,
                  chat_template: str | None = None) -> tuple[float, tuple[int, ...], int]:
    """``(label fraction, token lengths, rows that cannot be used)`` of a data file, once per file version; with
    ``prompts`` its prompts' lengths, read as the GRPO trainer reads them (:func:`finetuner.data.stats.profile_prompts`)."""
    from finetuner.data.stats import profile_data, profile_prompts

    if prompts:
        p = profile_prompts(path, model, columns=dict(columns) or None, chat_template=chat_template)
        return 1.0, tuple(p.lengths), p.bad_rows
    p = profile_data(path, model, fmt=fmt, columns=dict(columns) or None, chat_template=chat_template)
    return p.label_fraction, tuple(p.lengths), p.bad_rows


def recipe_file_profile(recipe: Recipe, file: str | None = None,
                         prompts: bool | None = None) -> tuple[float, tuple[int, ...], int] | None:
    """:func:`_file_profile` of the recipe's one local data file (or of ``file``, read as the recipe reads
    its data), None when it has none readable here. ``prompts``: its prompts' lengths, as the GRPO trainer
    reads them; by default for a GRPO recipe."""
    if prompts is None:
        prompts = spec_of(recipe.objective).generates
    d = recipe.data
    file = d.path if file is None else file
    if not isinstance(file, str) or not Path(file).expanduser().is_file():
        return None
    path = Path(file).expanduser().resolve()
    st = path.stat()
    try:
        return _file_profile(str(path), st.st_mtime_ns, st.st_size, recipe.model.name, d.format,
                             tuple(sorted((d.columns or {}).items())), prompts, d.chat_template)
    except (UserError, OSError, ValueError):  # unreadable here: the trainer reports its rows
        return None


def data_batch_of(recipe: Recipe) -> BatchShape | None:
    """The recipe's average micro-batch from its data's token lengths (:mod:`finetuner.planning.lengths`),
    measured as :func:`label_fraction_of` measures them (cached per file version); for GRPO its prompts as
    a step's rollout pads them (:func:`lengths_batch`). None when the data is
    not one local file readable here (the speed model then takes every row, or prompt, at its longest)."""
    prof = recipe_file_profile(recipe)
    t = recipe.training
    if prof is None or not prof[1] or not isinstance(t.micro_batch_size, int) or not isinstance(t.gradient_accumulation, int):
        return None
    return lengths_batch(recipe, prof[1], t.micro_batch_size, t.gradient_accumulation, source=str(recipe.data.path))


def lengths_batch(recipe: Recipe, lengths: Sequence[int], micro_batch: int, gradient_accumulation: int,
                  source: str = "data") -> BatchShape:
    """The average micro-batch of ``micro_batch`` rows of data with these token ``lengths``
    (:func:`~finetuner.planning.lengths.batch_shape`), or for GRPO, whose ``lengths`` are its prompts', a
    step's ``micro_batch × gradient_accumulation`` prompts as its rollout pads them
    (:func:`~finetuner.planning.lengths.prompt_batch`)."""
    d = recipe.data
    if spec_of(recipe.objective).generates:
        return prompt_batch(lengths, micro_batch * gradient_accumulation, max_prompt_len(recipe), source)
    return batch_shape(lengths, micro_batch, d.max_seq_len, bool(d.packing), source=source)


def max_prompt_len(recipe: Recipe) -> int:
    """A GRPO recipe's longest prompt: ``data.max_seq_len − grpo.max_new_tokens`` (the trainer refuses longer)."""
    return recipe.data.max_seq_len - recipe.grpo.max_new_tokens


def label_fraction_of(recipe: Recipe) -> float:
    """The share of the recipe's tokens that carry a label, measured from its data as
    :func:`~finetuner.planning.planner.plan` measures it (:func:`finetuner.data.stats.profile_data` on ``data.path`` with the recipe's model,
    format and ``data.columns``; cached per file version): the plan, ``estimate``, ``auto``
    resolution, the trainer's predictions and the web UI's estimate all use it. 1.0 (every token, the
    upper bound) with ``data.train_on_prompt``, or when the data is not one local file readable here."""
    if recipe.data.train_on_prompt:
        return 1.0
    prof = recipe_file_profile(recipe, prompts=False)  # the file's supervised rows, for GRPO too
    return 1.0 if prof is None else prof[0]  # unreadable here: the upper bound


def held_out_of(recipe: Recipe) -> int | None:
    """The held-out rows a run of the recipe evaluates, as the trainer splits them: the rows of
    ``data.val_path``, else ``data.val_size`` of the data file's rows
    (:func:`~finetuner.data.split.held_out_rows`); None when the file cannot be read here."""
    d = recipe.data
    if d.val_path:
        prof = recipe_file_profile(recipe, d.val_path)
        return len(prof[1]) if prof is not None else None
    prof = recipe_file_profile(recipe)
    return held_out_rows(d.val_size, len(prof[1])) if prof is not None else None


def training_rows(recipe: Recipe) -> int | None:
    """The rows (GRPO: prompts) a run of the recipe trains on, as the trainer takes them: the data file's usable
    rows up to ``data.max_examples``, less the held-out rows (none with ``data.val_path``), plus ``data.replay``'s
    answers. None when the file cannot be read here, holds more rows than a profile counts
    (:data:`~finetuner.data.stats.MAX_ROWS`: then only a lower bound is known), or holds rows the run stops at
    (``data.on_bad_row: error``: the run's own message names them)."""
    from finetuner.data.stats import MAX_ROWS

    prof = recipe_file_profile(recipe)
    if prof is None or not prof[1] or len(prof[1]) >= MAX_ROWS or (prof[2] and recipe.data.on_bad_row == "error"):
        return None
    train = user_training_rows(recipe, len(prof[1]))
    return train + replayed_rows(recipe, train) if train > 0 else None


def user_training_rows(recipe: Recipe, rows: int) -> int:
    """The user's rows a run trains on of a data file of ``rows`` usable rows: up to ``data.max_examples``, less the
    held-out rows (none with ``data.val_path``); ``data.replay``'s answers are a share of these."""
    d = recipe.data
    rows = min(rows, d.max_examples or rows)
    return rows - (0 if d.val_path else held_out_rows(d.val_size, rows))


def replayed_rows(recipe: Recipe, train_rows: int) -> int:
    """The base model's answers ``data.replay`` mixes into ``train_rows`` training rows (0 without replay)."""
    if not recipe.data.replay:
        return 0
    from finetuner.data.replay import load_prompts, replay_count

    return replay_count(recipe.data.replay, train_rows, len(load_prompts()))


def run_wait(recipe: Recipe, gpu: GpuProfile, speed: DeviceSpeed, step: StepTime, steps: int | None,
             label_fraction: float = 1.0, *, shape: ModelShape | None = None, runtime: Any = None,
             lengths: Sequence[int] | None = None, loaded_as: tuple[bool, bool] | None = None,
             replay_cached: bool | None = None) -> Wait | None:
    """The whole run's predicted wait (:func:`finetuner.planning.wait.recipe_wait`: download, load, replay, steps,
    evaluations, checkpoints, probe, samples) of a resolved recipe whose step takes ``step``, over ``steps``
    optimizer steps (None: unknown, and so is the wait). The plan, ``estimate``, the trainer's ``start``
    event and the web UI all take it from here. The held-out rows and the evaluations' micro-batches come
    from the data's token ``lengths`` when the caller has them (a plan's data profile), else from the
    recipe's data file (:func:`held_out_of`, :func:`data_batch_of`). ``loaded_as``: whether the model was to be
    downloaded and converted when the run began (:func:`finetuner.planning.wait.first_load`; a run's own prediction);
    ``replay_cached``: whether ``data.replay``'s answers came from its cache (a run's own record). ``data.replay``
    counts its prompts from the data's rows (:func:`user_training_rows`)."""
    if not steps:
        return None
    shape = shape or resolve_shape(recipe.model.name, recipe.model.revision)
    s = settings_from_recipe(recipe, gpu, shape.model_type, runtime=runtime, shape=shape).with_(label_fraction=label_fraction)
    d, t, grpo = recipe.data, recipe.training, spec_of(recipe.objective).generates
    source = "data"
    if not lengths:
        prof = recipe_file_profile(recipe)
        lengths, source = (prof[1], str(d.path)) if prof is not None else (None, source)
    if lengths:
        held_out = held_out_of(recipe) if d.val_path else held_out_rows(d.val_size, len(lengths))
        batch = lengths_batch(recipe, lengths, t.micro_batch_size, t.gradient_accumulation, source)
    else:
        held_out, batch = held_out_of(recipe), None
    # GRPO's evaluation samples every held-out prompt's group at once: padded to the longest of them
    # (with data.val_path, taken from the training prompts' lengths)
    eval_prompts = prompt_batch(lengths, held_out, max_prompt_len(recipe), source) if grpo and lengths and held_out else None
    return recipe_wait(recipe, shape, s, speed, step, steps, held_out=held_out, batch=batch, eval_prompts=eval_prompts,
                       loaded_as=loaded_as, train_rows=user_training_rows(recipe, len(lengths)) if lengths else None,
                       replay_cached=replay_cached)


def lengths_text(recipe: Recipe, batch: BatchShape | None) -> str:
    """What ``estimate`` says of the lengths it timed: the data's (``batch``), or the longest."""
    if batch is None:
        if spec_of(recipe.objective).generates:
            return ("every prompt taken as data.max_seq_len - grpo.max_new_tokens tokens long and every completion as "
                    "grpo.max_new_tokens (the data file cannot be read here): an upper bound")
        return "every row taken as data.max_seq_len tokens long (the data file cannot be read here): an upper bound"
    if spec_of(recipe.objective).generates:
        return (f"the prompts of {batch.source}: {batch.real_per_row:.0f} tokens a prompt, {batch.padded_len:.0f} "
                f"positions a generate call's; completions at their longest ({recipe.grpo.max_new_tokens} tokens)")
    return (f"the rows of {batch.source}: {batch.padded_len:.0f} positions a micro-batch row, "
            f"{batch.real_per_row:.0f} of them tokens")


def run_optimizer_steps(recipe: Recipe) -> int | None:
    """The optimizer steps ``finetuner run`` takes for a resolved recipe, counted as the trainer counts
    them (:func:`finetuner.steps.optimizer_steps`): ``training.max_steps``, else the epochs
    over the training rows left after the held-out split (:func:`~finetuner.data.split.held_out_rows`)
    of the data file, as :func:`~finetuner.planning.planner.plan` counts them. None when the data cannot be read here
    (a hub data set). Packed data are counted by packing the examples' lengths as the trainer packs them
    (:func:`~finetuner.data.split.count_packed_rows`)."""
    from finetuner.data.split import count_packed_rows
    from finetuner.steps import optimizer_steps

    t = recipe.training
    if t.max_steps:
        return t.max_steps
    d = recipe.data
    if not d.path or not isinstance(d.path, str) or not Path(d.path).expanduser().is_file():
        return None
    from finetuner.data.stats import profile_data, profile_prompts

    try:
        if spec_of(recipe.objective).generates:  # its rows are prompts, read as the GRPO trainer reads them
            profile = profile_prompts(str(Path(d.path).expanduser()), recipe.model.name, columns=d.columns,
                                      on_bad_row=d.on_bad_row, system_prompt=d.system_prompt)
        else:
            profile = profile_data(str(Path(d.path).expanduser()), recipe.model.name, fmt=d.format, columns=d.columns,
                                   on_bad_row=d.on_bad_row, system_prompt=d.system_prompt, thinking=d.thinking,
                                   reasoning=d.reasoning)
    except (UserError, OSError, ValueError):
        return None
    rows = profile.rows
    n_val = 0 if d.val_path else held_out_rows(d.val_size, rows)
    packing = d.packing if isinstance(d.packing, bool) else profile.should_pack(d.max_seq_len)
    units = count_packed_rows(profile.lengths, n_val, d.max_seq_len, t.seed) if packing else rows - n_val
    units += replayed_rows(recipe, rows - n_val)  # the base's answers (finetuner.data.replay); packed, each a row: at most
    return optimizer_steps(None, t.epochs, max(1, units), t.effective_batch_size)

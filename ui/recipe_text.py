"""The recipe in the Plan tab's editor: read from its YAML, changed by the advanced fields and
written back, all with the recipe's own reader and writer (:mod:`finetuner.config.recipe`)."""

from __future__ import annotations

import inspect

from pathlib import Path

from pydantic import ValidationError

from finetuner.config.recipe import Recipe, format_validation_error, readable_dict, readable_yaml
from finetuner.config.recipe_yaml import parse_yaml
from finetuner.data import scope
from finetuner.errors import UserError
from finetuner.fileio import atomic_write_text
from finetuner.runs import jobs
from ui import paths


def recipe_from_text(text: str, base_dir: Path = paths.ROOT, source: str = "recipe") -> Recipe:
    """A validated :class:`~finetuner.config.recipe.Recipe` from the YAML in the editor; its
    errors are the recipe's own (:meth:`Recipe.from_yaml_text`), relative paths from ``base_dir`` (the checkout; a
    recipe file's folder); within the UI's scope, its paths are those :func:`finetuner.data.scope.recipe_paths` allows."""
    if not (text or "").strip():
        raise UserError("There is no recipe yet.", hint="Make a plan in the Plan tab, or load a shipped recipe.")
    if scope.current() is None:
        return Recipe.from_yaml_text(text, source=source, base_dir=base_dir)
    # within a served UI's scope, the paths it names are checked before anything looks at them (one refusal outside)
    try:
        written = Recipe.model_validate(parse_yaml(text, source))
    except ValidationError as e:
        raise UserError(format_validation_error(e, source)) from None
    return scope.recipe_paths(written, base_dir, source).resolve_paths(base_dir, source)


def recipe_text(recipe: Recipe, header: str = "") -> str:
    """The recipe as the editor shows it: the values that differ from the defaults and the method,
    after ``header`` (comment lines), as ``finetuner plan -o`` writes it
    (:func:`finetuner.config.recipe.readable_yaml`)."""
    return readable_yaml(recipe, header)


def fields_of(recipe: Recipe) -> tuple:
    """The values of the Plan tab's advanced fields for ``recipe`` (in :func:`apply_fields`'s order)."""
    t = recipe.training
    return (
        recipe.method,
        t.micro_batch_size if t.micro_batch_size != "auto" else None,
        t.gradient_accumulation if t.gradient_accumulation != "auto" else None,
        recipe.data.max_seq_len,
        t.optimizer if t.optimizer != "auto" else None,
        bool(t.gradient_checkpointing) if t.gradient_checkpointing != "auto" else False,
        recipe.lora.r,
        t.max_steps or 0,
        recipe.logging.every,
        t.eval_every or 0,
        recipe.logging.trackers,
    )


def apply_fields(text: str, method, micro, accum, seq_len, optimizer, checkpointing, lora_r, max_steps,
                 log_every=None, eval_every=None, report_to=None) -> Recipe:
    """The recipe in ``text`` with the Plan tab's advanced fields (and the Train tab's trackers) applied."""
    r = recipe_from_text(text)
    raw = readable_dict(r)
    raw["method"] = method or r.method
    if raw["method"] != "qlora":
        raw.pop("quantization", None)
    tr = raw.setdefault("training", {})
    for key, val in (("micro_batch_size", micro), ("gradient_accumulation", accum), ("optimizer", optimizer)):
        if val:
            tr[key] = int(val) if key != "optimizer" else val
    tr["gradient_checkpointing"] = bool(checkpointing)
    if max_steps:
        tr["max_steps"] = int(max_steps)
    else:
        tr.pop("max_steps", None)
    if seq_len:
        raw.setdefault("data", {})["max_seq_len"] = int(seq_len)
    if lora_r:
        raw.setdefault("lora", {})["r"] = int(lora_r)
    if log_every:
        raw.setdefault("logging", {})["every"] = int(log_every)
    if eval_every:
        tr["eval_every"] = int(eval_every)
    else:
        tr.pop("eval_every", None)
    if report_to is not None:  # the trackers ticked, TensorBoard among them: its older switch goes
        logging = raw.setdefault("logging", {})
        logging["report_to"] = list(report_to)
        logging.pop("tensorboard", None)
    return Recipe.from_dict(raw, base_dir=paths.ROOT, source="recipe")



#: how many advanced fields :func:`fields_of` gives and :func:`apply_fields` takes after the text (the handlers
#: that leave them alone skip this many)
FIELD_COUNT = len(inspect.signature(apply_fields).parameters) - 1

def download_file(text: str, name: str, folder: Path) -> str:
    """``text`` saved as ``<name>.yaml`` in ``folder`` (the app's private temp folder, where the
    download button serves files from); a link already there is replaced, never followed."""
    path = Path(folder) / f"{jobs.safe_name(name)}.yaml"
    atomic_write_text(path, text)
    return str(path)

"""The training objectives, one module each, behind one interface (:mod:`finetuner.objectives.base`):
supervised fine-tuning (:mod:`~finetuner.objectives.sft`, NEFTune with it: its description's model hook), the
preference objectives (:mod:`~finetuner.objectives.preference`) and GRPO (:mod:`~finetuner.objectives.grpo`). What
the rest of finetuner knows of each (torch-free, below the recipe) is its description: :mod:`finetuner.objectives.specs`.

Importing this package imports nothing else (the recipe's schema reads :mod:`finetuner.objectives.specs`,
which sits below it); the trainers are found when one is built: every module of this package is imported, and
each registers its objectives (:func:`finetuner.objectives.base.register`), so a new one is found without a list
to edit."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from finetuner.config.recipe import Recipe
    from finetuner.objectives.base import Objective

__all__ = ["build_objective", "trainers"]


def trainers() -> dict[str, type[Objective]]:
    """Objective name → its trainer class, as the modules of this package register them (each module imported
    once; the ``specs`` package, which holds no trainer, left out)."""
    from finetuner.objectives.base import REGISTRY

    for info in pkgutil.iter_modules(__path__, __name__ + "."):
        if not info.ispkg:
            importlib.import_module(info.name)
    return REGISTRY


def build_objective(recipe: Recipe, run_dir: Path | None = None) -> Objective:
    """The objective ``recipe.objective`` names, for the run in ``run_dir`` (None: only its data): its own trainer,
    else (a variant described with a model hook, such as NEFTune) the trainer of the objective it varies."""
    from finetuner.objectives.specs import spec_of

    found, name = trainers(), recipe.objective
    while name not in found and spec_of(name).variant_of is not None:
        name = spec_of(name).variant_of
    return found[name](recipe, run_dir)

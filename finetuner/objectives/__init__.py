"""The training objectives, one module each, behind one interface (:mod:`finetuner.objectives.base`):
supervised fine-tuning (:mod:`~finetuner.objectives.sft`) and the preference objectives
(:mod:`~finetuner.objectives.preference`) and GRPO (:mod:`~finetuner.objectives.grpo`). What the rest of
finetuner knows of each (torch-free, below the recipe) is its description: :mod:`finetuner.objectives.specs`.

Importing this package imports nothing else (the recipe's schema reads :mod:`finetuner.objectives.specs`,
which sits below it); the trainers are imported when one is built."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from finetuner.config.recipe import Recipe
    from finetuner.objectives.base import Objective

__all__ = ["build_objective"]


def build_objective(recipe: Recipe, run_dir: Path | None = None) -> Objective:
    """The objective ``recipe.objective`` names, for the run in ``run_dir`` (None: only its data)."""
    from finetuner.objectives import grpo, neftune, preference, sft  # noqa: F401 - each registers its objectives
    from finetuner.objectives.base import REGISTRY

    return REGISTRY[recipe.objective](recipe, run_dir)

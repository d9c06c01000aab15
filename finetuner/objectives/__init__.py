"""The training objectives, one module each, behind one interface (:mod:`finetuner.objectives.base`):
supervised fine-tuning (:mod:`~finetuner.objectives.sft`) and the preference objectives
(:mod:`~finetuner.objectives.preference`) and GRPO (:mod:`~finetuner.objectives.grpo`)."""

from __future__ import annotations

from pathlib import Path

from finetuner.config.recipe import Recipe
from finetuner.objectives import grpo, preference, sft  # noqa: F401 - each registers its objectives
from finetuner.objectives.base import REGISTRY, Objective, register

__all__ = ["REGISTRY", "Objective", "build_objective", "register"]


def build_objective(recipe: Recipe, run_dir: Path | None = None) -> Objective:
    """The objective ``recipe.objective`` names, for the run in ``run_dir`` (None: only its data)."""
    return REGISTRY[recipe.objective](recipe, run_dir)

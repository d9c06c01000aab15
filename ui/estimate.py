"""The Plan tab's memory estimate of a recipe: the planner's own figure, not a second one.

The planner estimates each option with the share of the data's tokens the loss is computed on
(``DataProfile.label_fraction``: the chunked loss only works on those); ``finetuner estimate`` and the
trainer measure it the same way (``finetuner.planning.recipe_data.label_fraction_of``). The page shows
the planner's reasons next to the estimate of the recipe in the editor, so both must be computed
the same way: :func:`recipe_estimate` measures the recipe's data as the planner does.
"""

from __future__ import annotations

from typing import Any


def label_fraction(recipe: Any) -> float:
    """The share of the recipe's data tokens that are trained on, measured as the planner measures
    it (:func:`finetuner.planning.recipe_data.label_fraction_of`, the one function plan, estimate and run use);
    1.0 when the recipe also trains on prompts, or its data is not one local file."""
    from finetuner.planning.recipe_data import label_fraction_of

    return label_fraction_of(recipe)


def recipe_estimate(recipe: Any, gpu: Any):
    """``estimate_recipe`` for ``recipe`` on ``gpu`` with its data's :func:`label_fraction`."""
    from finetuner.planning.predict import estimate_recipe

    return estimate_recipe(recipe, gpu, label_fraction=label_fraction(recipe))

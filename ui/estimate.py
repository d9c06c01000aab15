"""The Plan tab's memory estimate of a recipe: the planner's own figure, not a second one.

The planner estimates each option with the share of the data's tokens the loss is computed on
(``DataProfile.label_fraction``: the chunked loss only works on those), while
``finetuner.planning.planner.estimate_recipe`` alone assumes every token (the upper bound). The page shows
the planner's reasons next to the estimate of the recipe in the editor, so both must be computed
the same way: :func:`recipe_estimate` measures the recipe's data as the planner does.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from finetuner.errors import UserError


@functools.lru_cache(maxsize=16)
def _file_label_fraction(path: str, mtime_ns: int, size: int, model: str, fmt: str,
                         columns: tuple[tuple[str, str], ...]) -> float:
    from finetuner.data.stats import profile_data

    return profile_data(path, model, fmt=fmt, columns=dict(columns) or None).label_fraction


def label_fraction(recipe: Any) -> float:
    """The share of the recipe's data tokens that are trained on, measured as the planner measures
    it; 1.0 when the recipe also trains on prompts, or its data is not one local file."""
    data = recipe.data
    if data.train_on_prompt or not isinstance(data.path, str) or not Path(data.path).is_file():
        return 1.0
    st = Path(data.path).stat()
    try:
        return _file_label_fraction(str(Path(data.path).resolve()), st.st_mtime_ns, st.st_size, recipe.model.name,
                                    data.format, tuple(sorted((data.columns or {}).items())))
    except UserError:  # unreadable here: the trainer reports its rows; the estimate takes the upper bound
        return 1.0


def recipe_estimate(recipe: Any, gpu: Any):
    """``estimate_recipe`` for ``recipe`` on ``gpu`` with its data's :func:`label_fraction`."""
    from finetuner.planning.planner import estimate_recipe

    return estimate_recipe(recipe, gpu, label_fraction=label_fraction(recipe))

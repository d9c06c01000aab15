"""A recipe loaded with its overrides, its held-out rows following the data it now names.

An override that points ``data.path`` at other data drops the recipe's ``data.val_path``
(:func:`finetuner.config.overrides.drop_stale_val_path`: the file holds out rows of the data the recipe was written
for). How many rows of the new data to hold out instead takes counting them, which is the data's work, so it is
decided here, above the recipe's schema: every surface that loads a recipe with overrides (``finetuner run``,
``plan``/``estimate``, ``finetuner.train``, the web UI's jobs) loads it through :func:`load_recipe`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from finetuner.config.recipe import Recipe
from finetuner.data.formats import read_rows
from finetuner.data.split import held_out_rows, held_out_size

log = logging.getLogger(__name__)


def load_recipe(recipe: str | Path | Recipe, overrides: list[str] | None = None) -> Recipe:
    """``recipe`` (a file, or a :class:`Recipe`) with ``overrides`` applied; when they dropped its held-out file,
    holding out rows of its own data instead (:func:`hold_out_from_data`). A :class:`Recipe` without overrides is
    taken as it is (loaded already: its held-out rows followed then)."""
    if isinstance(recipe, Recipe) and not overrides:
        return recipe
    loaded = Recipe.from_dict(recipe.to_dict(), overrides) if isinstance(recipe, Recipe) else Recipe.from_yaml(recipe, overrides)
    return loaded if loaded.dropped_val_path is None else hold_out_from_data(loaded, *loaded.dropped_val_path)


def hold_out_from_data(recipe: Recipe, dropped: str, source: str = "recipe") -> Recipe:
    """``recipe``, whose ``data.val_path`` ``dropped`` was dropped, holding out rows of its own data instead: its
    ``data.val_size`` when it names one, else the size a plan takes for that many rows
    (:func:`finetuner.data.split.held_out_size`; a hub data set, not counted here, holds out nothing). Said in one
    warning line before anything runs, with the way to keep the file."""
    d = recipe.data
    paths = d.path if isinstance(d.path, list) else [d.path]
    rows = None
    if d.val_size == 0 and all(Path(p).is_file() for p in paths):
        rows = sum(sum(1 for _ in read_rows(p, d.split, [])) for p in paths)
        d = d.model_copy(update={"val_size": held_out_size(rows)})
    new = ", ".join(paths)
    if d.val_size > 0:
        part = f"{held_out_rows(d.val_size, rows)} of its {rows} rows" if rows is not None else "part of it"
        held = f"holds out {part} (data.val_size: {d.val_size:g}) instead"
    else:
        held = ("holds nothing out" + (f" ({rows} rows: too few to spare)" if rows is not None else "")
                + ": no held-out loss, no best adapter by it")
    log.warning("%s: data.path is now %s, but data.val_path %s holds out rows of the data the recipe was written for: "
                "dropped; the run %s. To evaluate on that file anyway, add --set data.val_path=%s",
                source, new, dropped, held, dropped)
    return recipe.model_copy(update={"data": d})

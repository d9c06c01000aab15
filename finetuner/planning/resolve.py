"""The planner at run time: a recipe's ``auto`` values resolved for the device a run is on (``finetuner run``,
the trainer), or kept from the run folder's resolved recipe when the run resumes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from finetuner.errors import UserError
from finetuner.objectives.specs import spec_of
from finetuner.config.hardware import GpuProfile
from finetuner.model.shapes import ModelShape
from finetuner.planning.plan_result import Plan
from finetuner.planning.planner import plan_recipe
from finetuner.planning.recipe_data import label_fraction_of, recipe_file_profile
from finetuner.planning.search import DEFAULT_MARGIN

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe


def resolve_auto(recipe: Recipe, gpu: GpuProfile, label_fraction: float = 1.0, shape: ModelShape | None = None,
                 margin: float = DEFAULT_MARGIN) -> Plan:
    """Resolve a recipe's ``auto`` values for the device a run is on (``finetuner run``, ``finetuner estimate``):
    :func:`~finetuner.planning.planner.plan_recipe`, the search every plan makes, with its options' defaults;
    ``shape``: the recipe's model when the caller resolved it already.

    Raises a UserError with the planner's suggestions when nothing fits.
    """
    prof = recipe_file_profile(recipe) if not spec_of(recipe.objective).generates else None
    result = plan_recipe(recipe, gpu, shape=shape, label_fraction=label_fraction, lengths=prof[1] if prof else None,
                         margin=margin)
    if result.recipe is None:
        raise UserError(
            f"No setting of {', '.join(recipe.auto_keys())} fits {recipe.model.name} on {gpu.name} "
            f"({gpu.memory_gib:.1f} GiB): {result.reasons[0]}",
            hint="What would fit: " + "; ".join(result.suggestions),
        )
    return result




def resolve_for_run(recipe: Recipe, resume: bool = True) -> tuple[Recipe, Plan | None]:
    """The recipe a run starts with: ``auto`` values resolved for the device it runs on.

    A run folder that already holds a resolved recipe with checkpoints keeps its values (a resume
    continues with the same micro-batch, after any out-of-memory back-off); otherwise the planner
    chooses for the detected GPU, or for the CPU (80 % of its RAM) when there is none.
    """
    from finetuner.config.hardware import run_profile
    from finetuner.config.recipe import Recipe
    from finetuner.config.recipe_yaml import load_yaml

    if not recipe.auto_keys():
        return recipe, None
    saved = recipe.output_path() / "recipe.yaml"
    if resume and saved.is_file() and any((recipe.output_path() / "checkpoints").glob("step-*")):
        old = load_yaml(saved.read_text(encoding="utf-8"), str(saved)) or {}
        raw = recipe.to_dict()
        for key in recipe.auto_keys():
            node_new, node_old = raw, old
            *parents, leaf = key.split(".")
            for part in parents:
                node_new, node_old = node_new[part], node_old.get(part, {})
            if leaf in node_old:
                node_new[leaf] = node_old[leaf]
        if "quantization" in old and raw.get("method") == "qlora":
            raw["quantization"] = old["quantization"]
        raw["training"]["effective_batch"] = None
        resolved = Recipe.model_validate(raw)
        if not resolved.auto_keys():
            return resolved, None
    result = resolve_auto(recipe, run_profile(recipe.device), label_fraction=label_fraction_of(recipe))
    return Recipe.model_validate(result.recipe.to_dict()), result

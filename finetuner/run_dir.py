"""The run folder: where a run lives, and whether a new run may use it.

``runs/<name>/`` (or the recipe's ``output_dir``) holds ``recipe.yaml`` (resolved),
``events.jsonl``, ``checkpoints/``, ``adapter/``, ``metrics.json`` and ``tensorboard/``.
Nothing in it is ever deleted by starting a run: ``--no-resume`` moves an old run aside.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from finetuner import checkpoint as ckpt_io
from finetuner.errors import UserError
from finetuner.recipe import Recipe

#: Keys that must match for a checkpoint to be resumed with a recipe.
RESUME_KEYS = (
    "model.name",
    "model.revision",
    "method",
    "lora",
    "quantization",
    "data.path",
    "data.format",
    "data.max_seq_len",
    "data.packing",
    "data.train_on_prompt",
    "data.val_size",
    "training.seed",
    "training.optimizer",
)


def _get(d: dict[str, Any], dotted: str) -> Any:
    for k in dotted.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def recipe_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    diffs = [f"{k}: {_get(old, k)!r} → {_get(new, k)!r}" for k in RESUME_KEYS if _get(old, k) != _get(new, k)]
    eff_old = _get(old, "training.micro_batch_size") * _get(old, "training.gradient_accumulation")
    eff_new = _get(new, "training.micro_batch_size") * _get(new, "training.gradient_accumulation")
    if eff_old != eff_new:
        diffs.append(f"effective batch (micro_batch_size × gradient_accumulation): {eff_old} → {eff_new}")
    return diffs


def prepare_run_dir(recipe: Recipe, resume: bool) -> tuple[Path, Recipe, list[str]]:
    """Create or check the run folder; returns it, the recipe to run, and notes for the user."""
    import yaml

    run_dir = recipe.output_path()
    notes: list[str] = []
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"Output path {run_dir} is a file, not a folder.", hint="Choose another --output.")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        saved = run_dir / "recipe.yaml"
        if not saved.is_file():
            raise UserError(
                f"Output folder {run_dir} is not empty and holds no finetuner run; finetuner will not write into it.",
                hint="Choose another --output (or output_dir), or empty that folder yourself.",
            )
        if not resume:
            aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            run_dir.rename(aside)
            notes.append(f"--no-resume: the previous run in {run_dir} was moved to {aside}.")
        else:
            last = ckpt_io.latest_checkpoint(run_dir)
            if last is not None:
                old = yaml.safe_load(saved.read_text(encoding="utf-8")) or {}
                diffs = recipe_differences(old, recipe.to_dict())
                if diffs:
                    raise UserError(
                        f"{run_dir} holds a run with checkpoints made by a different recipe:\n  "
                        + "\n  ".join(diffs),
                        hint="Use --no-resume to start over (the old run is moved aside, not deleted), or --output for a new folder.",
                    )
                state = ckpt_io.load_trainer_state(last)
                t = recipe.training.model_copy(
                    update={"micro_batch_size": state["micro_batch_size"], "gradient_accumulation": state["gradient_accumulation"]}
                )
                recipe = recipe.model_copy(update={"training": t})
                notes.append(f"Resuming {run_dir} from {last.name}.")
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe = recipe.model_copy(update={"output_dir": str(run_dir)})
    recipe.save(run_dir / "recipe.yaml")
    return run_dir, recipe, notes

"""What a run reads, checked before its run folder is changed."""

from __future__ import annotations

from finetuner.config.recipe import Recipe


def check_inputs(recipe: Recipe) -> None:
    """Load the model's tokenizer and read, check and tokenize the data as the run will (into the
    data cache, so the run itself then reads it from there): a bad model or data file is a
    :class:`~finetuner.errors.UserError` here. ``--no-resume`` moves an old run aside only after this
    (:func:`finetuner.runs.folder.prepare_run_dir`)."""
    from finetuner.data.run_inputs import text_inputs
    from finetuner.objectives import build_objective
    from finetuner.quiet import quieted

    with quieted():
        build_objective(recipe).prepare_data(*text_inputs(recipe))

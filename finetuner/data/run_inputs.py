"""A run's text inputs: its tokenizer and, for a picture run, its processor, decided once for the trainer and the
checks before a run.

A run is a picture run when its model is an image-text-to-text checkpoint
(:func:`finetuner.model.vision.image_text_type`) and its data has pictures: reading the rows is data's question,
so the decision lives here, above the model's processor loading (:mod:`finetuner.model.vision`).
"""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError
from finetuner.model.vision import image_text_type, load_processor, set_max_pixels


def data_has_pictures(data) -> bool:
    """Whether any row of ``data.path`` (a recipe's data section) has pictures: rows read until the first one that
    has (a bad row is left to the pipeline to report)."""
    from finetuner.data.formats import FileExamples

    for path in [data.path] if isinstance(data.path, str) else data.path:
        src = FileExamples(path, data.format, data.columns, data.system_prompt, data.split)
        try:
            if any(ex.get("images") for ex in src):
                return True
        except UserError:
            return False
        if src.bad and "picture" in str(src.bad[0]):  # a pictured row whose picture is missing: it reads pictures
            return True
    return False


def reads_pictures(recipe, cfg: dict[str, Any] | None) -> bool:
    """Whether ``recipe`` is a picture run (``cfg``: its model's ``config.json``, read once by the caller)."""
    return image_text_type(cfg) and data_has_pictures(recipe.data)


def text_inputs(recipe):
    """The run's tokenizer and, for a picture run (:func:`reads_pictures`), its processor (else None): decided
    here once, for the trainer and the checks before a run."""
    from finetuner.model.loading import load_tokenizer, stored_config

    m = recipe.model
    if reads_pictures(recipe, stored_config(m.name, m.revision)):
        processor = load_processor(m.name, m.revision, m.trust_remote_code)
        if recipe.data.max_pixels is not None:
            set_max_pixels(processor, recipe.data.max_pixels)
        return processor.tokenizer, processor
    return load_tokenizer(recipe), None

"""How many image tokens a data set's pictures cost, for the planner's profile of the data
(:func:`finetuner.data.stats.profile_data`): with the checkpoint's own processor where it loads (each example
encoded as the trainer encodes it), else from a preset's image processor settings or its fixed count a picture.
Only a picture's header is read for its size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from finetuner.data.formats import FileExamples, RowError
from finetuner.errors import UserError

def picture_processor_of(model: str | None, max_pixels: int | None = None):
    """The processor of ``model`` when it is an image-text-to-text checkpoint whose processor loads here (a local
    folder, the hub's cache, or the hub when it is reachable: its processor files are small; offline, nothing is
    asked of the hub, which would only retry), keeping at most ``max_pixels`` of a picture when given; None
    otherwise."""
    if not model:
        return None
    from finetuner.locate import hub_unreachable
    from finetuner.model.loading import stored_config
    from finetuner.model.shapes import preset_model
    from finetuner.model.vision import image_text_type, load_processor, set_max_pixels

    model = preset_model(model) or model
    if not image_text_type(stored_config(model, None)):
        return None
    try:
        processor = load_processor(model, local_only=hub_unreachable() is not None)
    except UserError:
        return None
    if max_pixels is not None:
        set_max_pixels(processor, max_pixels)
    return processor


def preset_picture_sizer(model: str | None, max_pixels: int | None = None):
    """For a preset whose processor files are not on this machine: the image processor its settings
    (:func:`~finetuner.model.shapes.preset_image_processor`) build, when it sizes pictures by their pixel count
    (the one kind whose tokens follow from a picture's size alone), keeping at most ``max_pixels``; None otherwise."""
    if not model:
        return None
    from finetuner.model.shapes import preset_image_processor
    from finetuner.model.vision import image_processor_from, pixel_budget, set_max_pixels

    settings = preset_image_processor(model)
    if settings is None:
        return None
    sizer = image_processor_from(settings)
    if pixel_budget(sizer) is None:
        return None
    if max_pixels is not None:
        set_max_pixels(sizer, max_pixels)
    return sizer


def preset_picture_tokens(model: str | None) -> int | None:
    """The image tokens every picture costs for an image-text preset whose tower takes one picture size, as its
    config says (``mm_tokens_per_image``: Gemma 3's 256); None for any other model."""
    from finetuner.model.shapes import find_preset, load_config
    from finetuner.model.vision import image_text_type

    if not model or find_preset(model) is None:
        return None
    cfg, _ = load_config(model)
    fixed = cfg.get("mm_tokens_per_image")
    return int(fixed) if image_text_type(cfg) and isinstance(fixed, int) else None


@dataclass
class PresetPictures:
    """How a preset counts a picture's tokens without the checkpoint's processor files."""

    tokens: Callable[[int, int], int]  # (width, height) -> image tokens
    budget: tuple[int, int] | None  # (fewest, most) pixels a picture keeps, for a pixel-count processor
    source: str  # what counted them, for the profile's note
    counted: str  # the same, for "counted with"
    limit: int  # the most pixels of a picture read (finetuner.data.picture_files.pixel_limit)


def preset_pictures(model: str | None, max_pixels: int | None = None) -> PresetPictures | None:
    """:func:`preset_picture_sizer`'s count (a pixel-count processor's settings, ``max_pixels`` kept), else
    :func:`preset_picture_tokens`' (a fixed count from the config); None for a model that is neither."""
    from finetuner.data.picture_files import pixel_limit
    from finetuner.model.vision import picture_tokens, pixel_budget

    sizer = preset_picture_sizer(model, max_pixels)
    if sizer is not None:
        return PresetPictures(lambda w, h: picture_tokens(sizer, w, h), pixel_budget(sizer),
                              "the preset's image processor settings",
                              f"the image processor settings of the {model} preset", pixel_limit(sizer))
    fixed = preset_picture_tokens(model)
    if fixed is not None:
        return PresetPictures(lambda w, h: fixed, None, "the preset's config",
                              f"{fixed} a picture, the {model} preset's mm_tokens_per_image", pixel_limit())
    return None


def add_picture_tokens(src: FileExamples, lengths: list[int], tokens, limit: int) -> tuple[int, int]:
    """Add to each of ``lengths`` (the examples of ``src`` in order, their text counted) the image tokens of its
    pictures, ``tokens(width, height)`` each; the image tokens in all and the largest picture's pixels. A picture
    that does not open is left to the trainer to report with its row; one over ``limit`` pixels is refused
    (:class:`~finetuner.data.picture_files.PictureTooLarge`), as the trainer would refuse it."""
    from finetuner.data.picture_files import picture_size

    added = largest = 0
    for i, ex in enumerate(src):
        if i >= len(lengths):
            break
        for path in ex.get("images") or []:
            size = picture_size(path, limit)  # the header only
            if size is None:
                continue
            width, height = size
            n = tokens(width, height)
            lengths[i] += n
            added += n
            largest = max(largest, width * height)
    return added, largest


def picture_lengths(src: FileExamples, processor, chat_template: str | None, max_rows: int) -> tuple[list[int], int, int, int, int]:
    """Each example's tokens (at most ``max_rows``) as the trainer encodes them with the processor (its pictures'
    image tokens included), the trained and total tokens, the image tokens in all, and the largest picture's pixels."""
    from finetuner.config.sections import DataSection
    from finetuner.data.images import encode_pictured, image_token_ids
    from finetuner.data.picture_files import picture_size, pixel_limit
    from finetuner.data.pipeline import IGNORE_INDEX, chat_template_for

    template = chat_template_for(processor, DataSection(path="-", chat_template=chat_template))
    pictured = image_token_ids(processor)
    limit = pixel_limit(processor)
    lengths, trained, total, image_tokens, largest = [], 0, 0, 0, 0
    for ex in src:
        try:
            enc = encode_pictured(ex, processor, template, 1 << 30, False)
        except RowError as e:  # the trainer reports it (or skips it) with its place
            src.bad.append(RowError(f"{ex['_where']}: {e}."))
            continue
        lengths.append(len(enc["input_ids"]))
        trained += sum(1 for t in enc["labels"] if t != IGNORE_INDEX)
        total += len(enc["input_ids"])
        image_tokens += sum(1 for t in enc["input_ids"] if t in pictured)
        for path in ex.get("images") or []:
            width, height = picture_size(path, limit) or (0, 0)  # the header only (encoded above: it reads)
            largest = max(largest, width * height)
        if len(lengths) >= max_rows:
            break
    return lengths, trained, total, image_tokens, largest

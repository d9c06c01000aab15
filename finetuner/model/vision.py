"""Image-text-to-text models: whether a model reads pictures, and the processor that turns them into tokens.

A run is a picture run when its model is an image-text-to-text checkpoint (its ``config.json``'s ``model_type`` is
one transformers loads with ``AutoModelForImageTextToText``, and it has a ``vision_config``) and its data has
pictures (:mod:`finetuner.data.images`; decided by :mod:`finetuner.data.run_inputs`, which reads the rows). Such a
run loads the model with ``AutoModelForImageTextToText`` and the checkpoint's ``AutoProcessor`` (its tokenizer,
its image processor, its chat template); LoRA's ``all-linear`` targets the language model alone
(:func:`finetuner.model.layout.all_linear_targets`), the vision tower and the projector stay frozen. The same
checkpoint on text data trains as a text model, as before.

A processor that carries a video processor (Qwen2.5-VL's, Qwen3-VL's) loads without it where torchvision, which
transformers' video processors need, is not installed (:func:`without_video`): pictures need none. A processor that
cannot be built at all for a missing package (Pixtral's needs torchvision) is a one-line :class:`UserError` naming
the package, before any training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetuner.errors import UserError, first_line


def image_text_type(cfg: dict[str, Any] | None) -> bool:
    """Whether ``cfg`` (a ``config.json``) is an image-text-to-text model's: a vision tower and a model type
    transformers loads with ``AutoModelForImageTextToText``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return bool(cfg) and cfg.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and "vision_config" in cfg


#: the image processors that size a picture by its pixel count (Qwen2-VL's, which Qwen2-VL, Qwen2.5-VL and Qwen3-VL
#: use): ``size["longest_edge"]`` is the most pixels a picture keeps (a larger one is scaled down to it, its image
#: tokens pixels / (patch x merge)²), ``size["shortest_edge"]`` the fewest
PIXEL_BUDGET_PROCESSORS = ("Qwen2VLImageProcessor",)


def pixel_budget(processor) -> tuple[int, int] | None:
    """``(fewest, most)`` pixels a picture keeps, for a processor (or an image processor alone) that sizes pictures
    by their pixel count; None for the others (a fixed size, tiles: their pictures cost what their settings say)."""
    ip = getattr(processor, "image_processor", processor)
    if ip is None or not type(ip).__name__.startswith(PIXEL_BUDGET_PROCESSORS):
        return None
    size = ip.size
    return int(size["shortest_edge"]), int(size["longest_edge"])


def largest_pixels(processor) -> int | None:
    """The most pixels of a picture ``processor`` (or an image processor alone) keeps, from its settings: its pixel
    budget's most, its fixed size, its longest edge squared, its largest grid pinpoint, times its tiles; None when
    its settings say none of these. What :func:`finetuner.data.picture_files.pixel_limit` sizes its limit from."""
    ip = getattr(processor, "image_processor", processor)
    if ip is None:
        return None
    budget = pixel_budget(ip)
    if budget is not None:
        return budget[1]
    pinpoints = getattr(ip, "image_grid_pinpoints", None) or []
    found = [int(h) * int(w) for h, w in pinpoints if isinstance(h, int) and isinstance(w, int)]
    for size in (getattr(ip, "size", None), getattr(ip, "crop_size", None)):
        if size is None:
            continue
        get = size.get if isinstance(size, dict) else lambda key, s=size: getattr(s, key, None)  # a dict, or a SizeDict
        for a, b in (("height", "width"), ("max_height", "max_width"), ("longest_edge", "longest_edge"),
                     ("shortest_edge", "shortest_edge")):
            if isinstance(get(a), int) and isinstance(get(b), int):
                found.append(get(a) * get(b))
        if isinstance(get("max_pixels"), int):
            found.append(get("max_pixels"))
    if not found:
        return None
    tiles = getattr(ip, "max_image_tiles", None)
    return max(found) * (tiles if isinstance(tiles, int) and tiles > 0 else 1)


def set_max_pixels(processor, max_pixels: int) -> None:
    """Make ``processor`` (or an image processor alone) keep at most ``max_pixels`` pixels of a picture
    (``data.max_pixels``); a one-line error for a processor that does not size pictures by their pixel count, or a
    value under its least."""
    ip = getattr(processor, "image_processor", processor)
    budget = pixel_budget(ip)
    if budget is None:
        raise UserError(f"data.max_pixels: this model's image processor ({type(ip).__name__}) "
                        "does not size pictures by their pixel count.",
                        hint="Leave data.max_pixels out: the processor's own settings size the pictures.")
    if max_pixels < budget[0]:
        raise UserError(f"data.max_pixels {max_pixels:,}: under the processor's least, {budget[0]:,} pixels.")
    ip.size = {"shortest_edge": budget[0], "longest_edge": int(max_pixels)}


def image_processor_from(settings: dict[str, Any]):
    """The image processor that ``settings`` (a ``preprocessor_config.json``'s contents, as a preset carries them
    under ``_image_processor``) describe: the class they name (its PIL variant where torchvision is not installed),
    built from them, nothing downloaded."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    from finetuner.quiet import quieted

    with quieted():
        cls = get_image_processor_class_from_name(settings["image_processor_type"])
        return cls(**{k: v for k, v in settings.items() if k != "image_processor_type"})


def picture_tokens(image_processor, width: int, height: int) -> int:
    """The image tokens a ``width`` x ``height`` picture becomes with a processor that sizes pictures by their pixel
    count (:data:`PIXEL_BUDGET_PROCESSORS`): its patches after the processor's resize (transformers'
    ``get_number_of_image_patches``, what the processor's own token count uses), ``merge_size``² patches a token."""
    return image_processor.get_number_of_image_patches(height, width, {}) // image_processor.merge_size ** 2


def load_processor(name: str, revision: str | None = None, trust_remote_code: bool = False, local_only: bool = False):
    """The checkpoint's ``AutoProcessor`` (tokenizer, image processor, chat template), its tokenizer given a pad
    token when it has none; a one-line error when it has none. ``local_only``: from a folder or the hub's cache,
    never asking the hub."""
    from transformers import AutoProcessor

    from finetuner.quiet import quieted

    try:
        with quieted():
            try:
                processor = AutoProcessor.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code,
                                                          local_files_only=local_only)
            except (ImportError, OSError) as e:  # its video processor without torchvision (or saved without one)
                cls = processor_class(name, revision, trust_remote_code, local_only)
                if cls is None or without_video(cls) is cls:
                    raise
                try:
                    processor = without_video(cls).from_pretrained(name, revision=revision, local_files_only=local_only,
                                                                   trust_remote_code=trust_remote_code)
                except Exception:  # noqa: BLE001 - it cannot do without its video processor
                    raise e from None
    except ImportError as e:  # a package the family's processor needs (torchvision for Pixtral's)
        raise UserError(f"model.name: the processor of '{name}' needs a package that is not installed "
                        f"({first_line(str(e), 200).split('. ')[0].rstrip('.')}).",
                        hint="Install the package it names (pip install torchvision ...).") from None
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, KeyError: no or a broken processor config
        raise UserError(f"model.name: could not load the processor of '{name}' ({first_line(str(e), 200)}).",
                        hint="An image-text-to-text checkpoint needs its processor files (processor_config.json or "
                             "preprocessor_config.json, the tokenizer's).") from None
    tok = getattr(processor, "tokenizer", None)
    if tok is None or not hasattr(processor, "image_processor"):
        raise UserError(f"model.name: '{name}''s processor has no tokenizer and image processor, so it cannot "
                        "read pictures.")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return processor


def processor_class(name: str, revision: str | None = None, trust_remote_code: bool = False, local_only: bool = False):
    """The checkpoint's processor class: its ``processor_config.json``'s, else the one transformers maps its model
    type to (None when neither names one)."""
    import json

    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name
    from transformers.utils import cached_file

    path = cached_file(name, "processor_config.json", revision=revision, local_files_only=local_only,
                       _raise_exceptions_for_missing_entries=False)
    cls_name = json.loads(Path(path).read_text(encoding="utf-8")).get("processor_class") if path else None
    if not cls_name:
        model_type = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code,
                                                local_files_only=local_only).model_type
        cls_name = PROCESSOR_MAPPING_NAMES.get(model_type)
    return processor_class_from_name(cls_name) if isinstance(cls_name, str) else None


def without_video(cls):
    """``cls`` (a processor class) when torchvision is installed or it has no video processor; else a subclass of
    the same name without one (transformers' video processors need torchvision, pictures do not): built from an
    image processor and a tokenizer (``video_processor`` None, also where ``cls`` requires the argument: SmolVLM's),
    saved and loaded as ``cls`` is. None for None."""
    from transformers.utils import is_torchvision_available

    if cls is None or is_torchvision_available() or "video_processor" not in cls.get_attributes():
        return cls
    import types

    kept = [a for a in cls.get_attributes() if a != "video_processor"]
    namespace = {"__module__": cls.__module__, "get_attributes": classmethod(lambda c: list(kept))}
    init = cls.__init__
    code = getattr(init, "__code__", None)
    names = code.co_varnames[:code.co_argcount] if code else ()
    defaults = init.__defaults__ or () if code else ()
    first_default = len(names) - len(defaults)
    if "video_processor" in names and names.index("video_processor") < first_default:
        # SmolVLM's requires the argument: the same __init__ with None for it (transformers reads the names an
        # __init__ takes from its code, so a wrapper taking *args would lose the processor's settings)
        filled = (None,) * (first_default - names.index("video_processor")) + tuple(defaults)
        namespace["__init__"] = types.FunctionType(code, init.__globals__, init.__name__, filled, init.__closure__)
        namespace["__init__"].__kwdefaults__ = init.__kwdefaults__
    return type(cls.__name__, (cls,), namespace)


def refuse_pictures_only(recipe) -> None:
    """An image-text-to-text checkpoint with no text-only class (LLaVA, Qwen2.5-VL ...) on data without pictures:
    one line saying so (transformers' own error names the causal-LM classes and suggests downloading again)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from finetuner.model.loading import stored_config

    m = recipe.model
    stored = stored_config(m.name, m.revision)
    if stored and image_text_type(stored) and stored.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"model.name: '{m.name}' is an image-text model ({stored.get('model_type')}) with no text-only "
                        "class in transformers, and the data has no pictures.",
                        hint="Train it on a data file whose rows carry pictures, or choose a text model.")

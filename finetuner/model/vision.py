"""Image-text-to-text models: whether a run reads pictures, and the processor that turns them into tokens.

A run is a picture run when its model is an image-text-to-text checkpoint (its ``config.json``'s ``model_type`` is
one transformers loads with ``AutoModelForImageTextToText``, and it has a ``vision_config``) and its data has
pictures (:mod:`finetuner.data.images`). Such a run loads the model with ``AutoModelForImageTextToText`` and the
checkpoint's ``AutoProcessor`` (its tokenizer, its image processor, its chat template); LoRA's ``all-linear``
targets the language model alone (:func:`finetuner.model.layout.all_linear_targets`), the vision tower and the
projector stay frozen. The same checkpoint on text data trains as a text model, as before.

A processor that carries a video processor (Qwen2.5-VL's, Qwen3-VL's) loads without it where torchvision, which
transformers' video processors need, is not installed (:func:`without_video`): pictures need none. A processor that
cannot be built at all for a missing package (Pixtral's needs torchvision, SmolVLM's its video processor and
num2words) is a one-line :class:`UserError` naming the package, before any training.
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


#: the image processors that size a picture by its pixel count (Qwen2-VL's, which Qwen2-VL, Qwen2.5-VL and Qwen3-VL
#: use): ``size["longest_edge"]`` is the most pixels a picture keeps (a larger one is scaled down to it, its image
#: tokens pixels / (patch x merge)²), ``size["shortest_edge"]`` the fewest
PIXEL_BUDGET_PROCESSORS = ("Qwen2VLImageProcessor",)


def pixel_budget(processor) -> tuple[int, int] | None:
    """``(fewest, most)`` pixels a picture keeps, for a processor that sizes pictures by their pixel count; None for
    the others (a fixed size, tiles: their pictures cost what their settings say)."""
    ip = getattr(processor, "image_processor", None)
    if ip is None or not type(ip).__name__.startswith(PIXEL_BUDGET_PROCESSORS):
        return None
    size = ip.size
    return int(size["shortest_edge"]), int(size["longest_edge"])


def set_max_pixels(processor, max_pixels: int) -> None:
    """Make ``processor`` keep at most ``max_pixels`` pixels of a picture (``data.max_pixels``); a one-line error
    for a processor that does not size pictures by their pixel count, or a value under its least."""
    budget = pixel_budget(processor)
    if budget is None:
        raise UserError(f"data.max_pixels: this model's image processor ({type(processor.image_processor).__name__}) "
                        "does not size pictures by their pixel count.",
                        hint="Leave data.max_pixels out: the processor's own settings size the pictures.")
    if max_pixels < budget[0]:
        raise UserError(f"data.max_pixels {max_pixels:,}: under the processor's least, {budget[0]:,} pixels.")
    processor.image_processor.size = {"shortest_edge": budget[0], "longest_edge": int(max_pixels)}


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
                except Exception:  # noqa: BLE001 - it cannot do without its video processor (SmolVLM's)
                    raise e from None
    except ImportError as e:  # a package the family's processor needs (torchvision for Pixtral's, num2words)
        raise UserError(f"model.name: the processor of '{name}' needs a package that is not installed "
                        f"({first_line(str(e), 200).split('. ')[0].rstrip('.')}).",
                        hint="Install the package it names (pip install torchvision, num2words ...).") from None
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
    image processor and a tokenizer (where ``cls`` takes its video processor as an optional argument), saved and
    loaded as ``cls`` is. None for None."""
    from transformers.utils import is_torchvision_available

    if cls is None or is_torchvision_available() or "video_processor" not in cls.get_attributes():
        return cls
    kept = [a for a in cls.get_attributes() if a != "video_processor"]
    return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                       "get_attributes": classmethod(lambda c: list(kept))})


def vision_parts(model) -> tuple[str, list[str]]:
    """The vision tower's module path and the projector's (one or more) in an image-text model, read from the model:
    the tower is transformers' own ``get_encoder("image")``; the projector is what the model holds beside the tower
    and the language model (``get_decoder()``): LLaVA's and Gemma 3's ``multi_modal_projector``, Idefics3's
    ``connector``; where the tower holds it (Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's ``visual.merger``, Qwen3-VL's
    ``deepstack_merger_list``: transformers' Qwen vision models name their projectors ``merger``), its children so
    named."""
    tower, language = model.get_encoder("image"), model.get_decoder()
    if tower is model or tower is None:
        raise UserError(f"{type(model).__name__} has no vision tower transformers knows of (get_encoder('image')).")
    paths = {id(m): name for name, m in model.named_modules()}
    tower_path = paths[id(tower)]
    holder = model.get_submodule(tower_path.rpartition(".")[0]) if "." in tower_path else model
    projectors = [paths[id(m)] for _, m in holder.named_children() if m is not tower and m is not language]
    if not projectors:
        projectors = [f"{tower_path}.{name}" for name, _ in tower.named_children() if "merger" in name]
    import torch

    # a list of projectors (Qwen3-VL's deepstack mergers): each one (peft's modules_to_save wraps modules, not lists)
    projectors = [f"{p}.{i}" for p in projectors for i, _ in (
        model.get_submodule(p).named_children() if isinstance(model.get_submodule(p), torch.nn.ModuleList) else [("", None)])]
    projectors = [p.rstrip(".") for p in projectors]
    if not projectors:
        raise UserError(f"{type(model).__name__}: no projector was found beside its vision tower ({tower_path}).")
    return tower_path, projectors


def vision_tower_linears(model, tower: str, projectors: list[str]) -> list[str]:
    """The paths of the vision tower's linear layers, the projector's left out (LoRA's targets with
    ``lora.train_vision_tower``)."""
    import torch

    inside = [p + "." for p in projectors]
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.startswith(tower + ".")
            and not any(name.startswith(p) for p in inside)]


def lora_targets_with_tower(target, model, tower: str, projectors: list[str]) -> str:
    """peft's ``target_modules`` with the vision tower's linears added: one regular expression (peft full-matches
    a string against each module's path), the language model's targets as they were (a list of names: those
    names anywhere, peft's own rule for a list)."""
    import re

    if target == "all-linear":
        raise UserError("lora.train_vision_tower needs the language model's targets as paths; this model's "
                        "'all-linear' is peft's own.", hint="Name the targets in lora.target_modules.")
    language = target if isinstance(target, str) else r"(?:.*\.)?(?:" + "|".join(re.escape(n) for n in target) + ")"
    tower_paths = vision_tower_linears(model, tower, projectors)
    return f"(?:{language})|(?:" + "|".join(re.escape(n) for n in tower_paths) + ")"


def not_quantized(config: dict[str, Any], trust_remote_code: bool = False) -> list[str]:
    """What a 4-bit load must leave unquantized when the projector trains (``lora.train_projector``: its copy is
    trained, and 4-bit weights cannot be): transformers' own defaults (the output layer and what is tied to it,
    ``get_keys_to_not_convert``, which a list of one's own replaces) and the projector's paths, read from the
    model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.quantizers.base import get_keys_to_not_convert

    cfg = AutoConfig.for_model(**config) if "model_type" in config else AutoConfig.from_dict(config)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg, trust_remote_code=trust_remote_code)
    _, projectors = vision_parts(model)
    return sorted(set(get_keys_to_not_convert(model)) | set(projectors))

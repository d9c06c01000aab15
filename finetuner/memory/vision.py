"""What training an image-text model's projector or vision tower adds to the memory of a picture run.

With ``lora.train_projector`` or ``lora.train_vision_tower`` the picture's way through the vision tower and the
projector takes part in the backward: their trainable tensors (the projector's copy in full, the tower's LoRA
matrices) get fp32 weights, gradients and optimizer states like the language model's LoRA, and what autograd keeps
of the tower's forward stays alive until the backward reaches it. Both are read from the model itself
(:func:`finetuner.model.vision_parts.vision_parts`): the model is built on the ``meta`` device, the adapter applied as
the trainer applies it (:func:`finetuner.model.loading.prepare_for_training`'s targets), and one picture of the
data's largest size goes through ``get_image_features`` under ``saved_tensors_hooks`` (as
:mod:`finetuner.model.trace` does for a decoder layer: each storage once, parameters left out).

What the trace cannot see, stated, not guessed: it runs in fp32 without autocast and without checkpointing, so on a
GPU in bf16 or with the tower's layers checkpointed it counts more than is kept (an upper bound); a tower whose
forward needs values on the CPU (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's picture grid) cannot run on ``meta``, and
then only its trainable tensors are counted, with a note saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionCost:
    """The vision side's training cost in a picture run."""

    #: the trainable tensors of the tower and projector as ``(rows, cols, copies)`` (the memory model's form)
    trainable: tuple[tuple[int, int, int], ...]
    #: bytes autograd keeps of one picture's way through the tower and projector (None: not traced, see ``note``)
    saved_per_picture: int | None
    #: the most pictures one example has
    per_example: int
    note: str

    def activation_bytes(self, micro_batch: int) -> int:
        """What a micro-batch of ``micro_batch`` examples keeps, each with the most pictures one has."""
        return (self.saved_per_picture or 0) * self.per_example * micro_batch

    @property
    def trainable_params(self) -> int:
        return sum(r * c * k for r, c, k in self.trainable)


def _largest_picture(paths: list[str], limit: int) -> tuple[int, int]:
    """The largest of the pictures at ``paths`` (their headers; one over ``limit`` pixels refused, as the trainer
    refuses it: the traced stand-in is never larger); 224 x 224 when none opens."""
    from finetuner.data.picture_files import picture_size

    best = (0, 0)
    for path in paths:
        size = picture_size(path, limit)  # the header only
        if size is None:
            continue  # an unreadable picture is the data check's to report
        if size[0] * size[1] > best[0] * best[1]:
            best = size
    return best if best[0] else (224, 224)


def data_pictures(path: str) -> tuple[list[str], int]:
    """Every picture of a data file and the most one example has."""
    from finetuner.data.formats import FileExamples

    pictures, most = [], 0
    for ex in FileExamples(path):
        images = ex.get("images") or []
        pictures += images
        most = max(most, len(images))
    return pictures, most


def vision_cost(recipe, processor, pictures: list[str], most_per_example: int) -> VisionCost | None:
    """The :class:`VisionCost` of ``recipe`` (None when it trains neither the projector nor the tower):
    ``processor`` the model's (its image processor sizes the traced picture; None: not traced), ``pictures`` the
    data's."""
    lc = recipe.lora
    if recipe.method == "full" or not (lc.train_projector or lc.train_vision_tower):
        return None
    import torch
    from PIL import Image
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetuner.model.layout import all_linear_targets
    from finetuner.model.trace import TRACE_ATTENTION, register_trace_attention
    from finetuner.model.vision_parts import lora_targets_with_tower, vision_parts

    register_trace_attention()
    m = recipe.model
    config = AutoConfig.from_pretrained(m.name, revision=m.revision, trust_remote_code=m.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=m.trust_remote_code)
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            module.config._attn_implementation = TRACE_ATTENTION
    model = model.float()
    tower, projectors = vision_parts(model)
    target = all_linear_targets(model) if lc.target_modules == "all-linear" else lc.target_modules
    if lc.train_vision_tower:
        target = lora_targets_with_tower(target, model, tower, projectors)
    peft_model = get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                                  target_modules=target, modules_to_save=projectors if lc.train_projector else None))
    peft_model.train()
    vision = [tower] + projectors
    trainable = tuple((p.shape[0], p[0].numel() if p.dim() > 1 else 1, 1) for name, p in peft_model.named_parameters()
                      if p.requires_grad and any(f"{v}." in name for v in vision))
    per_example = max(1, most_per_example)
    if processor is None:
        return VisionCost(trainable, None, per_example, "the vision tower's activations are not counted: the model's "
                                                        "processor (the pictures' size) is not on this machine")
    from finetuner.data.picture_files import pixel_limit

    width, height = _largest_picture(pictures, pixel_limit(processor))
    text = processor.tokenizer.apply_chat_template(  # as the trainer renders (SmolVLM's own needs its video processor)
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
        chat_template=processor.chat_template, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[Image.new("RGB", (width, height))], return_tensors="pt")
    names = [n for n in getattr(processor.image_processor, "model_input_names", ["pixel_values"]) if n in inputs]
    kwargs: dict[str, Any] = {n: inputs[n].to("meta") if inputs[n].is_floating_point() else inputs[n] for n in names}
    params = {p.untyped_storage()._cdata for p in peft_model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            peft_model.get_base_model().model.get_image_features(**kwargs)
    except Exception as e:  # noqa: BLE001 - a tower meta cannot run: its activations are not counted, and it says so
        return VisionCost(trainable, None, per_example,
                          f"the vision tower's activations are not counted: it does not run on the meta device "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    return VisionCost(trainable, sum(seen.values()), per_example,
                      f"the vision tower's and projector's activations traced for a {width}x{height} picture (fp32, "
                      f"without checkpointing: an upper bound), {per_example} an example")


def vision_cost_of(recipe):
    """:func:`vision_cost` for a recipe: its model's processor (offline, from this machine only; none found: the
    tower's activations are not counted, and the note says so), its data's pictures (one an example at the
    processor's size when the data cannot be read here); None when it trains neither the projector nor the tower
    (a recipe whose method is ``auto``: its LoRA options')."""
    lc = recipe.lora
    if recipe.method == "full" or not (lc.train_projector or lc.train_vision_tower):
        return None
    key = _cost_key(recipe)
    if key not in _COSTS:  # a plan asks twice (its search, then the chosen recipe's prediction): traced once
        _COSTS[key] = _vision_cost_of(recipe)
        while len(_COSTS) > 8:
            _COSTS.pop(next(iter(_COSTS)))
    return _COSTS[key]


#: :func:`vision_cost_of`'s results in this process, by :func:`_cost_key`
_COSTS: dict[str, VisionCost | None] = {}


def _cost_key(recipe) -> str:
    """What :func:`vision_cost_of` reads of a recipe: its model (and a local folder's config.json's modification
    time), its LoRA settings, its data files (and theirs)."""
    import json
    from pathlib import Path

    paths = [recipe.data.path] if isinstance(recipe.data.path, str) else list(recipe.data.path)
    files = [*map(str, paths), str(Path(recipe.model.name).expanduser() / "config.json")]
    stamps = [Path(p).stat().st_mtime_ns if Path(p).is_file() else None for p in files]
    return json.dumps([recipe.model.model_dump(mode="json"), recipe.lora.model_dump(mode="json"),
                       [str(p) for p in paths], stamps], sort_keys=True, default=str)


def _vision_cost_of(recipe):
    from finetuner.errors import UserError
    from finetuner.locate import hub_unreachable
    from finetuner.model.vision import load_processor

    try:
        pictures, most = data_pictures(str(recipe.data.path))
    except (UserError, OSError):
        pictures, most = [], 1
    try:
        processor = load_processor(recipe.model.name, trust_remote_code=recipe.model.trust_remote_code,
                                   local_only=hub_unreachable() is not None)
    except UserError:
        processor = None
    return vision_cost(recipe, processor, pictures, most)

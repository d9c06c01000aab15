"""Where an image-text model keeps its vision tower and projector, read from the model itself, and what training
them changes: LoRA's targets with the tower's linears (``lora.train_vision_tower``), and what a 4-bit load must leave
whole when the projector trains (``lora.train_projector``)."""

from __future__ import annotations

from typing import Any

from finetuner.errors import UserError


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

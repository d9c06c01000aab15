"""The runtime: a recipe resolved for a device, once — every ``auto`` that depends on the machine.

Recipe + device → :class:`Runtime` (dtypes, autocast precision, bitsandbytes compute dtype,
attention, Liger kernels, loss path, ``torch.compile``). :func:`resolve` is pure: it reads the
recipe and a :class:`Device`, the facts about a machine that matter here (CPU or CUDA, bf16,
whether FlashAttention-2 and Liger can run). A :class:`Device` comes from this machine
(:meth:`Device.here`, imports torch) for a run, or from a card's profile (:meth:`Device.of`) for
the planner and the memory model, which are asked about cards that are not in this machine.

Every reader takes the same answer: the trainer (loading, autocast, loss), the memory model
(:func:`finetuner.memory.model.settings_from_recipe` builds its settings from a Runtime), the planner
(through the memory model), the multi-process launcher (DeepSpeed/accelerate precision), and
chat/eval (a run's base is loaded as it was trained).

The rules:

* **device**: ``cuda`` when a CUDA device is there and the recipe does not say ``device: cpu``.
* **precision** (autocast, ``training.precision: auto``): bf16 on a card that has it, fp16 on one
  that has not (T4, V100), fp32 (no autocast) on the CPU.
* **base_dtype** (storage of the frozen weights, ``model.dtype: auto``): fp32 on the CPU; on a
  GPU the half type above, except full fine-tuning, which keeps fp32 master weights. A dtype the
  recipe names is kept.
* **compute_dtype** (bitsandbytes, ``quantization.compute_dtype: auto``): the half type on a GPU,
  fp32 on the CPU.
* **attention** (``model.attn_implementation: auto``): ``flash_attention_2`` where it can run
  (the ``flash_attn`` package, an Ampere or newer card, 16-bit weights), else transformers'
  default (SDPA).
* **kernels** / **loss_path**: see :mod:`finetuner.model.kernels`.
* **tiled_mlp** (``training.tiled_mlp``): tokens per MLP chunk, 0 when not tiled; ``auto`` tiles
  with gradient checkpointing from ``data.max_seq_len`` 16,384
  (:func:`finetuner.model.tiled_mlp.resolve_tiled_mlp`). The same on every device.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

import finetuner.device as dev
from finetuner.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.hardware import GpuProfile
    from finetuner.config.recipe import Recipe

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class Device:
    """What the resolver needs to know about a machine."""

    platform: str  # a platform of finetuner.device.PLATFORMS (CPU or CUDA)
    bf16: bool = False  # the card computes in bf16 (Ampere and newer)
    flash_attention: bool = False  # FlashAttention-2 can run: flash_attn installed, Ampere or newer
    liger: bool = False  # Liger's kernels can run: liger-kernel and triton installed (and importable)

    @property
    def is_cuda(self) -> bool:
        return dev.is_cuda(self.platform)

    @classmethod
    def of(cls, gpu: GpuProfile | None) -> Device:
        """A card from its profile (the planner's view; ``None`` means an unnamed bf16 CUDA card).

        Whether FlashAttention-2 and Liger can run is what the profile says
        (``GpuProfile.flash_attention`` / ``liger``), else whether flash_attn and liger-kernel
        (with triton) are installed in this Python environment: a plan is made where the run will
        be launched. Every bf16 card is Ampere or newer.
        """
        if gpu is not None and gpu.platform == dev.CPU:
            return cls(dev.CPU)
        bf16 = gpu.bf16 if gpu is not None else True
        flash = gpu.flash_attention if gpu is not None and gpu.flash_attention is not None else _installed("flash_attn")
        liger = gpu.liger if gpu is not None and gpu.liger is not None else _installed("liger_kernel") and _installed("triton")
        return cls(dev.CUDA, bf16=bf16, flash_attention=bf16 and flash, liger=liger)

    @classmethod
    def here(cls, want: str = "auto") -> Device:
        """This machine for a recipe's ``device`` setting (``auto``, ``cpu`` or ``cuda``): :meth:`of` the
        detected card (:func:`finetuner.config.hardware.detect`, which says whether FlashAttention-2 and
        Liger run here), so a run and a plan for this card agree. Imports torch."""
        from finetuner.config.hardware import detect

        if dev.resolve(want) == dev.CPU:
            return cls(dev.CPU)
        return cls.of(detect())


#: How a CUDA user gets finetuner's fast path (README, Speed): the extra brings Liger Kernel and triton.
SPEED_INSTALL = "pip install 'finetuner[speed]'"
#: FlashAttention-2 is not an extra: its wheels are built per torch and CUDA version.
FLASH_INSTALL = "pip install flash-attn --no-build-isolation"


def fast_path(device: Device) -> dict[str, object]:
    """Which fast kernels a run on ``device`` uses with ``training.kernels: auto`` and
    ``model.attn_implementation: auto`` (what the ``start`` event will record), and what to install
    for the ones missing: ``{"device", "attention", "kernels", "loss_path", "missing": [hints]}``."""
    from finetuner.model import kernels

    if not device.is_cuda:
        return {"device": dev.CPU, "attention": "sdpa", "kernels": "none", "loss_path": kernels.loss_path("none", 1024),
                "missing": ["no CUDA device: Liger Kernel and FlashAttention-2 run on CUDA GPUs only"]}
    missing = []
    if not device.liger:
        missing.append(f"Liger Kernel (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy): {SPEED_INSTALL}")
    if not device.flash_attention:
        missing.append(f"FlashAttention-2: {FLASH_INSTALL} (where a wheel exists for your torch and CUDA), on an "
                       "Ampere or newer card" if device.bf16 else "FlashAttention-2 needs an Ampere or newer card")
    kern = "liger" if device.liger else "none"
    return {"device": dev.CUDA, "attention": "flash_attention_2" if device.flash_attention else "sdpa", "kernels": kern,
            "loss_path": kernels.loss_path(kern, 1024), "missing": missing}


@functools.cache
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@dataclass(frozen=True)
class Runtime:
    """A recipe's device-dependent choices, resolved (see the module doc)."""

    device: str  # a platform of finetuner.device.PLATFORMS (CPU or CUDA)
    base_dtype: str  # storage dtype of frozen weights: bf16 | fp16 | fp32
    precision: str  # autocast dtype: bf16 | fp16 | fp32 (fp32 = no autocast)
    compute_dtype: str  # bitsandbytes compute dtype for quantized layers
    attention: str = "auto"  # attn_implementation: auto (transformers' default, SDPA) | sdpa | eager | flash_attention_2
    kernels: str = "none"  # liger | none (see finetuner.model.kernels)
    loss_path: str = "chunked_ce"  # liger_fused_linear_ce | chunked_ce | full_logits
    compile: bool = False  # decoder layers under torch.compile
    tiled_mlp: int = 0  # tokens per MLP chunk (finetuner.model.tiled_mlp); 0: the MLP runs whole

    @property
    def is_cuda(self) -> bool:
        return dev.is_cuda(self.device)

    @property
    def gather_dtype(self) -> str:
        """The dtype FSDP all-gathers the parameters in (its mixed-precision policy): the autocast
        precision's; bitsandbytes keeps packed 4-bit weights in it under fsdp, so no cast touches them."""
        return self.precision

    def torch_dtype(self, name: str):
        import torch

        return getattr(torch, TORCH_DTYPES[name])


def resolve(recipe: Recipe, device: Device, model_type: str | None = None) -> Runtime:
    """The runtime of ``recipe`` on ``device``; ``model_type`` (the config's) decides Liger's support.

    Raises a UserError for a setting the device cannot honour (fp16 on the CPU, bf16 on a card
    without it, FlashAttention-2 or Liger where they cannot run).
    """
    from finetuner.model import kernels
    from finetuner.model.tiled_mlp import resolve_tiled_mlp

    cuda = device.is_cuda
    half = ("bf16" if device.bf16 else "fp16") if cuda else "fp32"
    precision = recipe.training.precision
    if precision == "auto":
        precision = half
    if not cuda and precision == "fp16":
        raise UserError("training.precision: fp16 is not supported on CPU.", hint="Use fp32 (or bf16, which is slow on most CPUs).")
    if cuda and precision == "bf16" and not device.bf16:
        raise UserError("training.precision: this GPU has no bf16 support.", hint="Use fp16 or auto.")
    base = recipe.model.dtype
    if base == "auto":
        base = "fp32" if (not cuda or recipe.method == "full") else half
    q = recipe.quantization
    compute = q.compute_dtype if q is not None else "auto"
    if compute == "auto":
        compute = half
    t = recipe.training
    kern = kernels.resolve_kernels(t.kernels, cuda, model_type, device.liger)
    return Runtime(
        device=device.platform,
        base_dtype=base,
        precision=precision,
        compute_dtype=compute,
        attention=kernels.resolve_attention(recipe.model.attn_implementation, cuda and device.flash_attention, base),
        kernels=kern,
        loss_path=kernels.loss_path(kern, t.loss_chunk_size),
        compile=t.compile,
        tiled_mlp=resolve_tiled_mlp(t.tiled_mlp, t.gradient_checkpointing, recipe.data.max_seq_len),
    )


def model_type_of(recipe: Recipe) -> str | None:
    """The base model's ``model_type`` from its config (None if it cannot be read here)."""
    from finetuner.model.shapes import load_config

    m = recipe.model
    try:
        return load_config(m.name, m.revision)[0].get("model_type")
    except (UserError, OSError, ValueError):  # loading the model reports the real problem with a hint
        return None


def resolve_runtime(recipe: Recipe) -> Runtime:
    """The runtime of ``recipe`` on this machine (the trainer's and chat's entry point)."""
    device = Device.here(recipe.device)
    return resolve(recipe, device, model_type_of(recipe) if device.is_cuda and recipe.training.kernels != "none" else None)

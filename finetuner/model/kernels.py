"""Which compute kernels a run uses: attention implementation, Liger's fused kernels, the loss
path, and ``torch.compile``, decided once per run from the recipe and the device.

* **Attention** (``model.attn_implementation: auto``): ``flash_attention_2`` when the
  ``flash_attn`` package imports, the GPU is Ampere or newer (compute capability ≥ 8.0) and the
  base weights are bf16/fp16; otherwise PyTorch's ``sdpa`` (which itself picks flash/memory-efficient
  kernels on CUDA). Packed rows stay apart with both (position ids restart per example).
* **Liger Kernel** (``training.kernels: auto | liger | none``, extra ``finetuner[speed]``): Triton
  kernels for RMSNorm, SwiGLU and RoPE patched into supported architectures, and the fused
  linear + cross-entropy that computes the loss and its gradient chunk by chunk without ever
  holding the ``tokens × vocab`` logits. CUDA only (Triton). ``auto`` uses it when it is
  installed, the run is on CUDA and the architecture is supported; ``liger`` insists.
* **Loss path** (what the memory model needs to know): ``liger_fused_linear_ce`` with Liger,
  else ``chunked_ce`` (finetuner's own: logits for ``training.loss_chunk_size`` trained tokens at a
  time, recomputed in backward), or ``full_logits`` when ``loss_chunk_size: 0``.
* **torch.compile** (``training.compile: true``): each decoder layer is compiled in place
  (``nn.Module.compile``), so the parameter names, the adapter files and checkpoints are unchanged.

Nothing here imports torch at module level; :func:`loss_path` is cheap enough for the planner.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from finetuner.errors import UserError

log = logging.getLogger(__name__)

#: model types Liger patches that finetuner has checked the decoder/LM-head layout of
LIGER_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "granite", "olmo2", "glm4", "smollm3",
})

LOSS_PATHS = ("liger_fused_linear_ce", "chunked_ce", "full_logits")


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


_LIGER_IMPORT_ERROR: list[str] = []


def liger_importable() -> bool:
    """Whether Liger's patching module imports with this transformers (checked once, on CUDA only)."""
    if not _LIGER_IMPORT_ERROR:
        try:
            import liger_kernel.transformers.fused_linear_cross_entropy  # noqa: F401
            import liger_kernel.transformers.monkey_patch  # noqa: F401

            _LIGER_IMPORT_ERROR.append("")
        except Exception as e:  # noqa: BLE001 - a version mismatch with transformers shows up here
            _LIGER_IMPORT_ERROR.append(f"{type(e).__name__}: {e}")
    return not _LIGER_IMPORT_ERROR[0]


def resolve_kernels(setting: str, on_cuda: bool, model_type: str | None, liger_available: bool) -> str:
    """``liger`` or ``none`` for ``training.kernels`` on this device and architecture;
    ``liger_available``: liger-kernel (and triton) installed and importable where the run is."""
    if setting == "none":
        return "none"
    usable = on_cuda and liger_available and model_type in LIGER_MODEL_TYPES
    if setting == "auto" and on_cuda and liger_installed() and not liger_available and _LIGER_IMPORT_ERROR and _LIGER_IMPORT_ERROR[0]:
        log.warning("liger-kernel is installed but does not import here (%s); training without it.", _LIGER_IMPORT_ERROR[0])
    if setting == "liger" and not usable:
        why = ("no CUDA GPU is in use (Liger's kernels are Triton, CUDA only)" if not on_cuda else
               "liger-kernel is not installed" if not liger_installed() else
               f"the architecture '{model_type}' is not one finetuner applies Liger to" if model_type not in LIGER_MODEL_TYPES else
               f"liger-kernel does not import with this transformers ({_LIGER_IMPORT_ERROR[0] if _LIGER_IMPORT_ERROR else 'unknown'})")
        raise UserError(
            f"training.kernels: liger was asked for but {why}.",
            hint="Install it with `pip install 'finetuner[speed]'` on a CUDA machine, or set training.kernels: auto.",
        )
    return "liger" if usable else "none"


def loss_path(kernels: str, loss_chunk_size: int) -> str:
    """How the loss is computed: one of :data:`LOSS_PATHS` (the memory model's logits term)."""
    if kernels == "liger":
        return "liger_fused_linear_ce"
    return "chunked_ce" if loss_chunk_size else "full_logits"


def resolve_attention(setting: str, flash_available: bool, base_dtype: str) -> str:
    """The ``attn_implementation`` passed to ``from_pretrained``; ``flash_available``: a CUDA card of
    Ampere or newer with the flash_attn package (FlashAttention-2 also needs 16-bit weights)."""
    usable = flash_available and base_dtype in ("bf16", "fp16")
    if setting != "auto":
        if setting == "flash_attention_2" and not usable:
            raise UserError(
                "model.attn_implementation: flash_attention_2 needs the flash_attn package, an Ampere or newer "
                "GPU and bf16/fp16 weights.",
                hint="Set model.attn_implementation: auto (SDPA, or FlashAttention-2 when it can run).",
            )
        return setting
    # otherwise transformers' default: SDPA for every architecture that supports it
    return "flash_attention_2" if usable else "auto"


def apply_liger(model) -> None:
    """Patch Liger's RMSNorm, SwiGLU and RoPE into a loaded (not yet peft-wrapped) model instance.

    The loss is not patched into ``forward``: finetuner calls the decoder and computes the loss
    itself (:func:`fused_linear_cross_entropy`), so only trained tokens reach the LM head.
    """
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )


def fused_linear_cross_entropy():
    """A function ``(head, hidden, targets, softcap) -> summed fp32 loss`` using Liger's fused kernel."""
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    losses: dict[float | None, Any] = {}

    def fused(head, hidden, targets, softcap=None):
        if softcap not in losses:
            losses[softcap] = LigerFusedLinearCrossEntropyLoss(reduction="sum", softcap=softcap or None)
        return losses[softcap](head.weight, hidden, targets, getattr(head, "bias", None)).float()

    return fused


def compile_layers(model, backend: str = "inductor") -> int:
    """``torch.compile`` every decoder layer in place; returns how many were compiled.

    On CPU the first step pays the compilation (about 45 s for the 4-layer demo model on two
    cores); later steps reuse it. ``backend="eager"`` traces without generating code (tests).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        log.warning("training.compile: this model has no decoder layers where finetuner looks; not compiled.")
        return 0
    for layer in layers:
        layer.compile(backend=backend, dynamic=None)
    return len(layers)

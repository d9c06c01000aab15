"""What the memory model reads and what it answers: :class:`Settings` (a training run, resolved) and
:class:`MemoryEstimate` (its predicted peak by component), with the constants the terms share.

Pure data, no torch; the formulas that use them are in :mod:`finetuner.memory.storage` (weights and
optimizer states), :mod:`finetuner.memory.activations` (what a step saves for backward) and
:mod:`finetuner.memory.model` (the estimate that adds them up, where the model's sources are told).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from finetuner.config.sections import Objective, Optimizer
from finetuner.device import CUDA, PLATFORMS
from finetuner.errors import UserError
from finetuner.objectives.specs import DEFAULT as DEFAULT_OBJECTIVE
from finetuner.units import MiB

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.model.shapes import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

#: CUDA context, cuBLAS/cuDNN handles and kernel images: device memory outside torch's caching
#: allocator (so not in ``max_memory_reserved``); the value and its source: finetuner.device.PLATFORMS.
CUDA_CONTEXT_BYTES = PLATFORMS[CUDA].context_bytes

#: cuBLAS/cuBLASLt workspaces, allocated through the caching allocator (finetuner.device.PLATFORMS).
CUBLAS_WORKSPACE_BYTES = PLATFORMS[CUDA].workspace_bytes

#: The caching allocator keeps freed blocks and rounds segments to 2 MiB, so
#: ``max_memory_reserved`` exceeds ``max_memory_allocated``. With
#: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the trainer's default) the H100 runs of
#: docs/memory.md show 0.2-0.4 GiB with checkpointing and 2-3 % of the allocated peak without
#: it (many activation tensors of different sizes): 320 MiB + 2 % covers every row.
ALLOCATOR_FRACTION = 0.02
ALLOCATOR_FIXED_BYTES = 320 * MiB

#: At the start of the backward pass autograd's engine, the loss's graph and the first gradient
#: buffers add a little on top of the saved tensors; 128 MiB keeps the cross-entropy phase on
#: the safe side in every H100 validation row (docs/memory.md).
LOSS_PHASE_EXTRA_BYTES = 128 * MiB
#: With checkpointing, the share of a layer's short-lived backward tensors alive at its peak:
#: one third with a 4-bit base (fitted on the H100 QLoRA runs, Llama-2 7B/13B, Llama-3.1 8B: docs/memory.md),
GC_TRANSIENT_DIVISOR = 3
#: and all of them with a 16-bit base: the H200 runs of Llama-3.1 8B on PyTorch's own layers (no
#: Liger kernels) at 7,000-8,200 tokens per micro-batch measured 60-80 KB per token above one
#: third (0.4-0.7 GiB); Liger's RMSNorm and SwiGLU kernels, not modelled, save less and hid it
#: in the earlier H100 rows of that model (docs/validation/gpu_all_h200.log)
GC_TRANSIENT_DIVISOR_16BIT = 1

#: bitsandbytes 4-bit: weights packed two per byte, one absmax per block of 64 (fp32), or with
#: double quantization one uint8 absmax per block plus an fp32 absmax per 256 blocks
#: (``bnb.functional.quantize_4bit``, defaults blocksize=64, nested blocksize=256).
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
#: per quantized layer: the 16-entry code (fp32), with double quant the 256-entry nested code
#: (fp32) and the offset; each small tensor takes at least one 512-byte allocator block.
NF4_PER_LAYER_BYTES = 512 * 4

#: bitsandbytes 8-bit optimizers: states of tensors with fewer than 4096 elements stay 32-bit
#: (``min_8bit_size``); the others are uint8 with one fp32 absmax per block of 256 (blockwise).
OPT8_MIN_SIZE = 4096
OPT8_BLOCK = 256

#: The optimizers a recipe can name (its schema is the one list).
OPTIMIZERS = get_args(Optimizer)

AttnImpl = Literal["sdpa", "eager", "flash_attention_2"]


@dataclass(frozen=True)
class Settings:
    """What the memory model needs to know about a training run (all resolved, no ``auto``)."""

    method: Literal["lora", "qlora", "full"] = "lora"
    quant_bits: Literal[4, 8] = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    weight_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"  # storage of the frozen base
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"  # autocast dtype ("fp32": no autocast)
    lora_r: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.05
    lora_bias: str = "none"
    micro_batch: int = 1
    seq_len: int = 2048
    gradient_accumulation: int = 1
    gradient_checkpointing: bool = False
    optimizer: str = "adamw_torch"
    attn_implementation: AttnImpl = "sdpa"
    attention_mask: bool = False  # a padding or packing mask reaches attention
    activation_offload: bool = False  # checkpointed layer inputs (or all saved activations) in CPU memory
    loss_chunk: int = 1024  # tokens per cross-entropy chunk (finetuner's chunked loss; a recipe's auto: finetuner.losses.chunk); 0: full logits
    tiled_mlp: int = 0  # tokens per MLP chunk (finetuner.model.tiled_mlp); 0: the MLP runs whole
    fused_ce: bool = False  # Liger's fused linear + cross-entropy kernel (never materialises the logits)
    label_fraction: float = 1.0  # share of the tokens that carry a label (responses only: < 1)
    platform: str = CUDA  # a platform of finetuner.device.PLATFORMS
    objective: Objective = DEFAULT_OBJECTIVE  # preference objectives: preference_cost
    reference: Literal["none", "adapter_off", "precomputed"] = "none"  # how DPO/KTO get the reference scores
    #: an image-text model's trainable vision tensors (lora.train_projector / train_vision_tower) as (rows, cols,
    #: copies), and what autograd keeps of the micro-batch's pictures through the tower (finetuner.memory.vision)
    vision_trainable: tuple[tuple[int, int, int], ...] = ()
    vision_activation_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.label_fraction <= 1:
            raise UserError("label_fraction must be in (0, 1].")
        if self.micro_batch < 1 or self.seq_len < 1 or self.gradient_accumulation < 1:
            raise UserError("micro-batch, sequence length and accumulation must be at least 1.")
        if self.tiled_mlp < 0:
            raise UserError("tiled_mlp is tokens per MLP chunk: 0 (not tiled) or more.")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"Unknown optimizer '{self.optimizer}'; one of {', '.join(OPTIMIZERS)}.")

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def mlp_tile_fraction(self) -> float:
        """The share of the micro-batch's tokens whose MLP tensors exist at once: one chunk's with
        ``tiled_mlp`` (1.0 when not tiled, or when one chunk holds the whole micro-batch)."""
        return min(1.0, self.tiled_mlp / self.tokens) if self.tiled_mlp else 1.0

    @property
    def quantized(self) -> bool:
        return self.method == "qlora"

    @property
    def label(self) -> str:
        m = {"lora": "LoRA", "full": "full"}.get(self.method) or f"QLoRA {self.quant_bits}-bit"
        return m

    def with_(self, **kw: Any) -> Settings:
        return replace(self, **kw)


@dataclass
class MemoryEstimate:
    """The prediction for one recipe on one card. Bytes everywhere."""

    model: str
    settings: Settings
    components: dict[str, int]  # device memory at the peak, by component (sums to total_bytes)
    peak_phase: str
    phases: dict[str, int]  # allocated bytes at the peak of each phase
    allocated_bytes: int  # predicted peak allocated of the caching allocator (finetuner.device.memory_stats)
    reserved_bytes: int  # predicted peak reserved of the caching allocator
    total_bytes: int  # reserved + CUDA context: what the card must hold
    device_bytes: int | None = None
    budget_bytes: int | None = None  # device_bytes minus the safety margin
    spillable_bytes: int = 0  # paged optimizer states: may move to CPU under pressure
    offloaded_bytes: int = 0  # host memory used by offload
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    gpu: str | None = None
    #: the model's shape the estimate was made for (the sharded estimates split it into units)
    shape: ModelShape | None = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        if self.budget_bytes is None:
            return True
        return self.total_bytes - self.spillable_bytes <= self.budget_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes - self.total_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": self.gpu,
            "fits": self.fits,
            "total_bytes": self.total_bytes,
            "device_bytes": self.device_bytes,
            "budget_bytes": self.budget_bytes,
            "headroom_bytes": self.headroom_bytes,
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "peak_phase": self.peak_phase,
            "components": dict(self.components),
            "phases": dict(self.phases),
            "spillable_bytes": self.spillable_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "settings": asdict(self.settings),
            "details": self.details,
            "notes": list(self.notes),
        }



@dataclass(frozen=True)
class Dtypes:
    R: int  # residual stream (embedding output) element size
    c: int  # autocast compute element size
    base: str  # "frozen", "trainable", "nf4", "int8"
    autocast: bool


def dtypes(s: Settings) -> Dtypes:
    c = DTYPE_BYTES[s.compute_dtype]
    autocast = s.compute_dtype != "fp32"
    if s.method == "full":
        return Dtypes(R=4, c=c if autocast else 4, base="trainable", autocast=autocast)
    w = DTYPE_BYTES[s.weight_dtype]
    if s.method == "lora":
        return Dtypes(R=w, c=c if autocast else w, base="frozen", autocast=autocast)
    return Dtypes(R=w, c=c if autocast else w, base="nf4" if s.quant_bits == 4 else "int8", autocast=autocast)


"""The memory model: predicted peak device memory of a training step, per component.

Pure arithmetic on a :class:`~finetuner.model.shapes.ModelShape` and a :class:`Settings` (no torch).
Every term below says where its formula comes from. The conventions are those of finetuner's
trainer (a torchtune-style loop on transformers + peft + bitsandbytes):

* the frozen base is stored in ``model.dtype`` (bf16 on GPUs that have it); LoRA A/B are fp32
  (peft's ``autocast_adapter_dtype``); compute runs under ``torch.autocast`` in bf16/fp16;
* QLoRA loads the linear layers of the decoder with bitsandbytes ``Linear4bit`` (or
  ``Linear8bitLt``). peft's ``prepare_model_for_kbit_training`` would cast every parameter that
  is not 4-bit — embeddings, LM head, norms, biases — to fp32 (``peft/utils/other.py``), making
  the whole residual stream fp32; finetuner's trainer does not
  (``finetuner.model.loading.prepare_for_training`` freezes the base itself), so the unquantized
  parts stay in ``weight_dtype`` (measured on an H100: the upcast costs 2.1 GB on an 8B model
  with a 128k vocabulary);
* full fine-tuning keeps fp32 master weights (mixed precision: 4 + 4 + 8 bytes per parameter of
  weights, gradients and AdamW states, the "16 bytes per parameter" of ZeRO's paper);
* the loss is finetuner's chunked cross-entropy (``finetuner.model.scoring.token_loss_sum``):
  the decoder's hidden states of the labelled positions only are gathered, and the LM head + fp32
  cross-entropy run ``loss_chunk`` tokens at a time under activation checkpointing, so the full
  ``tokens x vocab`` logits never exist. ``loss_chunk=0`` models the plain path
  (``cross_entropy(logits.float())`` with the logits held through the backward);
* gradient checkpointing is transformers' non-reentrant per-decoder-layer checkpointing;
* a tiled MLP (``tiled_mlp``, :mod:`finetuner.model.tiled_mlp`) runs each layer's MLP over chunks
  of ``tiled_mlp`` tokens, each under its own checkpoint: the layer keeps the MLP's input for the
  whole micro-batch and everything else the MLP saves for one chunk only (with or without
  checkpointing of the layers). What a chunk saves is counted on the CPU against torch
  (``tests/model/test_tiled_mlp.py``); the peak of a tiled run has not been measured on a GPU, so
  the tiled predictions are the model's, unvalidated (the recorded runs below are all untiled).

How the activation terms were derived: by reading the forward code of transformers 5 (Llama,
Mistral, Qwen2/3, Gemma-2, Phi-3), peft 0.21 (``lora/layer.py``, ``lora/bnb.py``) and
bitsandbytes 0.50 (``autograd/_functions.py``), listing what autograd saves for backward, and
checking the totals against the measured peaks of GPU runs of 7B–13B shapes
(``scripts/validate/memory.py``, recorded in ``docs/validation/`` and tabled in ``docs/memory.md``).
``tests/memory/test_memory_accuracy.py`` replays every recorded run through this model as it is
now: no allocated peak predicted below its measurement, the median error under 5 %, and
docs/memory.md's table equal to the replay. The storage terms are checked against the libraries
themselves in ``tests/memory/test_memory.py`` (nf4 and int8 weights against bitsandbytes, AdamW
and 8-bit Adam states against torch and bitsandbytes), and the activation terms' scaling (linear
in tokens, checkpointing keeping layer inputs only, the chunked loss never holding the logits)
there too.
The rules that decide the size of a saved tensor:

* autograd saves a matmul's input only when the weight needs a gradient: a frozen base linear
  saves nothing of its input; LoRA's ``lora_A`` saves its (autocast-cast) input;
* ``torch.autocast`` casts an fp32 input to bf16 with a *new* tensor at every call (its cache
  only keeps casts of leaf tensors that require grad, i.e. trainable weights), so each LoRA
  module keeps its own bf16 copy of its input;
* bitsandbytes 4-bit layers cast their input to the compute dtype and their output back to the
  input dtype, and save no activation (``MatMul4Bit`` keeps only the packed weight); 8-bit
  ``MatMul8bitLt`` keeps its input;
* RMSNorm upcasts to fp32 and saves that fp32 tensor; the MLP saves the gate, the activation and
  the up projection (``act(gate) * up``); SDPA/flash attention saves q, k, v, the output and the
  log-sum-exp, never the ``s x s`` matrix; eager attention saves the fp32 softmax and its bf16
  copy (``s x s`` per head).

Not modelled here: the model-loading peak (gone before training starts), torch.compile, Liger's
RMSNorm/SwiGLU/RoPE kernels (only its fused linear cross-entropy, ``fused_ce``, is counted), and
sharding across devices (DeepSpeed/FSDP: :mod:`finetuner.memory.sharding` divides this model's
terms).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from finetuner.device import CPU, CUDA, PLATFORMS
from finetuner.errors import UserError
from finetuner.config.sections import Objective, Optimizer
from finetuner.model.shapes import ModelShape, lora_param_count, lora_targets
from finetuner.model.trace import TRACE_LORA_DROPOUT, TRACE_LORA_R
from finetuner.objectives.specs import DEFAULT as DEFAULT_OBJECTIVE
from finetuner.objectives.specs import spec_of

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.hardware import GpuProfile
    from finetuner.config.recipe import Recipe
    from finetuner.config.runtime import Runtime

MiB = 1024**2
GiB = 1024**3

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
    loss_chunk: int = 1024  # tokens per cross-entropy chunk (finetuner's chunked loss); 0: full logits
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


# ====================================================================== weights
def weight_bytes(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Bytes of the model's own parameters on the device, by storage kind.

    * ``lora``: every parameter in ``weight_dtype`` (2 bytes for bf16).
    * ``full``: fp32 master weights (4 bytes), mixed precision.
    * ``qlora`` 4-bit: the decoder's linear weights as packed 4-bit (0.5 byte) plus the block-wise
      absmax (fp32 per 64 → 0.0625 byte/param; with double quant uint8 per 64 plus fp32 per
      64*256 → 0.0159 byte/param) plus the code tables; 8-bit: int8 (1 byte) plus one fp32 scale
      per output row (``SCB``). Everything else — embeddings, LM head (never quantized:
      transformers skips the output layer), norms, biases — in ``weight_dtype`` (finetuner does
      not upcast them as ``prepare_model_for_kbit_training`` would).
    """
    counts = shape.param_counts()
    total = counts["total"]
    if s.method == "full":
        return {"fp32 (trainable)": 4 * total}
    w = DTYPE_BYTES[s.weight_dtype]
    if s.method == "lora":
        return {s.weight_dtype: w * total}
    other = total - quantized_numel(shape, s)  # embeddings, lm head, norms, biases (8-bit: also the experts)
    other_bytes = w * other
    packed, state = quantized_weight_parts(shape, s)
    kind = f"{s.quant_type}{' + double quant' if s.double_quant else ''}" if s.quant_bits == 4 else "int8"
    return {kind: packed + state, f"{s.weight_dtype} (not quantized)": other_bytes}


def quantized_numel(shape: ModelShape, s: Settings) -> int:
    """The weights a QLoRA base holds quantized: the decoder's linear layers and, in 4-bit, a mixture of
    experts' fused expert weights (:mod:`finetuner.model.experts4bit`; in 8-bit they stay in ``weight_dtype``)."""
    return shape.linear_weight_numel + (shape.expert_numel if s.quant_bits == 4 else 0)


def quantized_weight_parts(shape: ModelShape, s: Settings) -> tuple[int, int]:
    """The quantized linear weights of a QLoRA base as ``(data bytes, quantization-state bytes)``.

    * 4-bit: the packed weights, two per byte (``ceil(numel / 2)``), and the state: the block-wise
      absmax (one fp32 per ``NF4_BLOCK`` values; with double quant one uint8 per block plus one
      fp32 per ``NF4_NESTED_BLOCK`` blocks) plus ``NF4_PER_LAYER_BYTES`` of code tables per linear;
    * 8-bit: one int8 byte per weight, and the state: one fp32 scale per output row (``SCB``).

    The split matters under FSDP (:mod:`finetuner.memory.fsdp`): the data are a parameter and are
    sharded, the state is an attribute of the layer and stays whole on every device.
    """
    numel = quantized_numel(shape, s)
    if s.quant_bits == 4:
        blocks = sum(math.ceil(lin.in_features * lin.out_features / NF4_BLOCK) * shape.copies(lin) for lin in shape.layer_linears())
        # each expert's two matrices quantized on their own (experts4bit): their blocks and code tables
        matrices = shape.linear_count + (2 * shape.experts.count * shape.experts.layers if shape.experts else 0)
        blocks += math.ceil(shape.expert_numel / NF4_BLOCK)
        absmax = blocks * 1 + math.ceil(blocks / NF4_NESTED_BLOCK) * 4 if s.double_quant else blocks * 4
        return math.ceil(numel / 2), absmax + matrices * NF4_PER_LAYER_BYTES
    rows = sum(lin.out_features * shape.copies(lin) for lin in shape.layer_linears())
    return numel, 4 * rows


def trainable_tensors(shape: ModelShape, s: Settings) -> list[tuple[int, int, int]]:
    """The trainable tensors as ``(rows, cols, copies)`` (1-D tensors have ``cols == 1``)."""
    if s.method == "full":
        out = [(lin.out_features, lin.in_features, shape.copies(lin)) for lin in shape.layer_linears()]
        out += [(lin.out_features, 1, shape.copies(lin)) for lin in shape.layer_linears() if lin.bias]
        if shape.counts_read:  # a layout read from the model: its other parameters by kind, as read
            c = shape.param_counts()
            out.append((c["embeddings"] // shape.hidden_size, shape.hidden_size, 1) if c["embeddings"] else (0, 0, 0))
            if c["lm_head"]:
                out.append((c["lm_head"] // shape.hidden_size, shape.hidden_size, 1))
            if shape.experts:  # each MoE layer's fused expert tensors (count x rows, hidden)
                e = shape.experts
                out.append((e.numel // e.layers // shape.hidden_size, shape.hidden_size, e.layers))
            out += [(c[k], 1, 1) for k in ("norms", "router", "other") if c[k] > 0]
            return [t for t in out if t[0]]
        out.append((shape.vocab_size, shape.hidden_size, 1))
        if not shape.tie_word_embeddings:
            out.append((shape.vocab_size, shape.hidden_size, 1))
        out.append((shape.hidden_size, 1, shape.norms_per_layer * shape.num_layers + 1))
        if shape.qk_norm:
            out.append((shape.head_dim, 1, 2 * shape.num_layers))
        return out
    targets = lora_targets(shape, list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets)
    out = []
    for _, fin, fout, copies in targets:
        out += [(s.lora_r, fin, copies), (fout, s.lora_r, copies)]
    return out


def trainable_params(shape: ModelShape, s: Settings) -> int:
    if s.method == "full":
        return shape.num_params
    targets = list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets
    return lora_param_count(shape, s.lora_r, targets, s.lora_bias)


# ====================================================================== optimizer
def optimizer_state_bytes(tensors: list[tuple[int, int, int]], optimizer: str) -> int:
    """Optimizer state for trainable tensors given as ``(rows, cols, copies)``.

    * ``adamw_torch`` / ``paged_adamw_32bit``: ``exp_avg`` and ``exp_avg_sq`` in fp32, 8 bytes per
      parameter (``torch.optim.AdamW``; the step counters are scalars and ignored).
    * ``adamw_8bit`` / ``paged_adamw_8bit`` (bitsandbytes): two uint8 states (2 bytes/param) plus
      one fp32 absmax per 256 values for each; tensors under 4096 elements keep 32-bit states.
    * ``adafactor`` (no first moment, ``beta1=None``): factored second moment, one fp32 row and
      one column vector per matrix (Shazeer & Stern 2018), the full vector for 1-D tensors.
    * ``sgd`` (no momentum): nothing.
    """
    total = 0
    for rows, cols, copies in tensors:
        n = rows * cols
        if optimizer in ("adamw_torch", "paged_adamw_32bit"):
            b = 8 * n
        elif optimizer in ("adamw_8bit", "paged_adamw_8bit"):
            b = 8 * n if n < OPT8_MIN_SIZE else 2 * n + 2 * 4 * math.ceil(n / OPT8_BLOCK)
        elif optimizer == "adafactor":
            b = 4 * (rows + cols) if cols > 1 else 4 * n
        else:
            b = 0
        total += b * copies
    return total


def optimizer_step_temp_bytes(tensors: list[tuple[int, int, int]], optimizer: str) -> int:
    """Temporaries of ``optimizer.step()`` (on top of weights, grads and states).

    torch's default multi-tensor (foreach) AdamW computes ``sqrt(exp_avg_sq)`` for all tensors at
    once (``torch/optim/adamw.py``, ``_multi_tensor_adamw``): one fp32 copy of every parameter.
    bitsandbytes' 8-bit and paged optimizers update in place in one fused kernel. Adafactor and
    SGD go tensor by tensor: about three fp32 temporaries of the largest tensor.
    """
    if optimizer in ("adamw_torch",):
        return 4 * sum(r * c * k for r, c, k in tensors)
    if optimizer in ("adafactor", "sgd"):
        return 3 * 4 * max((r * c for r, c, _ in tensors), default=0)
    return 0


# ====================================================================== activations
@dataclass(frozen=True)
class _Dtypes:
    R: int  # residual stream (embedding output) element size
    c: int  # autocast compute element size
    base: str  # "frozen", "trainable", "nf4", "int8"
    autocast: bool


def _dtypes(s: Settings) -> _Dtypes:
    c = DTYPE_BYTES[s.compute_dtype]
    autocast = s.compute_dtype != "fp32"
    if s.method == "full":
        return _Dtypes(R=4, c=c if autocast else 4, base="trainable", autocast=autocast)
    w = DTYPE_BYTES[s.weight_dtype]
    if s.method == "lora":
        return _Dtypes(R=w, c=c if autocast else w, base="frozen", autocast=autocast)
    return _Dtypes(R=w, c=c if autocast else w, base="nf4" if s.quant_bits == 4 else "int8", autocast=autocast)


def layer_activation_terms(shape: ModelShape, s: Settings, traced: bool = True) -> list[tuple[str, float]]:
    """What one decoder layer saves for backward, as ``(what, bytes per token)``.

    Multiply by ``micro_batch * seq_len`` for bytes. A tensor shared by several consumers is
    listed once. Symbols: ``h`` hidden, ``q``/``kv`` the query and key/value widths,
    ``i`` the MLP width, ``R``/``c`` the residual and compute element sizes (see module doc).
    ``traced``: with the layer's trace's excess over these named terms (:func:`traced_excess`) as one more term.
    """
    d = _dtypes(s)
    h, q, kv, i, nh, r = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size, shape.num_heads, s.lora_r
    seq = s.seq_len
    lora = s.method != "full"
    targets = {shape.role_of(name) for name, *_ in lora_targets(shape, list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets)} if lora else set()
    p = s.lora_dropout
    mask_b = 1 if s.platform == CUDA else None  # native_dropout keeps a bool mask on CUDA
    terms: list[tuple[str, float]] = []

    def norm(label: str, trainable: bool) -> None:
        # RMSNorm: x.to(fp32) (pow and the rsqrt product save it: 4 bytes/elem), rsqrt (4 bytes
        # per token); with a trainable weight also the normalised input of ``weight * x``.
        terms.append((f"{label}: fp32 input", 4 * h + 4))
        if trainable:
            terms.append((f"{label}: normalised (weight grad)", d.R * h))

    def out_dtype(x_b: int) -> int:
        # dense linears under autocast return the compute dtype; bitsandbytes layers cast their
        # output back to the input's dtype (``Linear4bit.forward``: ``.to(inp_dtype)``).
        if d.base in ("nf4", "int8"):
            return x_b
        return d.c if d.autocast else x_b

    def consumers(label: str, x_b: int, mods: list[tuple[str, int]], x_saved_elsewhere: bool = False) -> None:
        """Linears reading the same input ``x`` (element size ``x_b``, width ``mods[k][1]``)."""
        width = mods[0][1]
        shared_x = False  # some consumer saves x itself (counted once)
        for name, _ in mods:
            # the frozen/quantized/trainable base linear
            if d.base == "trainable":
                if x_b == d.c or not d.autocast:
                    shared_x = True
                else:
                    terms.append((f"{name}: autocast copy of input", d.c * width))
            elif d.base == "int8":
                shared_x = True  # MatMul8bitLt keeps A (ctx.tensors)
            # the LoRA branch
            if lora and name in targets:
                terms.append((f"{name}: lora_A output", d.c * r))
                if d.base == "frozen" or s.platform == CPU:
                    # peft Linear casts x to the adapter dtype (fp32); on CPU the bnb LoRA layers
                    # do too (``torch.is_autocast_enabled()`` is the CUDA flag). Then autocast
                    # casts to c for lora_A: a new tensor, saved.
                    x_in = 4
                else:
                    x_in = x_b  # bnb LoRA layers on CUDA under autocast: no cast
                if p > 0:
                    terms.append((f"{name}: dropout mask", (mask_b or x_in) * width))
                    if x_in == d.c or not d.autocast:
                        terms.append((f"{name}: dropout output", x_in * width))
                    else:
                        terms.append((f"{name}: autocast copy of input", d.c * width))
                elif x_in != x_b or (d.autocast and x_in != d.c):
                    terms.append((f"{name}: autocast copy of input", (d.c if d.autocast else x_in) * width))
                else:
                    shared_x = True
        if shared_x and not x_saved_elsewhere:
            terms.append((f"{label} (kept for backward)", x_b * width))

    # ---- attention block
    norm("input norm", d.base == "trainable")
    attn_mods = [("qkv_proj", h)] if shape.fused_qkv else [("q_proj", h), ("k_proj", h), ("v_proj", h)]
    consumers("attention input", d.R, attn_mods)
    o1 = out_dtype(d.R)
    rope_b = max(o1, d.R)  # q * cos + rotate_half(q) * sin, cos/sin in the embedding dtype
    if shape.qk_norm:
        terms.append(("q/k norms: fp32 inputs", 4 * (q + kv) + 4 * 2 * nh))
    sdpa_like = s.attn_implementation in ("sdpa", "flash_attention_2")
    masked = s.attention_mask and s.attn_implementation == "sdpa"
    k_width = q if (masked or s.attn_implementation == "eager") else kv  # repeat_kv when a mask or eager
    c_att = d.c
    terms.append(("attention: q", c_att * q))
    terms.append(("attention: k", c_att * k_width))
    # v is saved as produced unless autocast must cast it (or repeat_kv copies it); phi3's v is
    # a view of the fused qkv output and keeps all of it alive.
    v_b = c_att if (o1 != c_att or k_width != kv) else o1
    v_width = (q + 2 * kv) if (shape.fused_qkv and v_b == o1 and k_width == kv) else k_width
    terms.append(("attention: v", v_b * v_width))
    _ = rope_b  # q and k after RoPE are cast by autocast (new c tensors) or saved as they are (same size)
    if sdpa_like:
        terms.append(("attention: output", c_att * q))
        terms.append(("attention: log-sum-exp (fp32)", 4 * nh))
        if masked:
            # SDPA turns the bool mask into an additive bias in the query dtype (attention.cpp,
            # convert_boolean_attn_mask) and the memory-efficient kernel keeps it: b x s x s.
            terms.append(("attention: mask as bias", c_att * seq))
        o_input_shared = True  # o_proj reads a view of the attention output
    else:
        # eager: softmax(QK^T) in fp32 (saved) and its bf16 copy (saved by the PV matmul)
        terms.append(("attention: softmax probabilities (fp32)", 4 * nh * seq))
        terms.append(("attention: probabilities (compute dtype)", c_att * nh * seq))
        if shape.model_type == "gemma2":
            terms.append(("attention: soft-capping tanh", c_att * nh * seq))
        o_input_shared = False
    consumers("attention output", c_att, [("o_proj", q)], x_saved_elsewhere=o_input_shared)
    for path, width, out in shape.attention_extras:  # an output gate, latent attention's low-rank projections
        consumers(f"{path} input", d.R, [(path, width)])
        terms.append((f"{path}: output (and what reads it)", 2 * c_att * out))
    if shape.norms_per_layer == 4:
        norm("post-attention norm", d.base == "trainable")
    # ---- MLP block
    norm("MLP norm", d.base == "trainable")
    mlp_start = len(terms)
    m1 = out_dtype(d.R)
    if shape.experts is not None:
        terms += _expert_terms(shape, s, d, m1, consumers)
    elif shape.gated_mlp:
        mlp_mods = [("gate_up_proj", h)] if shape.fused_gate_up else [("gate_proj", h), ("up_proj", h)]
        consumers("MLP input", d.R, mlp_mods)
        terms.append(("MLP: gate (activation input)", m1 * i))
        terms.append(("MLP: activation output", m1 * i))
        terms.append(("MLP: up", m1 * i))
        consumers("MLP: act(gate) * up", m1, [("down_proj", i)])
    else:  # up_proj, the activation, down_proj: the activation's input and output
        consumers("MLP input", d.R, [("up_proj", h)])
        terms.append(("MLP: up (activation input)", m1 * i))
        consumers("MLP: act(up)", m1, [("down_proj", i)])
        terms.append(("MLP: activation output", m1 * i))
    frac = s.mlp_tile_fraction
    if frac < 1 and shape.experts is None:  # a tiled MLP: an MoE's experts are not tiled (only its shared ones)
        # tiled: the chunks' checkpoints keep the MLP input (the norm's output, a residual-dtype
        # tensor) for the whole micro-batch; everything the MLP saves inside exists for one chunk
        mlp = terms[mlp_start:]
        del terms[mlp_start:]
        held = "MLP input (kept for backward)"
        terms.append((held if any(n == held for n, _ in mlp) else "MLP input (held by the tiled chunks)", d.R * h))
        terms += [(f"{n}{_CHUNK_SUFFIX}", b * frac) for n, b in mlp if n != held]
    if shape.norms_per_layer == 4:
        norm("post-MLP norm", d.base == "trainable")
    if traced:
        extra = traced_excess(shape, s)
        if extra > 0:
            terms.append(("saved beyond the terms above (the layer's trace, at fp32)", extra))
    return terms


#: the settings the layer's trace runs under (:mod:`finetuner.model.trace`): LoRA all-linear, fp32, the CPU
TRACE_SETTINGS = Settings(method="lora", weight_dtype="fp32", compute_dtype="fp32", platform=CPU, lora_r=TRACE_LORA_R,
                          lora_dropout=TRACE_LORA_DROPOUT, attn_implementation="sdpa")


def traced_excess(shape: ModelShape, s: Settings) -> float:
    """Bytes per token that a decoder layer saves for backward beyond the terms :func:`layer_activation_terms` names:
    the layer's own trace (:attr:`ModelShape.trace`, read from the model on the meta device) at ``s.seq_len`` less
    the named terms under the trace's settings (:data:`TRACE_SETTINGS`), never below 0. Zero for the families the
    terms were written for (the census shows them equal to the trace); a family's own dropout, LayerNorm
    statistics, a learned activation's saved inputs or an attention it materialises are what it adds. Kept at the
    trace's fp32: an upper bound under bf16 autocast (what autocast would halve, the trace cannot tell)."""
    if shape.trace is None:
        return 0.0
    tokens = s.seq_len
    named = sum(b for _, b in layer_activation_terms(shape, TRACE_SETTINGS.with_(seq_len=tokens), traced=False))
    a, b, c = shape.trace
    return max(0.0, (a + b * tokens + c * tokens * tokens) / tokens - named)


def _expert_terms(shape: ModelShape, s: Settings, d: _Dtypes, m1: int, consumers) -> list[tuple[str, float]]:
    """A mixture of experts' block in :func:`layer_activation_terms`, per token: the router's fp32 logits and
    probabilities, then for each of the ``top_k`` experts a token is routed to what a dense gated MLP of the
    expert's width saves (the gate, its activation, the up projection), and the expert's output, which the
    routing weight multiplies (kept for the weight's gradient); the shared experts as a dense MLP. The fused
    expert weights are frozen under LoRA, so the inputs of their matmuls are not saved (autograd keeps a matmul's
    input only for its weight's gradient). Assumed, not traced: every token reaches exactly ``top_k`` experts
    (transformers' experts loop over the experts hit and gather their tokens), and the dense first layers of a
    family (DeepSeek's, GLM's) save no more than its MoE layers (their MLP is as wide as ``top_k`` experts and
    the shared ones in the families of 2025-26). Not yet checked on a GPU."""
    e = shape.experts
    h = shape.hidden_size
    terms: list[tuple[str, float]] = [("MoE router: logits and probabilities (fp32)", 4 * 2 * e.count)]
    if e.shared_intermediate:  # a dense gated MLP every token goes through; LoRA may target its linears
        i = e.shared_intermediate
        consumers("shared experts' input", d.R, [("shared.gate_proj", h), ("shared.up_proj", h)] if e.gated else [("shared.up_proj", h)])
        terms.append(("shared experts: gate, activation and up", m1 * i * (3 if e.gated else 2)))
        consumers("shared experts: act(gate) * up", m1, [("shared.down_proj", i)])
    k, i = e.top_k, e.intermediate
    terms.append((f"experts: gate, activation and up of {k} experts", k * m1 * i * (3 if e.gated else 2)))
    terms.append((f"experts: outputs of {k} experts (routing weight's gradient)", k * d.c * h))
    return terms


#: the suffix of a tiled MLP's terms in :func:`layer_activation_terms` (one chunk's, scaled per token)
_CHUNK_SUFFIX = " (one chunk of the tiled MLP)"


def layer_transient_per_token(shape: ModelShape, s: Settings) -> float:
    """Short-lived tensors inside one layer's forward/backward, on top of what stays saved.

    The largest of: (forward) the fp32 copy that peft's LoRA layer makes of the MLP down
    projection's input plus the MLP output; (backward) the gradients of the MLP's gate, up and
    activation alive at once. Bytes per token, read from the same forward/backward code as
    :func:`layer_activation_terms`; with checkpointing :func:`estimate` counts one
    ``GC_TRANSIENT_DIVISOR``-th of it, fitted on the Llama-2 H100 runs. With a tiled MLP the
    intermediate-size gradients exist for one chunk (scaled by ``Settings.mlp_tile_fraction``), and
    the hidden-size part plus the chunks' input gradients are counted whole
    (:func:`_tiled_whole_per_token`: not fitted, on the safe side). Checked only through the
    whole peak: ``tests/memory/test_memory_accuracy.py`` replays every GPU run in
    ``docs/validation/`` (every allocated prediction at or above the measurement, median error
    under 5 %).
    """
    d = _dtypes(s)
    h, i = shape.hidden_size, shape.active_intermediate
    m1 = 4 if d.base in ("nf4", "int8") and d.R == 4 else d.c
    gradients = 3 if shape.gated_mlp else 2  # gate, up and the activation's; without a gate, up and the activation's
    frac = s.mlp_tile_fraction if shape.experts is None else 1.0
    return (gradients * m1 * i + 4 * i) * frac + 4 * 4 * h + _tiled_whole_per_token(shape, s)


def _tiled_whole_per_token(shape: ModelShape, s: Settings) -> float:
    """With a tiled MLP, the part of :func:`layer_transient_per_token` that stays whole-sequence:
    the hidden-size gradients (``4 * 4 * h``) and the chunks' input gradients, all alive until
    autograd concatenates them into the MLP input's gradient (``R * h``). Counted without the
    checkpointing divisor, which was fitted on untiled runs (0 when not tiled)."""
    if s.mlp_tile_fraction >= 1:
        return 0
    return _dtypes(s).R * shape.hidden_size


@dataclass
class ActivationEstimate:
    per_layer: int  # one layer's saved tensors (kept from its forward to its backward)
    checkpoints: int  # with checkpointing: the saved layer inputs, all layers
    saved_total: int  # all layers' saved tensors (or checkpoints) + the model's own
    model_extra: int  # final norm, LM-head input/weight copies, masks, RoPE tables
    logits: int  # the logits the trainer holds
    loss_peak: int  # extra at the cross-entropy backward
    transient: int  # one layer's short-lived tensors
    offloaded: int  # bytes kept in CPU memory instead
    terms: list[tuple[str, float]]
    transient_whole: int = 0  # with a tiled MLP, the part of ``transient`` counted whole under checkpointing
    mlp_chunk: int = 0  # with a tiled MLP, one chunk's MLP tensors: alive only in a layer's backward


def activation_bytes(shape: ModelShape, s: Settings) -> ActivationEstimate:
    """Activations for one micro-batch, see :func:`layer_activation_terms` for one layer.

    Beyond the layers:
    * layer 0's input norm saves nothing in LoRA/QLoRA (the embeddings are frozen, so its input
      needs no gradient);
    * the final norm saves its fp32 input (and, in full fine-tuning, the normalised tensor and
      the LM head's bf16 input copy);
    * plain loss (``loss_chunk=0``): logits ``tokens * vocab * c`` held by the trainer (Gemma-2's
      soft-capping keeps its tanh output too), and ``cross_entropy(logits.float())`` keeps the
      fp32 log-softmax (4 bytes) and, at the start of backward, adds the gradient of the NLL (4)
      and of the log-softmax (4): ``12 * tokens * vocab`` bytes on top of the logits;
    * chunked loss (finetuner's default): nothing of size vocab is kept between chunks; the
      gathered hidden states of the labelled tokens (``c * hidden`` each) are saved, and one
      chunk's backward holds its recomputed fp32 logits' log-softmax (4), the NLL gradient (4),
      the log-softmax gradient (4) and the bf16 logit gradient plus the fp32 → bf16 casts (≈ 4):
      ``16 * n * vocab`` with ``n = min(loss_chunk, labelled tokens)`` (soft-capping: +8);
    * Liger's fused linear cross-entropy (``fused_ce``) works on chunks of
      ``2^ceil(log2(tokens / ceil(vocab / hidden)))`` tokens and keeps the fp32 gradient of the
      hidden states (``4 * hidden`` per token): modelled like a chunked loss of that size;
    * with a mask, the bool ``b x 1 x s x s`` mask (once); eager attention builds a float one.
    With gradient checkpointing the layers keep only their inputs (``R * hidden`` per token each);
    the backward recomputes one layer at a time, so that layer's saved tensors come back.
    """
    T = s.tokens
    d = _dtypes(s)
    h, V = shape.hidden_size, shape.vocab_size
    terms = layer_activation_terms(shape, s)
    # a tiled MLP's chunk terms exist only while that chunk is recomputed in the layer's backward
    chunk_tok = sum(b for n, b in terms if n.endswith(_CHUNK_SUFFIX))
    per_tok = sum(b for n, b in terms if not n.endswith(_CHUNK_SUFFIX))
    per_layer = int(per_tok * T)
    frozen_embed = s.method != "full"
    extra_tok = 4 * h + 4  # final norm
    if d.base == "trainable":
        extra_tok += d.R * h + (d.c * h if d.R != d.c else 0)  # normalised + lm_head input copy
    if frozen_embed:
        extra_tok -= 4 * h + 4  # layer 0's input norm
    extra_tok += 2 * d.R * shape.head_dim  # RoPE cos/sin (broadcast over the batch: per position)
    extra = int(extra_tok * T)
    if s.attention_mask or s.attn_implementation == "eager":
        mask_elem = 1 if s.attn_implementation != "eager" else d.R
        extra += mask_elem * s.micro_batch * s.seq_len * s.seq_len
    labelled = max(1, math.ceil(T * s.label_fraction))
    if s.fused_ce:
        chunk = 2 ** math.ceil(math.log2(max(1, math.ceil(T / math.ceil(V / h)))))
        logits = 0
        extra += 4 * h * labelled  # fp32 grad of the hidden states, computed in the forward
        loss_peak = 16 * min(chunk, labelled) * V
    elif s.loss_chunk > 0:
        logits = 0
        extra += d.c * h * labelled  # the gathered hidden states of the labelled positions
        loss_peak = (16 + (8 if shape.final_logit_softcapping else 0)) * min(s.loss_chunk, labelled) * V
    else:
        logits = d.c * T * V
        if shape.final_logit_softcapping:
            extra += d.c * T * V  # tanh output
        loss_peak = 12 * T * V
    transient = int(layer_transient_per_token(shape, s) * T)
    L = shape.num_layers
    offloaded = 0
    if s.gradient_checkpointing:
        ckpt = int(d.R * h * T) * L
        saved = ckpt
        if s.activation_offload:
            offloaded = ckpt - 2 * int(d.R * h * T)  # two layers in flight (prefetch)
            saved -= offloaded
    else:
        ckpt = 0
        saved = per_layer * L
        if s.activation_offload:
            offloaded = per_layer * (L - 2)
            saved -= offloaded
    return ActivationEstimate(
        per_layer=per_layer,
        checkpoints=ckpt,
        saved_total=saved + extra,
        model_extra=extra,
        logits=logits,
        loss_peak=loss_peak,
        transient=transient,
        offloaded=offloaded,
        terms=terms,
        transient_whole=0 if s.mlp_tile_fraction >= 1 else int((4 * 4 * shape.hidden_size + _tiled_whole_per_token(shape, s)) * T),
        mlp_chunk=int(chunk_tok * T),
    )


# ====================================================================== preference objectives
@dataclass
class PreferenceCost:
    """What a preference objective (:mod:`finetuner.objectives.preference`) adds to a step.

    * ``rows``: sequences per micro-batch in the forward: each example is two (chosen and
      rejected; KTO: the response and its mismatched pair), so the activations are those of a
      micro-batch twice as large;
    * ``buffers_bytes``: the per-token fp32 log-probabilities of the scored tokens, their int64 row
      index and the bool mask that gathers them, and the per-sequence sums;
    * ``reference_pass_bytes``: the reference forward with the adapter switched off, under
      ``no_grad``, run while the policy's activations are saved: nothing is kept between layers, so
      its peak is one layer's temporaries plus one loss chunk's fp32 logits and their log-softmax
      (the plain loss path: the whole micro-batch's logits in the compute dtype and the two fp32
      tensors). Zero for ORPO and SimPO (no reference) and for ``precomputed`` scores (read from
      a table: two floats per example, kept in CPU memory).
    """

    rows: int
    buffers_bytes: int
    reference_pass_bytes: int


def preference_cost(shape: ModelShape, s: Settings) -> PreferenceCost | None:
    """The preference objective's term of :func:`estimate`; ``None`` for the other objectives."""
    spec = spec_of(s.objective)
    if spec.section != "preference":
        return None
    rows = spec.sequences_per_example * s.micro_batch
    T = rows * s.seq_len
    labelled = max(1, math.ceil(T * s.label_fraction))
    buffers = (4 + 8) * labelled + T + 8 * rows
    ref = 0
    if s.reference == "adapter_off" and spec.reference_model:
        both = s.with_(micro_batch=rows)
        layer = int(layer_transient_per_token(shape, both) * T)
        V = shape.vocab_size
        if s.loss_chunk > 0:
            logits = 8 * min(s.loss_chunk, labelled) * V
        else:
            logits = _dtypes(s).c * T * V + 8 * labelled * V
        ref = layer + logits
    return PreferenceCost(rows=rows, buffers_bytes=buffers, reference_pass_bytes=ref)


# ====================================================================== the estimate
def _quant_temp_bytes(shape: ModelShape, s: Settings) -> int:
    """Temporaries of quantized layers: for training-sized inputs bitsandbytes dequantizes the
    4-bit weight to the compute dtype and calls ``F.linear`` (``backends/cuda/ops.py``: the fused
    kernel is only used for a few rows), in forward and again for the input gradient; 8-bit's
    backward makes a copy of the int8 weight in the input dtype (``MatMul8bitLt.backward``)."""
    if s.method != "qlora":
        return 0
    n = shape.largest_linear_numel
    d = _dtypes(s)
    if s.quant_bits == 4:
        return d.c * n + 4 * math.ceil(n / NF4_BLOCK)
    return d.R * n + 2 * n


def estimate(
    shape: ModelShape,
    s: Settings,
    gpu: GpuProfile | None = None,
    margin: float = 0.05,
) -> MemoryEstimate:
    """Predict the peak device memory of one training step.

    The step has two phases whose peaks are compared:

    * forward/backward: weights + trainable weights + gradients (fp32, all present by the end
      of backward and across accumulation) + optimizer states (allocated at the first step and
      kept) + autocast's bf16 copies of trainable weights + activations at their peak (the
      cross-entropy backward, or one layer's backward/recompute, whichever is larger) + the
      dequantization buffer;
    * optimizer step: weights + gradients + states + the step's temporaries.

    On top of the larger: cuBLAS workspaces, the allocator's slack (→ reserved) and the CUDA
    context (→ what the card must hold). ``fits`` compares that with the card's memory less a
    ``margin`` fraction, not counting paged optimizer states, which can move to CPU memory.
    """
    from finetuner.model.kernels import LIGER_MODEL_TYPES

    if s.fused_ce and shape.model_type not in LIGER_MODEL_TYPES:
        s = s.with_(fused_ce=False)  # finetuner applies Liger only to these architectures
    d = _dtypes(s)
    weights = weight_bytes(shape, s)
    w_total = sum(weights.values())
    tensors = trainable_tensors(shape, s) + list(s.vision_trainable)
    n_train = trainable_params(shape, s) + sum(r * c * k for r, c, k in s.vision_trainable)
    trainable = 0 if s.method == "full" else 4 * n_train  # LoRA A/B in fp32 (full: in weights)
    grads = 4 * n_train
    states = optimizer_state_bytes(tensors, s.optimizer)
    paged = states if s.optimizer.startswith("paged_") else 0
    step_temp = optimizer_step_temp_bytes(tensors, s.optimizer)
    cast_cache = d.c * n_train if d.autocast else 0
    pref = preference_cost(shape, s)
    # a preference objective's micro-batch is twice as many sequences
    act = activation_bytes(shape, s.with_(micro_batch=pref.rows) if pref else s)
    quant_temp = _quant_temp_bytes(shape, s)

    held = act.logits  # 0 with the chunked or fused loss
    # activations at the cross-entropy backward and at a layer's backward
    if s.gradient_checkpointing:
        # the recomputed layer's saved tensors come back one layer at a time, and are freed as its
        # backward goes; of the MLP's short-lived gradients about one of three is alive at the
        # layer's peak (fitted on the H100 runs: docs/memory.md)
        # (tiled MLP: the whole-sequence part of the transient is counted whole, see layer_transient_per_token)
        layer_phase = (act.saved_total + held + act.per_layer + act.mlp_chunk
                       + int((act.transient - act.transient_whole) / (GC_TRANSIENT_DIVISOR if s.method == "qlora" else GC_TRANSIENT_DIVISOR_16BIT))
                       + act.transient_whole + quant_temp)
    else:
        layer_phase = act.saved_total + held + act.mlp_chunk + act.transient + quant_temp
    # the dequantized weight exists only inside a quantized layer: not at the cross-entropy
    loss_phase = act.saved_total + act.logits + act.loss_peak + LOSS_PHASE_EXTRA_BYTES
    # the pictures' way through a trained vision tower is kept until the backward reaches it, after every layer's
    vision = s.vision_activation_bytes
    loss_phase += vision
    layer_phase += vision
    if pref:
        loss_phase += pref.buffers_bytes
        layer_phase += pref.buffers_bytes
        # the reference forward runs after the policy's, before the backward
        ref_phase = act.saved_total + act.logits + pref.buffers_bytes + pref.reference_pass_bytes
        layer_phase = max(layer_phase, ref_phase)
    act_peak = max(loss_phase, layer_phase)
    act_label = "activations (cross-entropy backward)" if loss_phase >= layer_phase else "activations (layer backward)"

    base = w_total + trainable + states
    fwd_bwd = base + grads + cast_cache + act_peak
    step = base + grads + step_temp
    phases = {"forward/backward": fwd_bwd, "optimizer step": step}
    peak_phase = max(phases, key=lambda k: phases[k])

    comp: dict[str, int] = {}
    for kind, b in weights.items():
        comp[f"weights: {kind}"] = b
    if trainable:
        comp["LoRA weights (fp32)"] = trainable
    comp["gradients"] = grads
    comp[f"optimizer states ({s.optimizer})"] = states
    if peak_phase == "forward/backward":
        if cast_cache:
            comp["autocast weight copies"] = cast_cache
        if s.gradient_checkpointing:
            comp["activations: layer checkpoints"] = act.checkpoints - act.offloaded
            rest = act_peak - (act.checkpoints - act.offloaded) - (act.logits if loss_phase >= layer_phase else held)
        else:
            rest = act_peak - (act.logits if loss_phase >= layer_phase else held)
        if quant_temp and layer_phase > loss_phase:
            comp["dequantization buffer"] = quant_temp
            rest -= quant_temp
        if vision:
            comp["activations: vision tower and projector (traced)"] = vision
            rest -= vision
        comp[act_label] = rest
        comp["logits"] = act.logits if loss_phase >= layer_phase else held
    else:
        comp["optimizer step temporaries"] = step_temp
    workspace = CUBLAS_WORKSPACE_BYTES if s.platform == CUDA else 0
    allocated = phases[peak_phase] + workspace
    if workspace:
        comp["cuBLAS workspace"] = workspace
    # paged states live outside torch's allocator (cudaMallocManaged): in the device total, not
    # in the allocator's counters
    torch_allocated = allocated - paged
    slack = int(torch_allocated * ALLOCATOR_FRACTION) + ALLOCATOR_FIXED_BYTES
    reserved = torch_allocated + slack
    comp["allocator slack"] = slack
    context = CUDA_CONTEXT_BYTES if s.platform == CUDA else 0
    if context:
        comp["CUDA context"] = context
    total = reserved + paged + context
    assert sum(comp.values()) == total, (sum(comp.values()), total)

    notes: list[str] = []
    if paged:
        notes.append("paged optimizer states live in unified memory and move to CPU memory when the card is full")
    device = gpu.memory_bytes if gpu else None
    budget = int(device * (1 - margin)) if device else None
    details = {
        "parameters": shape.param_counts(),
        "trainable_params": n_train,
        "tokens_per_micro_batch": s.tokens,
        "activations": {
            "per_layer_bytes": act.per_layer,
            "checkpoints_bytes": act.checkpoints,
            "saved_total_bytes": act.saved_total,
            "model_extra_bytes": act.model_extra,
            "logits_bytes": act.logits,
            "loss_peak_bytes": act.loss_peak,
            "transient_bytes": act.transient,
            "tiled_mlp_chunk_bytes": act.mlp_chunk,
            "loss_phase_bytes": loss_phase,
            "layer_phase_bytes": layer_phase,
        },
        "optimizer_step_temp_bytes": step_temp,
        "autocast_copies_bytes": cast_cache,
        "dequant_buffer_bytes": quant_temp,
        "paged_bytes": paged,
        "vision_activation_bytes": vision,
        "vision_trainable_params": sum(r * c * k for r, c, k in s.vision_trainable),
        "preference": asdict(pref) if pref else None,
    }
    return MemoryEstimate(
        model=shape.name,
        settings=s,
        components=comp,
        peak_phase=peak_phase,
        phases=phases,
        allocated_bytes=allocated - paged,
        reserved_bytes=reserved,
        total_bytes=total,
        device_bytes=device,
        budget_bytes=budget,
        spillable_bytes=paged,
        offloaded_bytes=act.offloaded,
        details=details,
        notes=notes,
        gpu=gpu.name if gpu else None,
        shape=shape,
    )


# ====================================================================== recipes
def settings_from_recipe(recipe: Recipe, gpu: GpuProfile | None = None, model_type: str | None = None,
                         runtime: Runtime | None = None, **overrides: Any) -> Settings:
    """The memory model's view of a resolved recipe on ``gpu``.

    The device-dependent choices (dtypes, attention, loss path) are the trainer's own: ``runtime``
    when the caller has one (a run), else :func:`finetuner.config.runtime.resolve` for ``gpu`` (``None``:
    an unnamed bf16 CUDA card) and the base model's ``model_type`` (for Liger's support).
    """
    from finetuner.config.runtime import Device, resolve

    if recipe.auto_keys():
        raise UserError(
            f"The recipe has auto values ({', '.join(recipe.auto_keys())}): the planner resolves them.",
            hint="Use finetuner.plan / `finetuner plan --recipe`, or set the values.",
        )
    rt = runtime or resolve(recipe, Device.of(gpu), model_type)
    q = recipe.quantization
    t = recipe.training
    spec = spec_of(recipe.objective)
    kw: dict[str, Any] = dict(
        method=recipe.method,
        weight_dtype=rt.base_dtype,
        compute_dtype=rt.precision,
        lora_r=recipe.lora.r,
        lora_targets=recipe.lora.target_modules if isinstance(recipe.lora.target_modules, str) else tuple(recipe.lora.target_modules),
        lora_dropout=recipe.lora.dropout,
        lora_bias=recipe.lora.bias,
        micro_batch=t.micro_batch_size,
        seq_len=recipe.data.max_seq_len,
        gradient_accumulation=t.gradient_accumulation,
        gradient_checkpointing=t.gradient_checkpointing,
        optimizer=t.optimizer,
        attn_implementation="sdpa" if rt.attention == "auto" else rt.attention,
        attention_mask=recipe.data.packing or t.micro_batch_size > 1,
        platform=CUDA if rt.is_cuda else CPU,
        activation_offload=t.offload_activations,
        loss_chunk=t.loss_chunk_size,
        tiled_mlp=rt.tiled_mlp,
        fused_ce=rt.loss_path == "liger_fused_linear_ce" and spec.fused_loss,
        objective=recipe.objective,
        reference=recipe.preference.reference if spec.reference_model else "none",
    )
    if q is not None and recipe.method == "qlora":
        kw.update(quant_bits=q.bits, quant_type=q.quant_type, double_quant=q.double_quant, compute_dtype=rt.compute_dtype)
    kw.update(overrides)
    return Settings(**kw)

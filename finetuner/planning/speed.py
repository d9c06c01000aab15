"""The speed model: how long one optimizer step takes, from the parts of the step.

A step is ``gradient_accumulation`` micro-batches plus the optimizer update. One micro-batch of
``T = rows x seq`` tokens (``rows`` = micro-batch, twice that for a preference objective's
chosen and rejected responses) costs the sum of:

* **matmuls** (:func:`matmul_flops`, :func:`matmul_seconds`) at the device's achievable matmul
  rate for the compute dtype and the layer's width (:meth:`DeviceSpeed.matmul_rate`; on a CPU less
  for a micro-batch of few tokens, :func:`matmul_row_efficiency`): the base
  linears (forward ``2 N T``, input gradient ``2 N T``, weight gradient ``2 N T`` for full
  fine-tuning only: Kaplan et al. 2020, "6N per token"), the LoRA adapters (``r (in + out)`` per
  target: forward, input and weight gradients, ``6 r (in + out) T``, at the rate of width ``r``),
  the LM head on labelled tokens (``2 V h``; finetuner's chunked loss recomputes its forward in the
  backward, so ``3x``, + ``1x`` for a trained head), the recompute of checkpointing (the decoder's
  forward again) and a DPO/KTO reference pass (a forward without gradients over the same rows);
* **attention** (:func:`attention_seconds`): ``Q K^T`` and ``P V``, ``4 seq q_dim`` per token and
  layer forward over the full square, backward twice that, at the rate of the device's
  ``scaled_dot_product_attention`` kernel (causal, or with a mask) at that sequence length, in the layers
  that have softmax attention only (:func:`finetuner.model.mixers.attention_layers`);
* **linear attention and state-space scans** (:mod:`finetuner.planning.scans`): a Gated DeltaNet's chunked
  delta rule, Mamba-2's chunked scan, Mamba's sequential scan, LFM2's short convolution, their FLOPs linear in ``seq`` as transformers'
  PyTorch path computes them, forward and backward twice that, at the matmul rate of their narrow width; their
  Python loops' operations (per chunk, or per token for Mamba) in the per-operation cost, their element-wise
  bytes (:func:`finetuner.planning.scans.scan_bytes`, counted on a trace: the delta rule's backward grows as
  ``T²``; LFM2's short convolution's) in the memory-bound term, but for the delta rule's backward's zero-fills of
  whole-sequence tensors (:func:`finetuner.planning.scans.scan_fill_bytes`), timed at the rate memory just taken
  from the system is written (:attr:`DeviceSpeed.fresh_bytes_per_s`, **fresh memory**: on a CPU the first touch of
  each page; half the delta rule's fwd+bwd time in a profile at 2,048 tokens). Their linears are decoder linears
  (the matmuls above);
* **cross-entropy** (:func:`loss_seconds`) over the labelled tokens' logits and LoRA's **dropout**
  (:func:`dropout_seconds`), at the elements per second the device's kernels reach;
* **memory-bound work** (:func:`memory_bytes`) at the achievable bandwidth: every tensor a layer
  saves for backward (:func:`finetuner.memory.activations.layer_activation_terms`, the memory model's
  own list: norms, activations, dropout, attention probabilities or an SDPA mask bias) is written
  and read in the forward, then read, and its gradient written and read, in the backward, and
  eager PyTorch makes about two unsaved tensors of the same size for each saved one:
  ``TRAFFIC_PER_SAVED_BYTE = 15`` (the recompute adds the forward's 6 again);
  4-bit/8-bit dequantization of the frozen base at every forward, recompute and input gradient
  (:attr:`DeviceSpeed.dequant_weights_per_s`); the optimizer update reads and writes
  weights, gradients and states (:func:`optimizer_bytes`);
* **per-operation cost** (:func:`op_count`): each tensor operation an eager PyTorch step launches
  costs a fixed time (:attr:`DeviceSpeed.op_overhead_s`: Python dispatch plus a kernel launch),
  whatever its size, plus, on a CPU, the wait for all threads at the end of one that spreads over them
  (:func:`op_seconds`: a micro-batch's operations do, a decode step's do not); this is what bounds small
  models and small micro-batches, and on a CPU that other processes keep busy, every step. On a CPU it adds
  to the work; on a GPU the host queues kernels while the device runs, so only the host's excess
  over the device's work counts;
* **transfers**: activation offload copies each saved layer input to the host and back at the
  host link's rate, half of it hidden behind compute (``OFFLOAD_OVERLAP``); with several GPUs the
  strategy's collectives move ``comm_bytes_per_step`` at the device link's rate and its CPU offload
  ``host_transfer_bytes_per_step`` at the host link's rate, not overlapped (a pessimistic
  simplification);
* a **fixed cost per step** (``STEP_FIXED_OPS`` operations: gradient clipping, the optimizer's
  kernels, the scheduler, zeroing the gradients, the collation and the trainer's bookkeeping).

Constants that are estimates or fits, not counts, say so where they are defined: the x3 of
``TRAFFIC_PER_SAVED_BYTE`` and ``EAGER_OP_FACTOR`` (from the CPU matrix), ``CPU_MATMUL_HALF_ROWS`` (a
CPU matmul over few rows), ``DEVICE_HALF_TOKENS`` and
``DEQUANT_WEIGHTS_PER_S_PER_GBS`` (from the H100 runs), the data-sheet efficiencies.

The device figures (:class:`DeviceSpeed`) come from a calibration on the machine
(:mod:`finetuner.planning.calibrate`, ``finetuner gpus --calibrate``), or, for a card that is not
here, from its data sheet (:meth:`DeviceSpeed.from_profile`) with documented efficiencies. Pure
arithmetic: no torch.

Checked against measured runs by ``scripts/validate/speed_model.py`` (the results in
``docs/validation/speed_model_<device>.json``, replayed by ``tests/planning/test_speed_model.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from finetuner.device import CPU, CUDA
from finetuner.memory.activations import layer_activation_terms
from finetuner.memory.model import Settings, trainable_params
from finetuner.memory.storage import quantized_numel
from finetuner.model.shapes import ModelShape, lora_targets
from finetuner.objectives.specs import spec_of
from finetuner.model.mixers import attention_layers
from finetuner.planning.scans import scan_bytes, scan_fill_bytes, scan_flops, scan_ops, scan_width

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.hardware import GpuProfile
    from finetuner.memory.model import MemoryEstimate
    from finetuner.planning.lengths import BatchShape

# ---------------------------------------------------------------------- data-sheet defaults
#: Share of a card's dense tensor-core peak that large bf16/fp16 matmuls reach in practice
#: (cuBLAS on H100 SXM: ~600-700 of 989 TFLOP/s for 4k-8k GEMMs; A100: ~230-270 of 312).
MATMUL_EFFICIENCY = 0.65
#: Matrix width at which a card's matmul rate is half its large-matrix rate (narrow layers keep
#: fewer tensor cores busy): ``rate(d) = rate * d / (d + MATMUL_HALF_WIDTH)``.
MATMUL_HALF_WIDTH = 256
#: Tokens per micro-batch at which a GPU's work (matmuls, attention, elementwise kernels) runs at half
#: its rates: a micro-batch of few tokens launches kernels too small to fill the streaming
#: multiprocessors and is bound by reading the weights: the device's work is divided by
#: ``T / (T + DEVICE_HALF_TOKENS)`` (the planner's earlier utilisation curve, fitted on the H100 runs
#: of docs/benchmarks.md). A CPU reaches its rates from a few rows (0: no such term; the CPU matrix
#: in docs/validation/ bears it out).
DEVICE_HALF_TOKENS = {CUDA: 256, CPU: 0}
#: Rows at which a CPU's matmul reaches half its calibrated rate (measured at ``matmul_tokens`` rows):
#: the CPU's kernels do not block well over few rows (a decode step's few sequences, a micro-batch of
#: one short sequence): ``rate(T) = rate × T / (T + CPU_MATMUL_HALF_ROWS)``, relative to the
#: calibration's rows (:func:`matmul_row_efficiency`). A fit on the development CPU (one thread,
#: ``scripts/validate/speed_grpo.py --probe``: fp32 4096² and 1536×576 weights out of the cache at 2, 4,
#: 16 and 64 rows reach 0.09-0.10, 0.19-0.20, 0.47-0.49 and 0.76-0.77 of the calibrated rate: half at
#: 16-19 rows). A GPU's small micro-batches are ``DEVICE_HALF_TOKENS``'.
CPU_MATMUL_HALF_ROWS = 17
#: Share of the data-sheet memory bandwidth that elementwise kernels reach (STREAM-like copies
#: reach 80-90 % on HBM cards).
BANDWIDTH_EFFICIENCY = 0.8
#: Seconds per tensor operation in eager PyTorch on a GPU: Python dispatch, autograd bookkeeping
#: and the kernel launch (PyTorch's own figure for eager overhead is 5-10 us an op).
GPU_OP_OVERHEAD_S = 9e-6
#: bitsandbytes dequantizes every 4-bit weight to the compute dtype before its matmul, at each
#: forward, recompute and input gradient (``MatMul4Bit``). Its kernel reaches far less than the
#: memory bandwidth: ~6.8e10 weights/s on the H100 (3,350 GB/s), measured as the difference of
#: the Llama-3.1-8B QLoRA and LoRA runs in docs/benchmarks.md (0.31 s per 4,096-token micro-batch
#: over 3 passes of 7.0e9 weights), scaled by bandwidth for other cards. A calibration measures it.
DEQUANT_WEIGHTS_PER_S_PER_GBS = 6.8e10 / 3350
#: Attention kernels without a calibration, in full-square FLOPs per second relative to the matmul
#: rate at the head dimension: FlashAttention skips the masked half (x2) at about half the matmul
#: efficiency; SDPA's memory-efficient kernel with an explicit mask computes the whole square, slower.
CAUSAL_ATTENTION_EFFICIENCY = 1.0
MASKED_ATTENTION_EFFICIENCY = 0.3
#: Bytes the cross-entropy moves per logit without a calibration: the fp32 logits read twice
#: (max, then exp-sum), the log-probabilities written and read, the gradient written (20).
CE_BYTES_PER_ELEMENT = 20
#: Dropout per element without a calibration: input read, mask written, output written (fp32: 12).
DROPOUT_BYTES_PER_ELEMENT = 12
#: 8-bit (LLM.int8 with outlier decomposition) costs about twice 4-bit's dequantization.
INT8_SLOWDOWN = 2.0

# ---------------------------------------------------------------------- the model's constants
#: Bytes moved per byte a layer saves for backward, forward + backward: each saved tensor is
#: written and read in the forward, read in the backward, its gradient written and read (5 passes),
#: and eager PyTorch makes about two more tensors of the same size for each one it saves that are not
#: saved (RMSNorm's power, mean and products, RoPE's halves and products, residual adds, LoRA's scaled
#: outputs, autocast copies): x3. The factor 3 is an estimate that the CPU matrix
#: (docs/validation/speed_model_cpu.json) bears out; the 5 passes are counted.
TRAFFIC_PER_SAVED_BYTE = 15
#: The forward's share of those (recomputed under checkpointing, repeated by a reference pass).
FORWARD_TRAFFIC = 6
#: Tensor operations of one decoder layer's forward without adapters, counted in transformers'
#: Llama layer: two RMSNorms (8 each: cast, pow, mean, add, rsqrt, mul, cast, weight), q/k/v/o and
#: gate/up/down linears (7), RoPE on q and k (12), attention with its reshapes (5), the MLP's
#: activation and product (2), two residual adds (2), views and transposes (~6).
OPS_PER_LAYER = 42
#: Operations a LoRA target adds to its layer's forward (peft ``Linear.forward``): the input cast,
#: dropout, ``lora_A``, ``lora_B``, the scaling and the add.
OPS_PER_LORA_TARGET = 6
#: Operations the 4-bit/8-bit base adds per linear and forward (dequantize the weight, its
#: absmax when double-quantized, cast, matmul, peft's defensive clone of the output).
OPS_PER_QUANT_LINEAR = 3
#: Backward kernels per forward operation (autograd's nodes launch 1-3 kernels each).
BACKWARD_OPS = 1.5
#: Operations outside the layers per micro-batch forward: embedding, the final norm, the causal
#: mask or position handling, the chunked loss (per chunk: slice, matmul, cross-entropy, add).
OPS_PER_MODEL = 30
OPS_PER_LOSS_CHUNK = 8
#: Operations per optimizer step: gradient clipping (norms, the clip), the optimizer's kernels,
#: the scheduler, zeroing the gradients, moving the batch, and the trainer's own Python
#: (collation, counting tokens, the loss and grad-norm read back).
STEP_FIXED_OPS = 150
#: An operation inside a model costs more than the calibration's bare operation (the module call,
#: peft's loop over adapters, autograd's hooks and saved-tensor bookkeeping): about three of them,
#: fitted on the smallest configurations of the CPU matrix (docs/validation/speed_model_cpu.json),
#: where these costs dominate.
EAGER_OP_FACTOR = 3.0
#: Elements from which PyTorch spreads an operation over its threads on a CPU (``at::internal::GRAIN_SIZE``;
#: MKL's matmuls over a micro-batch's rows do too): such an operation also pays
#: :attr:`DeviceSpeed.parallel_op_s`, the wait for every thread at its end. A decode step's operations (one
#: token: ``hidden`` elements) stay on one thread and do not.
PARALLEL_GRAIN = 32768
#: Activation offload copies each checkpoint to pinned host memory and back; about half of it
#: hides behind compute.
OFFLOAD_OVERLAP = 0.5

#: Bytes per element of the compute dtypes.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def interpolate(table: tuple[tuple[int, float], ...], x: float) -> float:
    """``table``'s value at ``x``: linear in ``log(x)`` between its rows, flat beyond them."""
    if x <= table[0][0]:
        return table[0][1]
    for (x0, r0), (x1, r1) in zip(table, table[1:]):
        if x0 <= x <= x1:
            return r0 + math.log(x / x0) / math.log(x1 / x0) * (r1 - r0)
    return table[-1][1]


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast a device does the kinds of work a training step is made of.

    ``matmul_flops`` maps a compute dtype to a table of ``(width, FLOP/s)``: the rate a matmul of
    that width (its smaller weight dimension) reaches, interpolated in ``log(width)`` between the
    rows and held flat beyond them. ``source`` says where the figures come from (a calibration
    on this machine, or a card's data sheet), and is printed by the plan.
    """

    name: str
    platform: str  # a platform of finetuner.device.PLATFORMS (CPU or CUDA)
    matmul_flops: dict[str, tuple[tuple[int, float], ...]]
    bandwidth_bytes_per_s: float
    op_overhead_s: float
    dequant_weights_per_s: float
    host_link_bytes_per_s: float
    peer_link_bytes_per_s: float
    source: str
    calibrated: bool = False
    details: dict[str, Any] = field(default_factory=dict, compare=False)
    #: rows (tokens) of the matmuls ``matmul_flops`` was measured at; None: the large-matrix rate (data sheet)
    matmul_tokens: int | None = None
    #: attention kernels, full-square FLOPs per second forward + backward: ``causal`` (the
    #: is_causal path: FlashAttention on a GPU) and ``masked`` (an explicit mask: padding, packing)
    attention_flops: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    #: the cross-entropy's forward + backward over logits, ``(vocabulary, elements per second)`` rows,
    #: and dropout (mask + multiply), elements per second
    cross_entropy_elements_per_s: tuple[tuple[int, float], ...] = ()
    dropout_elements_per_s: float = 0.0
    #: what a run waits for outside its steps (:mod:`finetuner.planning.wait`), 0 where not measured (a card's
    #: data sheet, an older calibration; the wait model's named defaults then apply): seconds a new process
    #: takes to import the libraries a run loads, bytes per second read from a file not in the page cache and
    #: written with ``fsync``, and seconds to write and ``fsync`` one small file
    startup_s: float = 0.0
    disk_read_bytes_per_s: float = 0.0
    disk_write_bytes_per_s: float = 0.0
    file_sync_s: float = 0.0
    #: seconds an operation that spreads over several CPU threads costs beyond its work and
    #: ``op_overhead_s``: the wait for every thread at its end (microseconds on idle cores; a scheduler's
    #: time slice, milliseconds, when other processes keep the cores busy); 0 with one thread, on a GPU
    #: and in an older calibration
    parallel_op_s: float = 0.0
    #: bytes per second an operation writes into memory just taken from the system (the first touch of its
    #: pages: on a CPU a large tensor's allocation is mapped fresh, as the delta rule's backward's whole-sequence
    #: zero tensors are); 0 where not measured (a GPU, whose caching allocator reuses its memory, or an older
    #: calibration): the bandwidth
    fresh_bytes_per_s: float = 0.0

    def matmul_rate(self, dtype: str, width: int) -> float:
        """FLOP/s of a matmul in ``dtype`` whose narrower weight dimension is ``width``."""
        table = self.matmul_flops.get(dtype) or self.matmul_flops.get("fp32") or next(iter(self.matmul_flops.values()))
        if width < table[0][0]:  # narrower than measured: proportionally slower
            return table[0][1] * width / table[0][0]
        return interpolate(table, width)

    def utilisation(self, tokens: int) -> float:
        """The share of its rates the device reaches on a micro-batch of ``tokens`` (see
        ``DEVICE_HALF_TOKENS``), relative to the calibration's own matmuls (``matmul_tokens``)."""
        half = DEVICE_HALF_TOKENS.get(self.platform, 0)
        if not half:
            return 1.0
        at = self.matmul_tokens / (self.matmul_tokens + half) if self.matmul_tokens else 1.0
        return tokens / (tokens + half) / at

    def attention_rate(self, kind: str, seq: int) -> float | None:
        """Full-square FLOP/s (forward + backward) of the ``causal`` or ``masked`` attention kernel at
        sequence ``seq``, or None without a calibration."""
        table = self.attention_flops.get(kind)
        return interpolate(table, seq) if table else None

    @classmethod
    def from_profile(cls, gpu: GpuProfile) -> DeviceSpeed:
        """A card's figures from its data sheet (``GpuProfile``): matmuls at ``MATMUL_EFFICIENCY`` of
        the dense peak (bf16 where the card has it, fp16 else; fp32 at a sixteenth of that on the
        CUDA cores, or TF32 is not used by default), falling off for narrow layers as
        ``width / (width + MATMUL_HALF_WIDTH)``; ``BANDWIDTH_EFFICIENCY`` of the memory bandwidth;
        ``GPU_OP_OVERHEAD_S`` per operation. A CPU profile without a calibration gets its own
        modest figures (``GpuProfile.tflops``/``bandwidth_gbs``) and 20 us per operation."""
        peak = gpu.tflops * 1e12 * MATMUL_EFFICIENCY
        widths = (64, 128, 256, 512, 1024, 2048, 4096, 8192)

        def table(rate: float) -> tuple[tuple[int, float], ...]:
            return tuple((w, rate * w / (w + MATMUL_HALF_WIDTH)) for w in widths)

        half = "bf16" if gpu.bf16 else "fp16"
        bw = gpu.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY
        if gpu.platform == "cpu":
            return cls(gpu.name, "cpu", {"fp32": table(peak), "bf16": table(peak / 20)}, bw, 20e-6,
                       DEQUANT_WEIGHTS_PER_S_PER_GBS * gpu.bandwidth_gbs / 10, gpu.pcie_gbs * 1e9, gpu.link_gbs * 1e9,
                       source=f"{gpu.name}: default figures ({gpu.tflops:g} TFLOP/s, {gpu.bandwidth_gbs:g} GB/s), "
                              "not calibrated: run `finetuner gpus --calibrate`")
        return cls(
            gpu.name, CUDA, {half: table(peak), "fp16": table(peak), "fp32": table(peak / 16)}, bw, GPU_OP_OVERHEAD_S,
            DEQUANT_WEIGHTS_PER_S_PER_GBS * gpu.bandwidth_gbs, gpu.pcie_gbs * 1e9, gpu.link_gbs * 1e9,
            source=(f"{gpu.name} timed as the {gpu.speed_of}'s data sheet: " if gpu.speed_of else f"{gpu.name} data sheet: ")
            + (f"{gpu.tflops:g} TFLOP/s dense {half} at {MATMUL_EFFICIENCY:.0%}, "
               f"{gpu.bandwidth_gbs:g} GB/s at {BANDWIDTH_EFFICIENCY:.0%}, {GPU_OP_OVERHEAD_S * 1e6:g} us an operation"),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("matmul_flops", "attention_flops"):
            d[key] = {k: [list(row) for row in v] for k, v in getattr(self, key).items()}
        d["cross_entropy_elements_per_s"] = [list(row) for row in self.cross_entropy_elements_per_s]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSpeed:
        d = dict(d)
        for key in ("matmul_flops", "attention_flops"):
            d[key] = {k: tuple((int(w), float(r)) for w, r in v) for k, v in d.get(key, {}).items()}
        d["cross_entropy_elements_per_s"] = tuple((int(v), float(r)) for v, r in d.get("cross_entropy_elements_per_s") or ())
        return cls(**d)


@dataclass(frozen=True)
class StepTime:
    """The predicted time of one optimizer step, by part (seconds), and its tokens."""

    parts: dict[str, float]
    #: real tokens (padding excluded) per step: what a run counts, and ``tokens_per_s`` divides
    tokens_per_step: int
    micro_batches: int
    source: str
    #: the prediction assumes the longest lengths (GRPO's prompts and completions at their limits): the
    #: step time is at most ``step_s``; ``tokens_per_s`` is at those lengths, not what a run counts
    upper_bound: bool = False
    #: positions per step, padding included (the work the step model times); None: every row full
    padded_tokens_per_step: int | None = None
    #: whether the lengths are the data's (:mod:`finetuner.planning.lengths`), else every row ``seq_len`` long
    data_lengths: bool = False

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())

    @property
    def tokens_per_s(self) -> float:
        """Real tokens per second (padding excluded): the rate a run reports."""
        return self.tokens_per_step / max(self.step_s, 1e-12)

    @property
    def padded_tokens_per_s(self) -> float:
        """Positions per second, padding included."""
        return (self.padded_tokens_per_step or self.tokens_per_step) / max(self.step_s, 1e-12)

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "tokens_per_step": self.tokens_per_step,
                "padded_tokens_per_s": self.padded_tokens_per_s, "data_lengths": self.data_lengths,
                "parts_s": dict(self.parts), "source": self.source, "upper_bound": self.upper_bound}


# ---------------------------------------------------------------------- the terms
def rows_per_micro_batch(s: Settings) -> int:
    """Sequences in one micro-batch: a preference objective scores the chosen and the rejected
    response of each pair (or example and its mismatched partner for KTO) in one pass."""
    return s.micro_batch * spec_of(s.objective).sequences_per_example


def has_reference_pass(s: Settings) -> bool:
    """DPO/KTO with ``reference: adapter_off`` score the rows again with the adapter disabled."""
    return spec_of(s.objective).reference_model and s.reference == "adapter_off"


def causal_skip(s: Settings) -> bool:
    """Whether attention skips the masked half of the scores: FlashAttention-2, or SDPA's flash /
    memory-efficient kernels on a GPU without an explicit mask. A mask (padding, packing) or the
    CPU's SDPA computes the whole square."""
    if s.attn_implementation == "flash_attention_2":
        return True
    return s.attn_implementation == "sdpa" and s.platform == CUDA and not s.attention_mask


def forward_flops(shape: ModelShape, s: Settings) -> dict[str, float]:
    """One forward's matmul FLOPs of a micro-batch, by the kind of matmul (the width decides the rate)."""
    T = rows_per_micro_batch(s) * s.seq_len
    lora = 0.0
    if s.method != "full":
        targets = list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets
        lora = sum(s.lora_r * (fin + fout) * copies for _, fin, fout, copies in lora_targets(shape, targets))
    seq_eff = s.seq_len / 2 if causal_skip(s) else s.seq_len
    return {
        "decoder": 2 * shape.active_weight_numel * T,  # a mixture of experts: top_k experts per token
        "lora": 2 * lora * T,
        "attention": 4 * seq_eff * shape.q_dim * attention_layers(shape) * T,
        "scan": scan_flops(shape, rows_per_micro_batch(s), s.seq_len),  # linear attention, state-space mixers
        "head": 2 * shape.vocab_size * shape.hidden_size * T * s.label_fraction,
    }


def _passes(s: Settings) -> dict[str, float]:
    """How many forward-sized matmuls each kind costs per micro-batch (see the module doc)."""
    gc, ref, full = float(s.gradient_checkpointing), float(has_reference_pass(s)), float(s.method == "full")
    return {
        "decoder": 2 + full + gc + ref,  # forward, input gradient, weight gradient (full), recompute, reference
        "lora": 3 + gc,  # forward, input and weight gradients, recompute
        "attention": 3 + gc + ref,  # forward, backward (2x), recompute, reference
        "scan": 3 + gc + ref,  # likewise
        # forward, its recompute in the chunked loss's backward, the input gradient, the weight gradient (full), reference
        "head": (3 if s.loss_chunk > 0 else 2) + full + ref,
    }


def matmul_flops(shape: ModelShape, s: Settings) -> dict[str, float]:
    """Matmul FLOPs of one micro-batch by part (see the module doc for each formula)."""
    f, p = forward_flops(shape, s), _passes(s)
    gc, ref = s.gradient_checkpointing, has_reference_pass(s)
    return {
        "base forward": f["decoder"],
        "base input gradient": f["decoder"],
        "base weight gradient": f["decoder"] if s.method == "full" else 0.0,
        "LoRA": 3 * f["lora"],
        "attention": 3 * f["attention"],
        "linear attention and scans": 3 * f["scan"],
        "LM head": f["head"] * (p["head"] - ref),
        "checkpointing recompute": (f["decoder"] + f["lora"] + f["attention"] + f["scan"]) if gc else 0.0,
        "reference pass": (f["decoder"] + f["attention"] + f["scan"] + f["head"]) if ref else 0.0,
    }


def typical_width(shape: ModelShape) -> dict[str, int]:
    """The narrower dimension of each kind of matmul, which its rate depends on: the decoder's
    linears weighted by their size, the LM head's hidden size, attention's head dimension, the scans' narrow width
    (:func:`finetuner.planning.scans.scan_width`)."""
    lin = shape.layer_linears()
    weights = sum(x.in_features * x.out_features for x in lin)
    dec = int(sum(min(x.in_features, x.out_features) * x.in_features * x.out_features for x in lin) / max(weights, 1))
    return {"decoder": dec, "head": min(shape.hidden_size, shape.vocab_size), "attention": shape.head_dim,
            "scan": scan_width(shape)}


def matmul_row_efficiency(speed: DeviceSpeed, rows: float) -> float:
    """The share of its calibrated matmul rate a CPU reaches on matmuls of ``rows`` rows
    (``CPU_MATMUL_HALF_ROWS``, relative to the calibration's ``matmul_tokens``); 1 on a GPU (its small
    micro-batches are :meth:`DeviceSpeed.utilisation`'s)."""
    if speed.platform != "cpu":
        return 1.0
    at = speed.matmul_tokens / (speed.matmul_tokens + CPU_MATMUL_HALF_ROWS) if speed.matmul_tokens else 1.0
    return rows / (rows + CPU_MATMUL_HALF_ROWS) / at


def matmul_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed) -> float:
    """Seconds of one micro-batch's matmuls, each kind at the device's rate for its width (LoRA's
    at the rank ``r``), on a CPU at :func:`matmul_row_efficiency` of the micro-batch's tokens."""
    f, p, w = forward_flops(shape, s), _passes(s), typical_width(shape)
    w["lora"] = max(1, s.lora_r)
    dtype = s.compute_dtype if s.compute_dtype in DTYPE_BYTES else "fp32"
    eff = matmul_row_efficiency(speed, rows_per_micro_batch(s) * s.seq_len)
    return sum(f[k] * p[k] / speed.matmul_rate(dtype, w[k]) for k in f if f[k] and k != "attention") / eff


def attention_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed) -> float:
    """Seconds of one micro-batch's attention kernels: the full square's FLOPs
    (``4 seq q_dim`` per token and layer, forward) at the device's attention rate, which counts
    forward + backward as 3 of them and includes any causal skipping (calibrated: the rate of
    ``scaled_dot_product_attention`` with ``is_causal`` or with a mask). Eager attention runs as
    matmuls (its softmax is in the memory-bound term). Without a calibration, a kernel that skips
    the masked half reaches ``CAUSAL_ATTENTION_EFFICIENCY`` and a masked one
    ``MASKED_ATTENTION_EFFICIENCY`` of the matmul rate at the head dimension, in full-square FLOPs."""
    if not attention_layers(shape):  # no attention in any layer (Mamba, Mamba-2)
        return 0.0
    T = rows_per_micro_batch(s) * s.seq_len
    full = 4 * s.seq_len * shape.q_dim * attention_layers(shape) * T
    units = 3 + float(s.gradient_checkpointing) + float(has_reference_pass(s))
    dtype = s.compute_dtype if s.compute_dtype in DTYPE_BYTES else "fp32"
    if s.attn_implementation == "eager":
        return full * units / speed.matmul_rate(dtype, shape.head_dim)
    kind = "causal" if (causal_skip(s) or s.platform == "cpu" and not s.attention_mask) else "masked"
    rate = speed.attention_rate(kind, s.seq_len)
    if not rate:
        eff = CAUSAL_ATTENTION_EFFICIENCY if kind == "causal" else MASKED_ATTENTION_EFFICIENCY
        rate = speed.matmul_rate(dtype, shape.head_dim) * eff
    return full * units / rate


def loss_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed) -> float:
    """Seconds of the cross-entropy over the labelled tokens' logits (``labelled x vocab`` elements):
    forward + backward at the calibrated rate, plus the forward again where finetuner's chunked
    loss recomputes it (``loss_chunk > 0``) and for a reference pass. Without a calibration the
    rate is the bandwidth over ``CE_BYTES_PER_ELEMENT``."""
    labelled = rows_per_micro_batch(s) * s.seq_len * s.label_fraction
    units = 1 + (0.5 if s.loss_chunk > 0 else 0.0) + (0.5 if has_reference_pass(s) else 0.0)
    table = speed.cross_entropy_elements_per_s
    rate = interpolate(table, shape.vocab_size) if table else speed.bandwidth_bytes_per_s / CE_BYTES_PER_ELEMENT
    return labelled * shape.vocab_size * units / rate


def dropout_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed) -> float:
    """Seconds of LoRA's dropout on each target's input (a random mask and a multiply per element),
    at every forward and recompute. Without a calibration: the bandwidth over ``DROPOUT_BYTES_PER_ELEMENT``."""
    if s.method == "full" or s.lora_dropout <= 0:
        return 0.0
    targets = list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets
    width = sum(fin * copies for _, fin, _, copies in lora_targets(shape, targets))
    elements = width * rows_per_micro_batch(s) * s.seq_len * (1 + float(s.gradient_checkpointing))
    rate = speed.dropout_elements_per_s or speed.bandwidth_bytes_per_s / DROPOUT_BYTES_PER_ELEMENT
    return elements / rate


def saved_bytes_per_token(shape: ModelShape, s: Settings) -> float:
    """Bytes one token's activations leave saved for backward in all layers (the memory model's terms)."""
    return sum(b for _, b in layer_activation_terms(shape, s)) * shape.num_layers


def memory_bytes(shape: ModelShape, s: Settings) -> dict[str, float]:
    """Bytes the memory-bound work of one micro-batch moves, by part."""
    T = rows_per_micro_batch(s) * s.seq_len
    saved = saved_bytes_per_token(shape, s) * T
    passes = TRAFFIC_PER_SAVED_BYTE + (FORWARD_TRAFFIC if s.gradient_checkpointing else 0)
    c = DTYPE_BYTES.get(s.compute_dtype, 4)
    labelled = T * s.label_fraction
    return {
        "activations": saved * passes,
        # the logits of each chunk in the compute dtype, written by the head and read by the loss's
        # fp32 cast (the cross-entropy itself: :func:`loss_seconds`), and their gradient likewise
        "logits": 4 * c * labelled * shape.vocab_size if c != 4 else 0.0,
        "reference pass": saved * FORWARD_TRAFFIC if has_reference_pass(s) else 0.0,
        # linear attention's element-wise work, forward and backward (counted once: a recompute's
        # forward share and a reference pass are not added), less its zero-fills of fresh memory (step_time's
        # "fresh memory" part)
        "scans": scan_bytes(shape, rows_per_micro_batch(s), s.seq_len, c)
                 - scan_fill_bytes(shape, rows_per_micro_batch(s), s.seq_len),
    }


def dequant_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed) -> float:
    """The quantized base's dequantization: every decoder weight at each forward, recompute,
    input gradient and reference pass."""
    if s.method != "qlora":
        return 0.0
    passes = 2 + (1 if s.gradient_checkpointing else 0) + (1 if has_reference_pass(s) else 0)
    slow = INT8_SLOWDOWN if s.quant_bits == 8 else 1.0
    return passes * quantized_numel(shape, s) * slow / speed.dequant_weights_per_s


def layer_op_count(shape: ModelShape, s: Settings) -> float:
    """Tensor operations one decoder layer's forward launches: ``OPS_PER_LAYER``, its LoRA targets'
    and a quantized base's per linear."""
    n_lora = 0
    if s.method != "full":
        targets = list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets
        n_lora = sum(copies for *_, copies in lora_targets(shape, targets)) / max(1, shape.num_layers)
    return OPS_PER_LAYER + OPS_PER_LORA_TARGET * n_lora + (OPS_PER_QUANT_LINEAR * shape.linears_per_layer if s.method == "qlora" else 0)


def forward_op_count(shape: ModelShape, s: Settings) -> float:
    """Tensor operations one micro-batch's forward launches: the layers', the model's own
    (``OPS_PER_MODEL``), the loss's chunks and the scans' loops (:func:`finetuner.planning.scans.scan_ops`)."""
    labelled = rows_per_micro_batch(s) * s.seq_len * s.label_fraction
    chunks = math.ceil(labelled / s.loss_chunk) if s.loss_chunk > 0 else 1
    return layer_op_count(shape, s) * shape.num_layers + scan_ops(shape, s.seq_len) + OPS_PER_MODEL + OPS_PER_LOSS_CHUNK * chunks


def op_count(shape: ModelShape, s: Settings) -> float:
    """Tensor operations one micro-batch launches (forward, backward, recompute, reference pass)."""
    per_layer = layer_op_count(shape, s)
    fwd = forward_op_count(shape, s)
    total = fwd * (1 + BACKWARD_OPS)
    if s.gradient_checkpointing:
        total += per_layer * shape.num_layers + scan_ops(shape, s.seq_len)
    if has_reference_pass(s):
        total += fwd
    return total


def op_seconds(speed: DeviceSpeed, elements: float) -> float:
    """Seconds one eager tensor operation over ``elements`` elements costs beyond its work: the
    calibration's bare operation times ``EAGER_OP_FACTOR``, plus :attr:`DeviceSpeed.parallel_op_s` when
    it is large enough to spread over the threads (``PARALLEL_GRAIN``)."""
    return speed.op_overhead_s * EAGER_OP_FACTOR + (speed.parallel_op_s if elements >= PARALLEL_GRAIN else 0.0)


def forward_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed) -> float:
    """Seconds of one micro-batch's forward without gradients (an evaluation's micro-batch; a decode
    step is one with ``seq_len`` 1): the forward's share of each term :func:`step_time` sums, at the same
    rates. The matmuls' forward FLOPs (:func:`forward_flops`: decoder, LoRA, attention as matmuls only
    when eager, the LM head over the labelled tokens) once; attention's kernel one of the 3 units of
    :func:`attention_seconds` (forward, backward 2x); the cross-entropy's forward, half of its calibrated
    forward + backward (as :func:`loss_seconds` counts a recompute); the saved tensors' forward traffic
    (``FORWARD_TRAFFIC`` of the ``TRAFFIC_PER_SAVED_BYTE`` a step moves); a quantized base dequantized
    once; the forward's operations (:func:`forward_op_count`) at :func:`op_seconds` of its ``T x hidden`` elements. No dropout (the
    model is in eval mode), no optimizer, no step's fixed cost. On a GPU the device's work is divided by
    :meth:`DeviceSpeed.utilisation` and only the host's excess of operations counts, as in a step."""
    f, w = forward_flops(shape, s), typical_width(shape)
    w["lora"] = max(1, s.lora_r)
    dtype = s.compute_dtype if s.compute_dtype in DTYPE_BYTES else "fp32"
    T = rows_per_micro_batch(s) * s.seq_len
    eff = matmul_row_efficiency(speed, T)
    matmuls = sum(f[k] / speed.matmul_rate(dtype, w[k]) for k in f if f[k] and k != "attention") / eff
    plain = s.with_(gradient_checkpointing=False, reference="none")
    attention = attention_seconds(shape, plain, speed) / 3
    labelled = T * s.label_fraction
    table = speed.cross_entropy_elements_per_s
    ce_rate = interpolate(table, shape.vocab_size) if table else speed.bandwidth_bytes_per_s / CE_BYTES_PER_ELEMENT
    loss = 0.5 * labelled * shape.vocab_size / ce_rate
    traffic = saved_bytes_per_token(shape, s) * T * FORWARD_TRAFFIC / speed.bandwidth_bytes_per_s
    dequant = dequant_seconds(shape, plain, speed) / 2  # dequant_seconds counts forward + input gradient
    device = (matmuls + attention + loss + traffic + dequant) / speed.utilisation(T)
    ops = forward_op_count(shape, s) * op_seconds(speed, T * shape.hidden_size)
    if speed.platform == CUDA:
        return device + max(0.0, ops - device)
    return device + ops


def optimizer_bytes(shape: ModelShape, s: Settings) -> float:
    """Bytes the optimizer update moves: AdamW reads weight, gradient and both states and writes
    weight and states (fp32: 4 + 4 + 8 read, 4 + 8 written, 28 bytes a parameter); the 8-bit
    states move 2 bytes each way instead of 8; SGD reads weight and gradient and writes the weight."""
    n = trainable_params(shape, s)
    per = {"adamw_torch": 28, "paged_adamw_32bit": 28, "adamw_8bit": 16, "paged_adamw_8bit": 16, "adafactor": 16, "sgd": 12}
    return n * per.get(s.optimizer, 28)


def step_time(shape: ModelShape, s: Settings, speed: DeviceSpeed, est: MemoryEstimate | None = None,
              sharded: Any = None, batch: BatchShape | None = None) -> StepTime:
    """The predicted time of one optimizer step on ``speed``'s device (see the module doc).

    ``est``: the memory estimate (for the bytes activation offload moves); ``sharded``: a
    :class:`~finetuner.memory.sharding.ShardedEstimate` with several devices (each runs its share of
    the micro-batches; the collectives are added); ``batch``: the data's average micro-batch
    (:func:`finetuner.planning.lengths.batch_shape`): each micro-batch is timed at its padded length
    instead of ``seq_len``, and only its real tokens count (the labelled share of them, ``label_fraction``,
    is of real tokens). Without it every row is ``seq_len`` long."""
    real_per_row = float(s.seq_len)
    if batch is not None:
        padded = max(1, min(s.seq_len, round(batch.padded_len)))
        real_per_row = min(batch.real_per_row, padded)
        s = s.with_(seq_len=padded, label_fraction=s.label_fraction * real_per_row / padded)
    ga = s.gradient_accumulation
    n_dev = sharded.world_size if sharded is not None and sharded.world_size > 1 else 1
    micro = math.ceil(ga / n_dev)
    mem = memory_bytes(shape, s)
    parts = {
        "matmuls": micro * matmul_seconds(shape, s, speed),
        "attention": micro * attention_seconds(shape, s, speed),
        "loss": micro * loss_seconds(shape, s, speed),
        "dropout": micro * dropout_seconds(shape, s, speed),
        "memory-bound": micro * sum(mem.values()) / speed.bandwidth_bytes_per_s,
        "fresh memory": micro * scan_fill_bytes(shape, rows_per_micro_batch(s), s.seq_len)
                        / (speed.fresh_bytes_per_s or speed.bandwidth_bytes_per_s),
        "dequantization": micro * dequant_seconds(shape, s, speed),
        "operations": micro * op_count(shape, s) * op_seconds(speed, rows_per_micro_batch(s) * s.seq_len * shape.hidden_size),
        "optimizer": optimizer_bytes(shape, s) / n_dev / speed.bandwidth_bytes_per_s,
        "fixed": STEP_FIXED_OPS * speed.op_overhead_s * EAGER_OP_FACTOR,
    }
    util = speed.utilisation(rows_per_micro_batch(s) * s.seq_len)
    for k in ("matmuls", "attention", "loss", "dropout", "memory-bound", "fresh memory", "dequantization"):
        parts[k] /= util
    if speed.platform == CUDA:
        # the host queues kernels while the device runs earlier ones: only the host's excess shows
        device = sum(v for k, v in parts.items() if k not in ("operations", "fixed"))
        parts["operations"] = max(0.0, parts["operations"] - device)
    if s.activation_offload and est is not None:
        parts["offload"] = micro * 2 * est.offloaded_bytes / speed.host_link_bytes_per_s * (1 - OFFLOAD_OVERLAP)
    if n_dev > 1:
        parts["communication"] = (sharded.comm_bytes_per_step / speed.peer_link_bytes_per_s
                                  + sharded.host_transfer_bytes_per_step / speed.host_link_bytes_per_s)
    padded_tokens = rows_per_micro_batch(s) * s.seq_len * ga
    tokens = round(rows_per_micro_batch(s) * real_per_row * ga)
    return StepTime(parts, tokens, ga, speed.source, padded_tokens_per_step=padded_tokens, data_lengths=batch is not None)

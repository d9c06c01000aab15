"""FSDP2 per device: the terms of ``distributed.strategy: fsdp`` on N devices.

finetuner's fsdp is torch's FSDP2 (``torch.distributed.fsdp.fully_shard``, the trainer's
``finetuner.training.strategies.fsdp``): each decoder layer is one unit, the step's loss module
the root unit (embeddings, final norm, LM head), parameters are ``DTensor`` shards (dim 0, ``1/N``
each) under a ``MixedPrecisionPolicy`` (all-gather in the compute dtype, gradients reduced in
fp32), ``reshard_after_forward=True``, and optionally ``CPUOffloadPolicy``
(``distributed.fsdp_offload``). What one device holds, term by term (each a function below):

- **sharded model states** (:func:`sharded_bytes`): ``ceil(b / N)`` of every parameter, gradient
  and optimizer state of the single-device estimate. For QLoRA the quantized weights are stored
  with ``bnb_4bit_quant_storage`` = the compute dtype, so their packed 4-bit bytes are an ordinary
  floating-point parameter that FSDP shards like any other: ``ceil(numel / 2) / N`` bytes;
- **the quantization state** (:func:`quant_state_bytes`): absmax, nested absmax and code tables
  are not parameters. bitsandbytes keeps them on the ``Linear4bit``
  module and puts them back on the gathered weight (``fix_4bit_weight_quant_state_from_module``,
  "the quant state got lost when the parameter got converted. This happens for example for
  fsdp"), so every device holds all of it, unsharded;
- **the gathered units** (:func:`gathered_bytes`): a unit's parameters exist in full while it
  computes. FSDP2 prefetches the next layer while one runs (forward: the next, backward: the
  previous), so two layers are gathered at once; the root unit is gathered through the whole
  forward (the embeddings open it, the LM head closes it) and again through the whole backward
  (the LM head opens it, its post-backward runs last), so beside every layer. A layer is
  gathered at the all-gather dtype: the frozen base in its storage dtype (QLoRA: the packed 4-bit bytes, the
  layer is dequantized one linear at a time at compute, which the single-device estimate's
  dequantization buffer already counts), the trainable parameters in the compute dtype;
- **the reduce-scatter buffers** (:func:`reduce_scatter_bytes`): a unit's backward produces its
  gradients in full; FSDP2 copies them into a reduce-scatter input in the reduce dtype (fp32)
  and keeps ``1/N``. One reduce-scatter runs while the next unit's backward computes: two
  layers' gradients in fp32 (the root's alone, at the end of the backward);
- **CPU offload** (``CPUOffloadPolicy``): the sharded parameters, gradients and optimizer
  states (and so the optimizer step) live in CPU memory, per process
  (``ShardedEstimate.host_bytes`` in :mod:`finetuner.memory.sharding`); the device keeps the gathered units, the reduce-scatter
  buffers, the quantization state and the activations. Each all-gather first copies its shard
  to the device, and each reduce-scatter's output goes back: :func:`host_transfer_bytes`;
- **communication** (:func:`comm_bytes`): in every micro-batch each layer is all-gathered for
  the forward and again for the backward (the recompute of gradient checkpointing runs inside
  the unit's backward, under the same gather), the root once, and the trainable gradients are
  reduce-scattered: a ring moves ``(N-1)/N`` of each buffer per device.

8-bit QLoRA is counted the same way (int8 data sharded, row scales whole), but whether it runs
under fsdp is the recipe's to say (:func:`finetuner.planning.search.schema_error`): the planner
offers only what the recipe accepts.

- **loading** (:func:`largest_tensor_bytes`, :func:`loading_host_bytes`): the model is loaded
  once (:mod:`finetuner.training.strategies.rank0_loading`): rank 0 reads it into CPU memory
  (QLoRA: quantized there), the other ranks build it empty, and each tensor is scattered in turn
  into the ranks' shards. A device then holds its shards (none under CPU offload) and, while one
  tensor passes, that tensor whole: less than training's gathered root unit, so not the device's
  peak (``finetuner.memory.sharding`` checks it). The machine's CPU
  memory holds rank 0's copy of the whole model (the single-device weights) beside what the
  processes themselves need.

Activations are per micro-batch, so the same on every device (the single-device estimate's),
less the autocast copies of the trainable weights: the policy gathers them in the compute dtype
already, so autocast casts nothing (:func:`autocast_copies_bytes`).
What FSDP2's own bookkeeping, the NCCL buffers and the allocator's fragmentation from the
all-gathers add is not modelled beyond the allocator slack the single-device model adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetuner.memory.settings import DTYPE_BYTES, Settings
from finetuner.memory.storage import quantized_weight_parts, trainable_params
from finetuner.model.shapes import ModelShape

#: layers gathered at once: the one computing and the one prefetched (FSDP2's implicit prefetch)
PREFETCH_UNITS = 2
#: bytes per gradient element in the reduce-scatter (MixedPrecisionPolicy ``reduce_dtype=float32``)
REDUCE_BYTES = 4


@dataclass(frozen=True)
class Units:
    """Parameters of FSDP's units, counted from the model's shape."""

    layer_params: int  # one decoder layer: its linears (with biases) and norms
    root_params: int  # embeddings, final norm and LM head (when not tied)
    layer_trainable: int  # trainable parameters of one decoder layer (LoRA: its adapters)
    root_trainable: int  # trainable parameters of the root (full fine-tuning only)


def units(shape: ModelShape, s: Settings) -> Units:
    """The unit sizes of ``shape`` with each decoder layer ``fully_shard``-ed and the model as the root."""
    c = shape.param_counts()
    layer = (c["attention"] + c["mlp"] + c["norms"] - shape.hidden_size) // shape.num_layers
    root = c["embeddings"] + c["lm_head"] + shape.hidden_size
    if s.method == "full":
        return Units(layer, root, layer, root)
    # LoRA's adapters sit on the decoder layers' linears
    return Units(layer, root, trainable_params(shape, s) // shape.num_layers, 0)


def layer_unit_bytes(shape: ModelShape, s: Settings) -> int:
    """Bytes of one decoder layer once all-gathered.

    ``full``: every parameter in the compute dtype (``MixedPrecisionPolicy(param_dtype)``);
    ``lora``: the frozen base in ``weight_dtype`` plus the adapters in the compute dtype;
    ``qlora``: the layer's share of the quantized data (packed 4-bit or int8 bytes, as stored), its
    norms and biases in ``weight_dtype``, the adapters in the compute dtype.
    """
    u = units(shape, s)
    c, w = DTYPE_BYTES[s.compute_dtype], DTYPE_BYTES[s.weight_dtype]
    if s.method == "full":
        return c * u.layer_params
    if s.method == "lora":
        return w * u.layer_params + c * u.layer_trainable
    data, _ = quantized_weight_parts(shape, s)
    linear_per_layer = shape.linear_weight_numel // shape.num_layers
    return data // shape.num_layers + w * (u.layer_params - linear_per_layer) + c * u.layer_trainable


def root_unit_bytes(shape: ModelShape, s: Settings) -> int:
    """Bytes of the root unit gathered (embeddings, final norm, LM head): compute dtype for full
    fine-tuning, else ``weight_dtype`` (never quantized)."""
    u = units(shape, s)
    return DTYPE_BYTES[s.compute_dtype if s.method == "full" else s.weight_dtype] * u.root_params


def gathered_bytes(shape: ModelShape, s: Settings) -> int:
    """What the all-gathers hold at once: the root unit plus ``PREFETCH_UNITS`` layers."""
    return root_unit_bytes(shape, s) + PREFETCH_UNITS * layer_unit_bytes(shape, s)


def reduce_scatter_bytes(shape: ModelShape, s: Settings) -> int:
    """Unsharded gradients waiting for or in a reduce-scatter, in fp32: ``PREFETCH_UNITS`` layers'
    (one reduced while the next computes), or the root's alone at the end of the backward."""
    u = units(shape, s)
    return REDUCE_BYTES * max(PREFETCH_UNITS * u.layer_trainable, u.root_trainable)


def quant_state_bytes(shape: ModelShape, s: Settings) -> int:
    """The QLoRA quantization state every device holds whole (0 without quantization)."""
    return quantized_weight_parts(shape, s)[1] if s.method == "qlora" else 0


def autocast_copies_bytes(n: int, single_device_copies: int) -> int:
    """The autocast copies of trainable weights under fsdp on ``n`` devices: none with several
    (the mixed-precision policy all-gathers them in the compute dtype), else the single device's."""
    return single_device_copies if n == 1 else 0


def largest_tensor_bytes(shape: ModelShape, s: Settings) -> int:
    """The largest single tensor scattered while loading: the embeddings (or the LM head), kept in
    ``weight_dtype``, or a decoder layer's largest linear at its stored size, whichever is more."""
    w = DTYPE_BYTES[s.weight_dtype]
    linear = max(shape.hidden_size * shape.intermediate_size, shape.hidden_size * shape.num_heads * shape.head_dim)
    if s.method == "qlora":
        data, _ = quantized_weight_parts(shape, s)
        linear = math.ceil(linear * data / max(shape.linear_weight_numel, 1))
    else:
        linear *= w
    return max(w * shape.vocab_size * shape.hidden_size, linear)


def loading_host_bytes(weight_bytes: int) -> int:
    """The CPU memory rank 0's copy of the model takes while it loads: every weight of the
    single-device estimate (``weight_bytes``: the frozen base, quantized or not, its quantization
    state, the adapters)."""
    return weight_bytes


def sharded_bytes(b: int, n: int) -> int:
    """One device's shard of ``b`` bytes over ``n`` devices (dim-0 shards, the last may be short)."""
    return math.ceil(b / n)


def micro_batches_per_device(s: Settings, n: int) -> int:
    """Micro-batches each device runs per optimizer step: the accumulation is split over the devices."""
    return max(1, math.ceil(s.gradient_accumulation / n))


def comm_bytes(shape: ModelShape, s: Settings, n: int, gradient_bytes: int) -> int:
    """Bytes each device sends per optimizer step:
    ``m (N-1)/N x (2 x layers x layer unit + root unit + gradients)`` (``gradient_bytes``: the
    trainable gradients in fp32, the single-device estimate's ``gradients``)."""
    m = micro_batches_per_device(s, n)
    gathered = 2 * shape.num_layers * layer_unit_bytes(shape, s) + root_unit_bytes(shape, s)
    return int(m * (n - 1) / n * (gathered + gradient_bytes))


def host_transfer_bytes(shape: ModelShape, s: Settings, n: int, gradient_bytes: int) -> int:
    """With CPU offload, bytes copied between CPU and device per step on each device: every
    all-gather's shard to the device, every micro-batch's gradient shard back:
    ``m x (2 x layers x layer unit + root unit + gradients) / N``."""
    m = micro_batches_per_device(s, n)
    gathered = 2 * shape.num_layers * layer_unit_bytes(shape, s) + root_unit_bytes(shape, s)
    return m * (sharded_bytes(gathered, n) + sharded_bytes(gradient_bytes, n))


@dataclass(frozen=True)
class FsdpTerms:
    """The FSDP2-only terms of one device (the sharded states are the estimate's, divided)."""

    world_size: int
    cpu_offload: bool
    quant_state: int
    gathered: int
    reduce_scatter: int
    comm_bytes_per_step: int
    host_transfer_bytes_per_step: int


def fsdp_terms(shape: ModelShape, s: Settings, n: int, gradient_bytes: int, cpu_offload: bool) -> FsdpTerms:
    """The terms above for ``n`` devices (``gradient_bytes``: the estimate's ``gradients``)."""
    return FsdpTerms(
        world_size=n,
        cpu_offload=cpu_offload,
        quant_state=quant_state_bytes(shape, s),
        gathered=gathered_bytes(shape, s) if n > 1 else 0,
        reduce_scatter=reduce_scatter_bytes(shape, s) if n > 1 else 0,
        comm_bytes_per_step=comm_bytes(shape, s, n, gradient_bytes),
        host_transfer_bytes_per_step=host_transfer_bytes(shape, s, n, gradient_bytes) if cpu_offload else 0,
    )

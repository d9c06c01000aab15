"""Per-device memory and communication of a run split over N devices (DDP, ZeRO 1-3, FSDP, offload).

Input: the single-device :class:`~finetuner.memory.model.MemoryEstimate` (its ``components``). Each
component belongs to one kind, and each strategy divides some kinds by the number of devices N
(the ZeRO paper, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", Sec. 5, Fig. 1: model-state memory per device is ``(2+2+K)Ψ`` for DP,
``2Ψ+2Ψ+KΨ/N`` for P_os, ``2Ψ+(2+K)Ψ/N`` for P_os+g and ``(2+2+K)Ψ/N`` for P_os+g+p):

=============  ==============================================================================
kind           components
=============  ==============================================================================
parameters     ``weights: …`` (frozen or trained) and ``LoRA weights (fp32)``
gradients      ``gradients``
optimizer      ``optimizer states (…)`` and ``optimizer step temporaries``
activations    activations, logits, autocast copies, dequantization buffer: per micro-batch,
               so the same on every device
runtime        cuBLAS workspace and the CUDA context (per device); allocator slack is recomputed
=============  ==============================================================================

- ``ddp``: everything replicated, plus torch DDP's gradient buckets (one more copy of the
  gradients unless ``gradient_as_bucket_view``; torch ``DistributedDataParallel`` docs).
- ``zero1`` shards optimizer states, ``zero2`` also gradients, ``zero3`` also parameters; ZeRO-3
  holds the parameters of the layer being computed and of the one prefetched in full
  (``gathered parameters``).
- ``fsdp`` is FSDP2 (``fully_shard``, Zhao et al. 2023, "PyTorch FSDP", Sec. 3, FULL_SHARD): the
  same three kinds sharded, plus its own terms, each in :mod:`finetuner.memory.fsdp` (the
  quantization state of a QLoRA base whole on every device, the gathered root unit and two
  layers, the reduce-scatter buffers). QLoRA runs under fsdp (the 4-bit data are an ordinary
  parameter with ``bnb_4bit_quant_storage`` = the compute dtype), not under zero3.
- ``offload="optimizer"`` (ZeRO-Offload, Ren et al. 2021, "ZeRO-Offload: Democratizing
  Billion-Scale Model Training", Sec. 4.1): the fp32 optimizer states, the optimizer step and the
  gradient partitions live in CPU memory (``host_bytes``); ``"optimizer+params"`` (ZeRO-Infinity's
  CPU parameter offload, zero3 only) also moves the parameter partitions there. DeepSpeed's
  communication buckets (``reduce_bucket_size``, ``allgather_bucket_size``) are not modelled.
  FSDP2's ``CPUOffloadPolicy`` moves parameters, gradients and optimizer states together: fsdp
  takes ``"optimizer+params"`` or nothing.

Communication per optimizer step, bytes each device sends (a ring collective over N devices
moves ``(N-1)/N`` of the buffer per device for a reduce-scatter or an all-gather, twice that
for an all-reduce: Patarasuk & Yuan 2009; ZeRO paper Sec. 7, where DP costs ``2Ψ`` and ZeRO-3
``3Ψ``, 1.5x):

- ``ddp``, ``zero1``: one all-reduce of the gradients per step (accumulation runs without
  synchronising): ``2 (N-1)/N · G``;
- ``zero2``: a reduce-scatter of the gradients in every micro-batch (only the partition is
  kept) and one all-gather of the updated trainable parameters: ``m (N-1)/N · G + (N-1)/N · P_t``;
- ``zero3``: every micro-batch all-gathers all parameters for forward and again for
  backward and reduce-scatters the gradients: ``m (N-1)/N · (2 W + G)``;
- ``fsdp``: the same at the all-gather dtype, the root unit gathered once
  (:func:`finetuner.memory.fsdp.comm_bytes`);

with ``G`` the gradient bytes, ``W`` all parameter bytes, ``P_t`` the trainable parameter bytes
and ``m`` the micro-batches per device per step (``ceil(gradient_accumulation / N)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from finetuner.errors import UserError
from finetuner.model.shapes import ModelShape
from finetuner.strategy_table import TABLE
from finetuner.units import gib_text

#: every strategy (:mod:`finetuner.strategy_table`), simplest first (ddp, ZeRO by stage, FSDP): the tie-break
STRATEGIES = tuple(r.name for r in sorted(TABLE, key=lambda r: r.simplicity))
OFFLOADS = ("none", "optimizer", "optimizer+params")
#: what each strategy can move to CPU memory: ZeRO-Offload the optimizer (zero1-3) and the
#: parameters (zero3); FSDP2's CPUOffloadPolicy parameters, gradients and optimizer states at once
STRATEGY_OFFLOADS: dict[str, tuple[str, ...]] = {r.name: r.offloads for r in TABLE}

#: the kinds of state each strategy divides by the number of devices
SHARDED_KINDS: dict[str, frozenset[str]] = {r.name: r.shards for r in TABLE}

#: CPU memory of one training process before any model state: torch, transformers, peft,
#: bitsandbytes, accelerate and finetuner's trainer imported. Measured on the CPU development
#: machine (resident set 0.39 GiB, torch 2.13); the host side of the CUDA libraries is not in it
#: (not measured: no GPU was lent for this).
PROCESS_HOST_BYTES = 400 * 2**20


#: DeepSpeed cannot shard the state of bitsandbytes or factored optimizers (the recipe refuses them);
#: under FSDP2 the parameters are DTensor shards, which torch's optimizers step and bitsandbytes'
#: kernels (plain storage pointers) and a factored optimizer (row/column means of a shard) do not
SHARDED_OPTIMIZERS = ("adamw_torch", "sgd")


def component_kind(name: str) -> str:
    """parameters | gradients | optimizer | runtime | slack | activations, from a component's name."""
    if name.startswith("weights:") or name.startswith("LoRA weights"):
        return "parameters"
    if name == "gradients":
        return "gradients"
    if name.startswith("optimizer states") or name == "optimizer step temporaries":
        return "optimizer"
    if name in ("cuBLAS workspace", "CUDA context"):
        return "runtime"
    if name == "allocator slack":
        return "slack"
    return "activations"


@dataclass
class ShardedEstimate:
    """Memory per device and communication per step of one strategy on ``world_size`` devices."""

    strategy: str
    world_size: int
    offload: str
    components: dict[str, int]  # per device, sums to per_device_bytes
    per_device_bytes: int
    host_bytes: int  # CPU memory used by offload, per process
    comm_bytes_per_step: int  # bytes each device sends per optimizer step
    comm_formula: str
    single_device_bytes: int
    budget_bytes: int | None = None
    spillable_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    #: bytes copied between CPU memory and each device per step (offload: PCIe)
    host_transfer_bytes_per_step: int = 0
    #: activation offload: the layer inputs one process keeps in CPU memory (the estimate's offloaded_bytes)
    activation_host_bytes: int = 0
    #: the CPU memory of the machine running the processes (None: not checked)
    machine_host_bytes: int | None = None
    #: what training alone needs per device, when loading the model needs more (``per_device_bytes``
    #: is then the loading peak); None when training is the peak
    training_bytes: int | None = None
    #: the machine's CPU memory taken by rank 0's copy of the whole model while it loads (fsdp,
    #: :func:`finetuner.memory.fsdp.loading_host_bytes`); 0 where each process loads onto its device
    loading_host_bytes: int = 0

    @property
    def host_bytes_per_process(self) -> int:
        """CPU memory one process needs: its offloaded model states (``host_bytes``), its
        offloaded activations and the process itself (``PROCESS_HOST_BYTES``)."""
        return self.host_bytes + self.activation_host_bytes + PROCESS_HOST_BYTES

    @property
    def loading_host_bytes_per_machine(self) -> int:
        """CPU memory the machine needs while the model loads: rank 0's copy of the model and the
        processes themselves (offloaded shards are allocated module by module as rank 0's copy
        empties: together they stay about one copy)."""
        if not self.loading_host_bytes:
            return 0
        return self.loading_host_bytes + self.world_size * PROCESS_HOST_BYTES

    @property
    def host_bytes_per_machine(self) -> int:
        """CPU memory the machine needs: every process's (one machine runs all ``world_size``), or
        more while the model loads (:attr:`loading_host_bytes_per_machine`)."""
        return max(self.world_size * self.host_bytes_per_process, self.loading_host_bytes_per_machine)

    @property
    def device_fits(self) -> bool:
        return self.budget_bytes is None or self.per_device_bytes - self.spillable_bytes <= self.budget_bytes

    @property
    def host_fits(self) -> bool:
        return self.machine_host_bytes is None or self.host_bytes_per_machine <= self.machine_host_bytes

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    def host_summary(self) -> str:
        """What the machine's CPU memory holds, in words (for a plan and its refusal)."""
        parts = []
        if self.host_bytes:
            what = ("parameters, gradients and optimizer states" if self.offload == "optimizer+params"
                    else "optimizer states and gradients")
            parts.append(f"{gib_text(self.host_bytes, 1)} offloaded {what}")
        if self.activation_host_bytes:
            parts.append(f"{gib_text(self.activation_host_bytes, 1)} offloaded activations")
        parts.append(f"{gib_text(PROCESS_HOST_BYTES, 1)} for the process itself")
        procs = f"{self.world_size} process{'es' if self.world_size != 1 else ''}"
        training = (f"{procs} x {gib_text(self.host_bytes_per_process, 1)} ({', '.join(parts)})")
        if self.loading_host_bytes_per_machine > self.world_size * self.host_bytes_per_process:
            return (f"{gib_text(self.host_bytes_per_machine, 1)} for the machine while the model loads (rank 0's copy "
                    f"of the whole model, {gib_text(self.loading_host_bytes, 1)}, and {procs}); training then needs {training}")
        return f"{gib_text(self.host_bytes_per_machine, 1)} for the machine: {training}"

    @property
    def label(self) -> str:
        if self.offload == "none":
            return self.strategy
        return f"{self.strategy} + CPU offload" if self.strategy == "fsdp" else f"{self.strategy} + {self.offload} offload"

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "label": self.label,
            "world_size": self.world_size,
            "offload": self.offload,
            "per_device_bytes": self.per_device_bytes,
            "training_bytes": self.training_bytes,
            "loading_host_bytes": self.loading_host_bytes,
            "host_bytes": self.host_bytes,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "comm_formula": self.comm_formula,
            "host_transfer_bytes_per_step": self.host_transfer_bytes_per_step,
            "single_device_bytes": self.single_device_bytes,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "device_fits": self.device_fits,
            "host_fits": self.host_fits,
            "host_bytes_per_process": self.host_bytes_per_process,
            "host_bytes_per_machine": self.host_bytes_per_machine,
            "activation_host_bytes": self.activation_host_bytes,
            "machine_host_bytes": self.machine_host_bytes,
            "components": dict(self.components),
            "notes": list(self.notes),
        }


def recipe_offload(distributed) -> str:
    """The offload of a recipe's ``distributed`` section in this module's terms: ZeRO's
    ``distributed.offload``, or for fsdp ``"optimizer+params"`` when ``distributed.fsdp_offload``
    (FSDP2's CPUOffloadPolicy) is on."""
    if distributed.strategy == "fsdp":
        return "optimizer+params" if getattr(distributed, "fsdp_offload", False) else "none"
    return distributed.offload


def distributed_keys(strategy: str, offload: str) -> dict[str, object]:
    """The ``distributed`` keys of a recipe that runs ``strategy`` with ``offload`` (the inverse of
    :func:`recipe_offload`)."""
    if strategy == "fsdp":
        return {"strategy": strategy, "offload": "none", **({"fsdp_offload": True} if offload != "none" else {})}
    return {"strategy": strategy, "offload": offload}


def _layer_params(estimate, shape: ModelShape) -> tuple[int, int]:
    """(parameters of one decoder layer, of the embedding or LM head): the largest units gathered at once."""
    counts = estimate.details.get("parameters", {}) if estimate.details else {}
    layers = counts.get("attention", 0) + counts.get("mlp", 0) + counts.get("norms", 0)
    unit = max(counts.get("embeddings", 0), counts.get("lm_head", 0))
    return (layers // max(shape.num_layers, 1), unit)


def _check_offload(strategy: str, offload: str) -> None:
    if offload in STRATEGY_OFFLOADS[strategy]:
        return
    if strategy == "fsdp":
        raise UserError(f"offload '{offload}' with fsdp: FSDP2's CPUOffloadPolicy moves parameters, gradients and "
                        "optimizer states together; use offload 'optimizer+params' (or none).")
    if strategy == "ddp":
        raise UserError(f"offload '{offload}' needs a DeepSpeed ZeRO strategy (zero1-3) or fsdp, not ddp.")
    raise UserError("parameter offload needs zero3 (or fsdp).")


def shard_estimate(estimate, strategy: str, world_size: int, offload: str = "none",
                   shape: ModelShape | None = None, machine_host_bytes: int | None = None) -> ShardedEstimate:
    """Per-device memory and communication of ``strategy`` on ``world_size`` devices (see the module doc).

    ``shape``: the model's; by default the estimate's own (``estimate.shape``), else resolved from
    ``estimate.model``.
    ``machine_host_bytes``: the CPU memory of the machine that runs the ``world_size`` processes
    (None: not checked).
    """
    from finetuner.memory.fsdp import autocast_copies_bytes, fsdp_terms, loading_host_bytes
    from finetuner.memory.model import ALLOCATOR_FIXED_BYTES, ALLOCATOR_FRACTION
    from finetuner.model.shapes import resolve_shape

    if strategy not in STRATEGIES:
        raise UserError(f"Unknown strategy '{strategy}'; one of {', '.join(STRATEGIES)}.")
    if offload not in OFFLOADS:
        raise UserError(f"Unknown offload '{offload}'; one of {', '.join(OFFLOADS)}.")
    if world_size < 1:
        raise UserError("world_size must be at least 1.")
    _check_offload(strategy, offload)
    shape = shape or getattr(estimate, "shape", None) or resolve_shape(estimate.model)
    n = world_size
    sharded = SHARDED_KINDS[strategy]
    comps = estimate.components
    s = estimate.settings
    host_kinds = {"none": set(), "optimizer": {"optimizer", "gradients"}, "optimizer+params": {"optimizer", "gradients", "parameters"}}[offload]
    # model states (present in both phases of a step) are taken from the components; what else
    # each phase holds comes from the estimate's phase totals
    state_names = [k for k in comps if component_kind(k) in ("parameters", "gradients", "optimizer") and k != "optimizer step temporaries"]
    model_states = sum(comps[k] for k in state_names)
    grads = comps.get("gradients", 0)
    weights = sum(comps[k] for k in state_names if component_kind(k) == "parameters")
    trainable_bytes = comps.get("LoRA weights (fp32)", 0) if s.method != "full" else weights
    fb_extra = estimate.phases.get("forward/backward", 0) - model_states
    step_temp = estimate.details.get("optimizer_step_temp_bytes", comps.get("optimizer step temporaries", 0))
    fsdp = fsdp_terms(shape, s, n, grads, offload != "none") if strategy == "fsdp" else None

    def place(kind: str, b: int) -> tuple[int, bool]:  # (bytes per device or per process, on the host?)
        share = math.ceil(b / n) if kind in sharded else b
        return share, kind in host_kinds

    states: dict[str, int] = {}
    host = 0
    for name in state_names:
        b = comps[name]
        if fsdp is not None and fsdp.quant_state and name.startswith("weights:") and "(not quantized)" not in name:
            # the quantization state is an attribute of the layers, not a parameter: whole on every device
            states["quantization state (every device)"] = fsdp.quant_state
            b -= fsdp.quant_state
        share, on_host = place(component_kind(name), b)
        if on_host:
            host += share
        else:
            states[name + (f" (1/{n})" if component_kind(name) in sharded and n > 1 else "")] = share
    notes: list[str] = []
    if strategy == "ddp" and n > 1 and grads:
        states["DDP gradient buckets"] = grads
        notes.append("torch DDP copies gradients into communication buckets (gradient_as_bucket_view=False)")
    # phase 1: forward/backward (activations are per micro-batch: the same on every device)
    if estimate.peak_phase == "forward/backward":
        fb = {k: b for k, b in comps.items() if component_kind(k) == "activations"}
    else:
        fb = {"activations, logits and weight copies": fb_extra}
    if strategy == "zero3" and n > 1:
        layer, unit = _layer_params(estimate, shape)
        total_params = max(estimate.details.get("parameters", {}).get("total", 0), 1)
        fb["gathered parameters (layer + prefetch)"] = int(max(2 * layer, unit) * weights / total_params)
    if fsdp is not None and n > 1:
        copies = estimate.details.get("autocast_copies_bytes", 0)
        kept = autocast_copies_bytes(n, copies)
        if "autocast weight copies" in fb:
            fb["autocast weight copies"] = kept
            if not kept:
                del fb["autocast weight copies"]
        elif "activations, logits and weight copies" in fb:
            fb["activations, logits and weight copies"] -= copies - kept
        fb["gathered units (root + 2 layers)"] = fsdp.gathered
        if fsdp.reduce_scatter:
            fb["reduce-scatter buffers"] = fsdp.reduce_scatter
    # phase 2: the optimizer step (its temporaries follow the optimizer states)
    step_share, step_on_host = place("optimizer", step_temp)
    step = {} if step_on_host or not step_share else {"optimizer step temporaries" + (f" (1/{n})" if "optimizer" in sharded and n > 1 else ""): step_share}
    if step_on_host:
        host += step_share
    phase = fb if sum(fb.values()) >= sum(step.values()) else step
    out = {**states, **phase}
    for name in ("cuBLAS workspace",):
        if name in comps:
            out[name] = comps[name]
    paged = 0 if "optimizer" in host_kinds else estimate.spillable_bytes
    if "optimizer" in sharded:
        paged = math.ceil(paged / n)
    if "allocator slack" in comps:
        out["allocator slack"] = int((sum(out.values()) - paged) * ALLOCATOR_FRACTION) + ALLOCATOR_FIXED_BYTES
    if "CUDA context" in comps:
        out["CUDA context"] = comps["CUDA context"]
    per_device = sum(out.values())
    training_bytes = None
    loading = _loading_peak(strategy, n, shape, s, comps, weights, per_device, "parameters" in host_kinds)
    if loading is not None:
        notes.append(loading[1])
        training_bytes = per_device
        out, per_device = loading[0], sum(loading[0].values())
    loading_host = loading_host_bytes(weights) if fsdp is not None else 0

    m = max(1, math.ceil(s.gradient_accumulation / n))
    ring = (n - 1) / n
    if strategy in ("ddp", "zero1"):
        comm, formula = 2 * ring * grads, "2(N-1)/N x gradients (one all-reduce per step)"
    elif strategy == "zero2":
        comm = m * ring * grads + ring * trainable_bytes
        formula = "m(N-1)/N x gradients (reduce-scatter per micro-batch) + (N-1)/N x trainable parameters (all-gather)"
    elif fsdp is not None:
        comm = fsdp.comm_bytes_per_step
        formula = ("m(N-1)/N x (2 x layers x gathered layer + root unit + gradients) "
                   "(all-gather forward and backward, reduce-scatter)")
    else:
        comm = m * ring * (2 * weights + grads)
        formula = "m(N-1)/N x (2 x parameters + gradients) (all-gather forward and backward, reduce-scatter)"
    # ZeRO-Offload: the gradient partitions to the CPU and the updated parameters back, once a step
    transfer = 0 if offload == "none" else (fsdp.host_transfer_bytes_per_step if fsdp is not None else 2 * host)
    if offload != "none":
        notes.append(f"{gib_text(host)} per process in CPU memory; each step moves gradients to the CPU and parameters back (PCIe)")
    return ShardedEstimate(
        strategy=strategy,
        world_size=n,
        offload=offload,
        components=out,
        per_device_bytes=per_device,
        host_bytes=host,
        comm_bytes_per_step=int(comm),
        comm_formula=formula,
        single_device_bytes=estimate.total_bytes,
        budget_bytes=estimate.budget_bytes,
        spillable_bytes=paged,
        notes=notes,
        host_transfer_bytes_per_step=int(transfer),
        activation_host_bytes=estimate.offloaded_bytes,
        machine_host_bytes=machine_host_bytes,
        training_bytes=training_bytes,
        loading_host_bytes=loading_host,
    )


def _loading_peak(strategy: str, n: int, shape: ModelShape, s, comps: dict[str, int], weights: int,
                  training: int, params_offloaded: bool) -> tuple[dict[str, int], str] | None:
    """``(components, note)`` of one device while the model loads, when that is more than training
    needs (``training`` bytes), else None.

    zero3: every process loads the whole model (``weights``: the single-device weights) onto its
    device before DeepSpeed partitions it. fsdp: the model is loaded once and scattered into the
    shards: a device holds its shards of
    ``weights`` (none when ``params_offloaded``: their shards are in CPU memory) and one whole
    tensor (:func:`finetuner.memory.fsdp.largest_tensor_bytes`), which training's gathered root unit exceeds, so this is None for fsdp unless a model's
    single largest tensor outweighs everything else (checked, not assumed).
    """
    from finetuner.memory.fsdp import largest_tensor_bytes
    from finetuner.memory.model import ALLOCATOR_FIXED_BYTES, ALLOCATOR_FRACTION

    if strategy not in ("zero3", "fsdp") or n < 2:
        return None
    if strategy == "zero3":
        load = {"whole model while loading, before sharding": weights}
        why = (f"the peak is while loading: every process loads the whole model ({gib_text(weights, 1)}) onto its "
               "device before DeepSpeed partitions it")
    else:
        load = {f"weights (1/{n}) while loading": 0 if params_offloaded else math.ceil(weights / n),
                "one whole tensor passing while loading": largest_tensor_bytes(shape, s)}
        load = {k: v for k, v in load.items() if v}
        why = ("the peak is while loading: a device holds its shards of the weights and the largest tensor whole "
               "while rank 0 scatters it")
    if "allocator slack" in comps:
        load["allocator slack"] = int(sum(load.values()) * ALLOCATOR_FRACTION) + ALLOCATOR_FIXED_BYTES
    if "CUDA context" in comps:
        load["CUDA context"] = comps["CUDA context"]
    if sum(load.values()) <= training:
        return None
    return load, f"{why} (training would need {gib_text(training, 1)})"


def candidate_strategies(estimate) -> list[tuple[str, str]]:
    """(strategy, offload) pairs that can run this estimate's settings.

    ZeRO and FSDP need a torch optimizer (``SHARDED_OPTIMIZERS``); QLoRA's 4-bit base is sharded by
    fsdp (its data an ordinary parameter), never by zero3 (DeepSpeed would partition the packed
    bytes as bf16 values); offload runs an Adam optimizer on the CPU (not sgd).
    """
    s = estimate.settings
    out = []
    sharded_ok = s.optimizer in SHARDED_OPTIMIZERS
    for strat in STRATEGIES:  # ddp first: it shards nothing, so it runs every optimizer
        if SHARDED_KINDS[strat] and (not sharded_ok or (strat == "zero3" and s.method == "qlora")):
            continue
        out.append((strat, "none"))
    if sharded_ok and s.optimizer != "sgd":
        out.append(("zero2", "optimizer"))
        if s.method != "qlora":
            out += [("zero3", "optimizer"), ("zero3", "optimizer+params")]
        out.append(("fsdp", "optimizer+params"))
    return out


def compare_strategies(estimate, world_size: int, shape: ModelShape | None = None,
                       machine_host_bytes: int | None = None) -> list[ShardedEstimate]:
    """Every runnable strategy, best first: fits, then no offload, least communication, simplest.

    ``machine_host_bytes``: the CPU memory of the machine the processes share; a strategy that
    needs more (:attr:`ShardedEstimate.host_bytes_per_machine`) does not fit.
    """
    order = {name: i for i, name in enumerate(STRATEGIES)}
    found = [shard_estimate(estimate, strat, world_size, off, shape, machine_host_bytes)
             for strat, off in candidate_strategies(estimate)]
    # what fits the cards but not the machine's CPU memory ranks before what fits neither (a plan
    # that fits nothing then names the CPU memory it would need)
    return sorted(found, key=lambda e: (not e.fits, not e.device_fits, OFFLOADS.index(e.offload), e.comm_bytes_per_step,
                                        order[e.strategy]))


def best_strategy(estimate, world_size: int, shape: ModelShape | None = None,
                  machine_host_bytes: int | None = None) -> ShardedEstimate | None:
    """The strategy the planner should use on ``world_size`` devices, or None if none fits.

    Offload is chosen only when nothing fits without it (it is bound by PCIe); among the rest the
    least communication wins, and on a tie the simplest (ddp before ZeRO, ZeRO before FSDP).
    """
    ranked = compare_strategies(estimate, world_size, shape, machine_host_bytes)
    return ranked[0] if ranked and ranked[0].fits else None

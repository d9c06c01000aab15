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
- ``zero1`` shards optimizer states, ``zero2`` also gradients, ``zero3`` and ``fsdp`` (FULL_SHARD,
  Zhao et al. 2023, "PyTorch FSDP", Sec. 3) also parameters; ZeRO-3/FSDP hold the parameters of
  the layer being computed and of the one prefetched in full (``gathered parameters``).
- ``offload="optimizer"`` (ZeRO-Offload, Ren et al. 2021, "ZeRO-Offload: Democratizing
  Billion-Scale Model Training", Sec. 4.1): the fp32 optimizer states, the optimizer step and the
  gradient partitions live in CPU memory (``host_bytes``); ``"optimizer+params"`` (ZeRO-Infinity's
  CPU parameter offload, zero3 only) also moves the parameter partitions there. DeepSpeed's
  communication buckets (``reduce_bucket_size``, ``allgather_bucket_size``) are not modelled.

Communication per optimizer step, bytes each device sends (a ring collective over N devices
moves ``(N-1)/N`` of the buffer per device for a reduce-scatter or an all-gather, twice that
for an all-reduce: Patarasuk & Yuan 2009; ZeRO paper Sec. 7, where DP costs ``2Ψ`` and ZeRO-3
``3Ψ``, 1.5x):

- ``ddp``, ``zero1``: one all-reduce of the gradients per step (accumulation runs without
  synchronising): ``2 (N-1)/N · G``;
- ``zero2``: a reduce-scatter of the gradients in every micro-batch (only the partition is
  kept) and one all-gather of the updated trainable parameters: ``m (N-1)/N · G + (N-1)/N · P_t``;
- ``zero3``/``fsdp``: every micro-batch all-gathers all parameters for forward and again for
  backward and reduce-scatters the gradients: ``m (N-1)/N · (2 W + G)``;

with ``G`` the gradient bytes, ``W`` all parameter bytes, ``P_t`` the trainable parameter bytes
and ``m`` the micro-batches per device per step (``ceil(gradient_accumulation / N)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from finetuner.errors import UserError

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
#: what ``finetuner run`` launches: fsdp is estimated and its accelerate config written, but run
#: refuses it (see finetuner.training.launch), so the planner never chooses it; zero3 shards the same way
RUN_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "optimizer+params")

#: the kinds of state each strategy divides by the number of devices
SHARDED_KINDS: dict[str, frozenset[str]] = {
    "ddp": frozenset(),
    "zero1": frozenset({"optimizer"}),
    "zero2": frozenset({"optimizer", "gradients"}),
    "zero3": frozenset({"optimizer", "gradients", "parameters"}),
    "fsdp": frozenset({"optimizer", "gradients", "parameters"}),
}

#: DeepSpeed cannot shard the state of bitsandbytes or factored optimizers (the recipe refuses them)
ZERO_OPTIMIZERS = ("adamw_torch", "sgd")


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

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.per_device_bytes - self.spillable_bytes <= self.budget_bytes

    @property
    def label(self) -> str:
        return self.strategy if self.offload == "none" else f"{self.strategy} + {self.offload} offload"

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "offload": self.offload,
            "per_device_bytes": self.per_device_bytes,
            "host_bytes": self.host_bytes,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "comm_formula": self.comm_formula,
            "single_device_bytes": self.single_device_bytes,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "components": dict(self.components),
            "notes": list(self.notes),
        }


def _layer_params(estimate) -> tuple[int, int]:
    """(parameters of one decoder layer, of the embedding or LM head): the largest units gathered at once."""
    counts = estimate.details.get("parameters", {}) if estimate.details else {}
    layers = counts.get("attention", 0) + counts.get("mlp", 0) + counts.get("norms", 0)
    unit = max(counts.get("embeddings", 0), counts.get("lm_head", 0))
    n_layers = None
    try:
        from finetuner.model.shapes import resolve_shape

        n_layers = resolve_shape(estimate.model).num_layers
    except Exception:  # an unknown model name: assume a typical depth
        n_layers = 32
    return (layers // max(n_layers, 1), unit)


def shard_estimate(estimate, strategy: str, world_size: int, offload: str = "none") -> ShardedEstimate:
    """Per-device memory and communication of ``strategy`` on ``world_size`` devices (see the module doc)."""
    from finetuner.memory.model import ALLOCATOR_FIXED_BYTES, ALLOCATOR_FRACTION

    if strategy not in STRATEGIES:
        raise UserError(f"Unknown strategy '{strategy}'; one of {', '.join(STRATEGIES)}.")
    if offload not in OFFLOADS:
        raise UserError(f"Unknown offload '{offload}'; one of {', '.join(OFFLOADS)}.")
    if world_size < 1:
        raise UserError("world_size must be at least 1.")
    if offload != "none" and not strategy.startswith("zero"):
        raise UserError(f"offload '{offload}' needs a DeepSpeed ZeRO strategy (zero1-3), not {strategy}.")
    if offload == "optimizer+params" and strategy != "zero3":
        raise UserError("parameter offload needs zero3.")
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

    def place(kind: str, b: int) -> tuple[int, bool]:  # (bytes per device or per process, on the host?)
        share = math.ceil(b / n) if kind in sharded else b
        return share, kind in host_kinds

    states: dict[str, int] = {}
    host = 0
    for name in state_names:
        share, on_host = place(component_kind(name), comps[name])
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
    if strategy in ("zero3", "fsdp") and n > 1:
        layer, unit = _layer_params(estimate)
        total_params = max(estimate.details.get("parameters", {}).get("total", 0), 1)
        fb["gathered parameters (layer + prefetch)"] = int(max(2 * layer, unit) * weights / total_params)
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

    m = max(1, math.ceil(s.gradient_accumulation / n))
    ring = (n - 1) / n
    if strategy in ("ddp", "zero1"):
        comm, formula = 2 * ring * grads, "2(N-1)/N x gradients (one all-reduce per step)"
    elif strategy == "zero2":
        comm = m * ring * grads + ring * trainable_bytes
        formula = "m(N-1)/N x gradients (reduce-scatter per micro-batch) + (N-1)/N x trainable parameters (all-gather)"
    else:
        comm = m * ring * (2 * weights + grads)
        formula = "m(N-1)/N x (2 x parameters + gradients) (all-gather forward and backward, reduce-scatter)"
    if offload != "none":
        notes.append(f"{host / 2**30:.2f} GiB per process in CPU memory; each step moves gradients to the CPU and parameters back (PCIe)")
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
    )


def candidate_strategies(estimate) -> list[tuple[str, str]]:
    """(strategy, offload) pairs that can run this estimate's settings (the recipe's rules)."""
    s = estimate.settings
    out = [("ddp", "none")]
    zero_ok = s.optimizer in ZERO_OPTIMIZERS
    for strat in ("zero1", "zero2", "zero3"):
        if not zero_ok or (strat == "zero3" and s.method == "qlora"):
            continue
        out.append((strat, "none"))
    if s.method != "qlora":
        out.append(("fsdp", "none"))
    if zero_ok and s.optimizer != "sgd":
        out.append(("zero2", "optimizer"))
        if s.method != "qlora":
            out += [("zero3", "optimizer"), ("zero3", "optimizer+params")]
    return out


def compare_strategies(estimate, world_size: int) -> list[ShardedEstimate]:
    """Every runnable strategy, best first: fits, then no offload, least communication, simplest."""
    order = {name: i for i, name in enumerate(STRATEGIES)}
    found = [shard_estimate(estimate, strat, world_size, off) for strat, off in candidate_strategies(estimate)]
    return sorted(found, key=lambda e: (not e.fits, OFFLOADS.index(e.offload), e.comm_bytes_per_step, order[e.strategy]))


def best_strategy(estimate, world_size: int) -> ShardedEstimate | None:
    """The strategy the planner should use on ``world_size`` devices, or None if none fits.

    Offload is chosen only when nothing fits without it (it is bound by PCIe); among the rest the
    least communication wins, and on a tie the simplest (ddp before ZeRO, ZeRO before FSDP).
    """
    ranked = [e for e in compare_strategies(estimate, world_size) if e.strategy in RUN_STRATEGIES]
    return ranked[0] if ranked and ranked[0].fits else None

"""The planner: pick the recipe that fits the card and trains fastest, and say why.

Given a model, a card and the data (or a sequence length), :func:`plan` searches the settings
that decide memory — method (LoRA, QLoRA 4-bit or 8-bit, full when asked for), optimizer,
gradient checkpointing, activation offload, micro-batch and gradient accumulation (their product
stays the effective batch) — asks the memory model (:mod:`finetuner.memory.model`) for each one's
peak, keeps those under the card's memory less a safety margin, and ranks the rest:

1. **quality first**: full fine-tuning (only when asked for) > LoRA on a bf16 base > LoRA on a
   quantized base (QLoRA): a better method that fits always wins over a faster worse one;
2. **then predicted throughput** (:func:`predicted_tokens_per_s`: the speed model of
   :mod:`finetuner.planning.speed`, with this machine's calibration or the card's data sheet);
3. then the optimizer with full-precision states, then the plain (not paged) one, then no
   offload, then the larger headroom.

With several GPUs (``gpus``) each option is also split over them by the best strategy the recipe's
schema accepts (:mod:`finetuner.memory.sharding`: DDP, ZeRO 1-3, FSDP2, their CPU offload; QLoRA
sharded by fsdp), and it must fit the machine's CPU memory too: every process's offloaded state
and activations (``cpu_memory``, by default this machine's RAM). A plan says how much CPU memory
it needs, and one that needs more than the machine has does not fit.

The sequence length is the user's, or what the data need: it is never cut below the data's
longest example without a note saying how many examples are truncated. When nothing fits, the
plan says what would: a shorter sequence, a bigger card, a smaller model.

Everything here is arithmetic (no torch): ``finetuner plan`` answers in well under a second.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from finetuner.errors import UserError
from finetuner.surface import say
from finetuner.config.hardware import GpuProfile, get_gpu, list_profiles
from finetuner.memory.grpo import grpo_memory_estimate, grpo_settings_of
from finetuner.memory.model import GiB, MemoryEstimate, Settings, estimate, settings_from_recipe
from finetuner.memory.sharding import distributed_keys, recipe_offload
from finetuner.model.gguf_base import info_for
from finetuner.model.shapes import ModelShape, instruct_variant, parameter_count, preset_model, presets, resolve_shape
from finetuner.planning.calibrate import speed_for
from finetuner.planning.load import note_now
from finetuner.planning.expectations import expectation
from finetuner.data.split import held_out_rows
from finetuner.planning.sizing import Sizing, learning_rate, size_run
from finetuner.planning.lengths import BatchShape, batch_shape, prompt_batch
from finetuner.planning.speed import DeviceSpeed, StepTime, step_time
from finetuner.planning.speed_grpo import grpo_step_time
from finetuner.planning.scans import kernel_note
from finetuner.planning.wait import Wait, check_currency, cost_of, cost_text, parts_text, recipe_wait

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe

#: Fraction of the card kept free on top of the memory model's own allowances.
DEFAULT_MARGIN = 0.05
#: The data set the written recipe trains on when the user gives none (public, instruction data).
DEFAULT_DATA = "yahma/alpaca-cleaned"

#: Lower is better. QLoRA (4- and 8-bit) share a tier: within it the faster one wins.
METHOD_TIER = {"full": 0, "lora": 1, "qlora": 2}
OPTIMIZER_PREFERENCE = ("adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd")

# ---------------------------------------------------------------------- speed
#: Predicted speeds closer than this (relative) are a tie, decided by simplicity (the speed
#: model is not that precise): no offload, then full-precision optimizer states.
SPEED_TIE = 0.05


@dataclass(frozen=True)
class Option:
    """One point of the search space."""

    method: str  # lora | qlora | full
    quant_bits: int | None
    optimizer: str
    gradient_checkpointing: bool
    activation_offload: bool
    micro_batch: int
    gradient_accumulation: int

    @property
    def label(self) -> str:
        parts = [method_name(self.method, self.quant_bits), f"micro-batch {self.micro_batch} x {self.gradient_accumulation}", self.optimizer]
        parts.append("checkpointing" if self.gradient_checkpointing else "no checkpointing")
        if self.activation_offload:
            parts.append("activation offload")
        return ", ".join(parts)


def method_name(method: str, quant_bits: int | None = None) -> str:
    """How a plan names a method: ``LoRA``, ``full fine-tuning``, ``QLoRA 4-bit`` (``QLoRA`` without bits)."""
    if method in ("lora", "full"):
        return {"lora": "LoRA", "full": "full fine-tuning"}[method]
    return f"QLoRA {quant_bits}-bit" if quant_bits else "QLoRA"


@dataclass
class Candidate:
    option: Option
    estimate: MemoryEstimate  # one device, no sharding
    tokens_per_s: float
    fits: bool
    sharded: Any = None  # memory_sharding.ShardedEstimate on several devices
    step: StepTime | None = None  # the speed model's step time behind tokens_per_s

    @property
    def peak_bytes(self) -> int:
        """What one device must hold."""
        return self.sharded.per_device_bytes if self.sharded is not None else self.estimate.total_bytes

    def sort_key(self) -> tuple:
        o = self.option
        return (
            METHOD_TIER[o.method],
            # within SPEED_TIE of each other, speeds count as equal: the simpler option wins
            -math.floor(math.log(max(self.tokens_per_s, 1e-9)) / math.log(1 + SPEED_TIE)),
            OPTIMIZER_PREFERENCE.index(o.optimizer),
            o.activation_offload,
            self.peak_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        label = self.option.label + (f", {self.sharded.label} on {self.sharded.world_size} GPUs" if self.sharded else "")
        return {
            "settings": label,
            "fits": self.fits,
            "total_bytes": self.peak_bytes,
            "tokens_per_s": round(self.tokens_per_s, 1),
        }


@dataclass
class Plan:
    """The planner's answer: a runnable recipe, its memory estimate, and the reasons."""

    model: str
    gpu: GpuProfile
    shape: ModelShape
    recipe: Recipe | None
    estimate: MemoryEstimate | None
    tokens_per_s: float | None
    seq_len: int
    effective_batch: int
    reasons: list[str] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] | None = None
    candidates_searched: int = 0
    gpus: int = 1
    sharded: Any = None  # the chosen strategy's per-device memory (gpus > 1)
    strategies: list[dict[str, Any]] = field(default_factory=list)  # every strategy for the chosen option
    #: optimizer steps a run of the recipe takes (with --data: counted as the trainer counts them), or None
    optimizer_steps: int | None = None
    #: when nothing fits: the recipe of the option that needs the least memory (it does not fit
    #: either; for a user who starts it anyway, e.g. on a card with more memory than its profile says)
    closest: Recipe | None = None
    #: the CPU memory of the machine the plan is for (gpus > 1), and where that figure came from
    cpu_memory: int | None = None
    cpu_memory_source: str = ""
    #: the speed model's step time for the chosen recipe, and where the device's figures came from
    step: StepTime | None = None
    speed_source: str = ""
    #: what an hour of the machine costs (``--price-per-hour``), for the plan's cost; None: not asked
    price_per_hour: float | None = None
    #: the price's currency (``--currency``), None: the cost is said in the price's units
    currency: str | None = None
    #: the whole run's predicted wait by part (:mod:`finetuner.planning.wait`), when the steps are known
    wait: Wait | None = None
    #: the device's speed figures the plan's times come from
    speed: DeviceSpeed | None = None
    #: with several cards: the plan's first sentence (:func:`finetuner.planning.cards.headline`)
    headline: str | None = None
    #: what the plan says up front: a run predicted to take hours, with its cheaper choices (:mod:`finetuner.planning.budget`)
    warnings: list[str] = field(default_factory=list)
    #: with ``max_hours``: no plan of the job is predicted to end within it; this plan is the shortest, and the line
    #: says so (:func:`finetuner.planning.budget.within_budget`; ``finetuner plan`` exits 1 and writes no recipe)
    over_budget: str | None = None

    @property
    def step_s(self) -> float | None:
        """Predicted seconds per optimizer step."""
        return self.step.step_s if self.step else None

    @property
    def steps_s(self) -> float | None:
        """Predicted seconds of the optimizer steps alone (steps x step time), when the steps are known."""
        if self.step is None or not self.optimizer_steps:
            return None
        return self.step.step_s * self.optimizer_steps

    @property
    def wall_s(self) -> float | None:
        """Predicted seconds of the whole run (:attr:`wait`: download, load, replay, steps, evaluations,
        checkpoints, probe, samples), when the steps are known."""
        return self.wait.wall_s if self.wait is not None else None

    @property
    def cost(self) -> float | None:
        """Predicted cost of the whole run (:attr:`wall_s`) at ``price_per_hour`` (for all ``gpus`` together)."""
        return cost_of(self.wall_s, self.price_per_hour)

    def time_line(self) -> str:
        """tokens/s and time per step, then the whole run's time by part (:func:`time_text`), its cost, and the
        speed figures' source."""
        if self.step is None:
            return ""
        grpo = self.recipe is not None and self.recipe.objective == "grpo"
        return time_text(self.step.step_s, self.step.tokens_per_s, self.optimizer_steps, self.wait.to_dict() if self.wait else None,
                         self.cost, self.price_per_hour, self.currency, self.speed_source, grpo)

    @property
    def fits(self) -> bool:
        if self.sharded is not None:
            return self.recipe is not None and self.sharded.fits
        return self.recipe is not None and self.estimate is not None and self.estimate.fits

    @property
    def peak_bytes(self) -> int | None:
        """What one device must hold (per device with several GPUs)."""
        if self.sharded is not None:
            return self.sharded.per_device_bytes
        return self.estimate.total_bytes if self.estimate else None

    def to_dict(self) -> dict[str, Any]:
        est = self.estimate.to_dict() if self.estimate else {}
        per = self.sharded
        return {
            "model": self.model,
            "gpu": self.gpu.to_dict(),
            "fits": self.fits,
            "headline": self.headline,
            "total_bytes": per.per_device_bytes if per is not None else est.get("total_bytes"),
            "device_bytes": self.gpu.memory_bytes,
            "budget_bytes": est.get("budget_bytes"),
            "components": dict(per.components) if per is not None else est.get("components", {}),
            "predicted_tokens_per_s": round(self.tokens_per_s, 1) if self.tokens_per_s else None,
            "predicted_step_s": round(self.step_s, 4) if self.step_s else None,
            "predicted_steps_s": round(self.steps_s, 1) if self.steps_s else None,
            "predicted_wall_s": round(self.wall_s, 1) if self.wall_s else None,
            "predicted_wait": self.wait.to_dict() if self.wait is not None else None,
            "price_per_hour": self.price_per_hour,
            "currency": self.currency,
            "predicted_cost": round(self.cost, 4) if self.cost is not None else None,
            "speed_source": self.speed_source,
            "speed_parts_s": {k: round(v, 5) for k, v in self.step.parts.items()} if self.step else None,
            "seq_len": self.seq_len,
            "effective_batch": self.effective_batch,
            "optimizer_steps": self.optimizer_steps,
            "choice": self.recipe_choice(),
            "reasons": self.reasons,
            "rejected": self.rejected,
            "suggestions": self.suggestions,
            "notes": self.notes,
            "warnings": self.warnings,
            "over_budget": self.over_budget,
            "data": self.data,
            "candidates_searched": self.candidates_searched,
            "gpus": self.gpus,
            "per_device": self.sharded.to_dict() if self.sharded is not None else None,
            "strategies": self.strategies,
            "cpu_memory": self.cpu_memory_dict(),
            "estimate": est,
            "recipe": self.recipe.to_dict() if self.recipe else None,
        }

    def cpu_memory_dict(self) -> dict[str, Any] | None:
        """The CPU memory the plan needs on its machine and what the machine has (gpus > 1)."""
        if self.sharded is None:
            return None
        sh = self.sharded
        return {"needed_bytes": sh.host_bytes_per_machine, "per_process_bytes": sh.host_bytes_per_process,
                "processes": sh.world_size, "machine_bytes": self.cpu_memory, "source": self.cpu_memory_source,
                "fits": sh.host_fits}

    def recipe_choice(self) -> dict[str, Any] | None:
        if self.recipe is None:
            return None
        r, t = self.recipe, self.recipe.training
        return {
            "method": r.method,
            "quantization_bits": r.quantization.bits if r.quantization else None,
            "micro_batch_size": t.micro_batch_size,
            "gradient_accumulation": t.gradient_accumulation,
            "optimizer": t.optimizer,
            "gradient_checkpointing": t.gradient_checkpointing,
            "offload_activations": t.offload_activations,
            "max_seq_len": r.data.max_seq_len,
            "packing": r.data.packing,
            **({"strategy": r.distributed.strategy, "num_processes": r.distributed.num_processes,
                "distributed_offload": recipe_offload(r.distributed)} if self.gpus > 1 else {}),
        }

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The recipe as YAML with a header that says where it came from; ``path``, where it is written,
        fills the header's ``finetuner estimate`` command."""
        if self.recipe is None:
            raise UserError(f"Nothing fits {self.gpu.name} for {self.model}; there is no recipe to write.")
        head = [
            f"# Planned by `finetuner plan` for {self.shape.name} on {self.gpu.name} ({self.gpu.memory_gib:.1f} GiB):",
            f"# predicted peak {self.peak_bytes / GiB:.1f} GiB{' per device' if self.gpus > 1 else ''}, "
            f"~{self.tokens_per_s:,.0f} tokens/s, {format_duration(self.step_s)} per step (speed model: {self.speed_source}).",
        ]
        head += [f"# Warning: {w}" for w in self.warnings]
        head += [f"# - {r}" for r in self.reasons]
        head += [f"# Note: {n}" for n in self.notes]
        check = f"finetuner estimate {path} --gpu {self.gpu.name}" if path else f"`finetuner estimate` on this file with --gpu {self.gpu.name}"
        head.append(f"# Check it: {check}")
        from finetuner.config.recipe import readable_yaml

        # the values that differ from the defaults, plus every planned value
        planned = {k: v for k, v in (self.recipe_choice() or {}).items()
                   if k in ("micro_batch_size", "gradient_accumulation", "optimizer", "gradient_checkpointing", "offload_activations")}
        # the length of training and the learning rate are planned too: written even when they are the defaults
        planned |= {"epochs": self.recipe.training.epochs, "lr": self.recipe.training.lr}
        if self.recipe.training.max_steps:
            planned["max_steps"] = self.recipe.training.max_steps
        keep = {"training": planned, "data": {"max_seq_len": self.recipe.data.max_seq_len}}
        if self.gpus > 1:
            d = self.recipe.distributed
            keep["distributed"] = {"num_processes": d.num_processes,
                                   **distributed_keys(d.strategy, recipe_offload(d))}
        return readable_yaml(self.recipe, "".join(f"{line}\n" for line in head), keep)

    def __repr__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        if not self.fits:
            return f"Plan({self.model} on {self.gpu.name}: nothing fits; " + "; ".join(self.suggestions) + ")"
        c = self.recipe_choice() or {}
        where = f"{self.gpus} x {self.gpu.name}" if self.gpus > 1 else self.gpu.name
        strategy = f", {self.sharded.label}" if self.sharded is not None else ""
        return (
            f"Plan({self.model} on {where}: {c['method']}{strategy}"
            f"{' ' + str(c['quantization_bits']) + '-bit' if c['quantization_bits'] else ''}, micro-batch "
            f"{c['micro_batch_size']} x {c['gradient_accumulation']}, seq {c['max_seq_len']}, {c['optimizer']}, "
            f"checkpointing {'on' if c['gradient_checkpointing'] else 'off'}; peak "
            f"{self.peak_bytes / GiB:.1f} of {self.gpu.memory_gib:.1f} GiB{' per device' if self.gpus > 1 else ''})"
        )

    def _repr_html_(self) -> str:
        import html

        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>{v / GiB:.2f}</td></tr>"
            for k, v in (self.estimate.components.items() if self.estimate else [])
        )
        reasons = "".join(f"<li>{html.escape(r)}</li>" for r in self.reasons + self.suggestions)
        return (
            f"<b>{html.escape(self.summary())}</b><ul>{reasons}</ul>"
            f"<table><tr><th>component</th><th>GiB</th></tr>{rows}</table>"
        )


# ====================================================================== speed
def format_duration(seconds: float | None) -> str:
    """``0.42 s``, ``12 s``, ``3 min 20 s``, ``2 h 05 min``: how a plan says a time."""
    if seconds is None:
        return "?"
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    m, sec = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def format_cost(cost: float) -> str:
    """``12.50``, or two significant digits below 0.1 (``0.0029``): how a plan says a cost."""
    return f"{cost:,.2f}" if cost >= 0.1 else f"{cost:.2g}"


def time_text(step_s: float, tokens_per_s: float, steps: int | None, wait: dict[str, Any] | None, cost: float | None,
              price_per_hour: float | None, currency: str | None, source: str, upper_bound: bool = False,
              tokens_note: str = "", brief: bool = False) -> str:
    """How finetuner says a run's predicted time (the plan, ``estimate``, the web UI): tokens/s (``tokens_note``
    after it) and time per optimizer step, the ``steps``' time, the whole run by part
    (:func:`finetuner.planning.wait.parts_text` of a :meth:`~finetuner.planning.wait.Wait.to_dict`), its cost,
    and where the speed figures came from. ``upper_bound`` (GRPO): the step with its completions at their
    longest (the prompts the data's where it can be read). ``brief`` (the web UI's line under the editor):
    the whole run's time without its parts, the cost and the source."""
    if upper_bound:
        bits = [f"at most {format_duration(step_s)} per optimizer step" +
                ("" if brief else " (completions at their longest; the rollout's generation included)")]
        if steps:
            bits.append(f"{steps:,} optimizer steps: at most ~{format_duration(step_s * steps)}")
    else:
        bits = [f"~{tokens_per_s:,.0f} tokens/s{tokens_note}", f"{format_duration(step_s)} per optimizer step"]
        if steps:
            bits.append(f"{steps:,} optimizer steps: ~{format_duration(step_s * steps)}")
    if brief:
        whole = (f"; the whole run {'at most ' if upper_bound else ''}~{format_duration(wait['wall_s'])} "
                 "(load, replay, evaluations, checkpoints, probe and samples included)" if wait is not None else "")
        return ", ".join(bits) + whole
    if wait is not None:
        bits.append(parts_text(wait, format_duration, upper_bound))
    if cost is not None:
        bits.append(cost_text(cost, price_per_hour, currency, format_cost))
    return ", ".join(bits) + f" (speed: {source})"


def estimate_text(t: dict[str, Any], tokens_note: str = "", brief: bool = False) -> str:
    """:func:`time_text` of an :func:`finetuner.planning.predict.estimate_time` result (``finetuner estimate``, the web UI)."""
    text = time_text(t["step_s"], t["tokens_per_s"], t["optimizer_steps"], t["wait"], t["cost"], t["price_per_hour"],
                     t["currency"], t["source"], bool(t.get("upper_bound")), tokens_note, brief)
    # the UI's brief line leaves it to the plan's notes, which say it too
    return f"{text} Note: {t['load_note']}." if t.get("load_note") and not brief else text


def predicted_step(shape: ModelShape, s: Settings, gpu: GpuProfile, est: MemoryEstimate | None = None,
                   sharded: Any = None, speed: DeviceSpeed | None = None) -> StepTime:
    """The predicted time of one optimizer step (:func:`finetuner.planning.speed.step_time`) on ``gpu``
    with ``speed`` (by default :func:`~finetuner.planning.calibrate.speed_for`: this machine's
    calibration for its own device, the data sheet for another card)."""
    return step_time(shape, s, speed or speed_for(gpu), est, sharded)


def predicted_tokens_per_s(shape: ModelShape, s: Settings, gpu: GpuProfile, est: MemoryEstimate | None = None,
                           sharded: Any = None, speed: DeviceSpeed | None = None) -> float:
    """Training tokens per second of :func:`predicted_step` (what the planner ranks recipes by)."""
    return predicted_step(shape, s, gpu, est, sharded, speed).tokens_per_s


# ====================================================================== search
def method_options(method: str | None) -> list[tuple[str, int | None]]:
    """The (method, quantization bits) pairs a ``--method`` value searches (``plan``, ``plan --longest``)."""
    if method in (None, "auto"):
        return [("lora", None), ("qlora", 4), ("qlora", 8)]
    if method == "qlora":
        return [("qlora", 4), ("qlora", 8)]
    if method in ("qlora4", "qlora-4bit"):
        return [("qlora", 4)]
    if method in ("qlora8", "qlora-8bit"):
        return [("qlora", 8)]
    if method in ("lora", "full"):
        return [(method, None)]
    if method == "any":
        return [("full", None), ("lora", None), ("qlora", 4), ("qlora", 8)]
    raise UserError(f"--method {method!r}: use auto, lora, qlora, qlora4, qlora8, full or any.")


def _optimizers(method: str, fixed: str | None, platform: str = "cuda") -> list[str]:
    """The optimizers the planner weighs; on a CPU torch's own only (bitsandbytes pages on CUDA only:
    a paged optimizer on a CPU warns "Paged optimizers are not supported on CPU" and falls back)."""
    if fixed and fixed != "auto":
        return [fixed]
    if platform == "cpu":
        return ["adamw_torch", "adafactor"] if method == "full" else ["adamw_torch"]
    if method == "full":
        return ["adamw_torch", "adamw_8bit", "paged_adamw_8bit", "adafactor"]
    return ["adamw_torch", "paged_adamw_8bit"]


def _micro_batches(effective_batch: int, fixed: int | str | None, fixed_accum: int | str | None) -> list[tuple[int, int]]:
    if fixed not in (None, "auto") and fixed_accum not in (None, "auto"):
        return [(int(fixed), int(fixed_accum))]
    if fixed not in (None, "auto"):
        mb = int(fixed)
        if effective_batch < mb:
            raise UserError(f"The effective batch ({effective_batch}) is smaller than the micro-batch ({mb}).",
                            hint="Raise the effective batch or lower micro_batch_size.")
        return [(mb, max(1, effective_batch // mb))]
    if fixed_accum not in (None, "auto"):
        ga = int(fixed_accum)
        return [(max(1, effective_batch // ga), ga)]
    out, mb = [], 1
    while mb <= min(effective_batch, 64):
        if effective_batch % mb == 0:
            out.append((mb, effective_batch // mb))
        mb *= 2
    return out or [(1, effective_batch)]


def _apply(base: Recipe, o: Option) -> Recipe:
    """A resolved copy of ``base`` with the option's values."""
    from finetuner.config.sections import QuantizationSection

    t = base.training.model_copy(update={
        "micro_batch_size": o.micro_batch,
        "gradient_accumulation": o.gradient_accumulation,
        "effective_batch": None,
        "optimizer": o.optimizer,
        "gradient_checkpointing": o.gradient_checkpointing,
        "offload_activations": o.activation_offload,
    })
    quant = None
    if o.method == "qlora":
        quant = (base.quantization or QuantizationSection()).model_copy(update={"bits": o.quant_bits})
    return base.model_copy(update={"method": o.method, "training": t, "quantization": quant})


def search(
    base: Recipe,
    shape: ModelShape,
    gpu: GpuProfile,
    margin: float = DEFAULT_MARGIN,
    method: str | None = None,
    label_fraction: float = 1.0,
    gpus: int = 1,
    cpu_memory: int | None = None,
    speed: DeviceSpeed | None = None,
    lengths: Sequence[int] | None = None,
) -> list[tuple[Candidate, Recipe]]:
    """Every option the recipe leaves open, estimated and ranked (best first).

    ``speed``: the device's speed figures for the ranking (default :func:`speed_for` ``gpu``);
    ``lengths``: the training rows' token lengths (a data profile's; GRPO: its prompts'), so that each
    option's time is that of its micro-batches as the trainer pads them (:mod:`finetuner.planning.lengths`);
    None: every row ``data.max_seq_len`` long.

    With ``gpus > 1`` each option is also split over the devices by the best strategy
    (:func:`finetuner.memory.sharding.compare_strategies`: DDP, ZeRO 1-3, FSDP, ZeRO-Offload,
    FSDP's CPU offload) that the recipe's schema accepts, and its gradient accumulation must divide
    evenly among them. ``cpu_memory``: the machine's CPU memory, which the processes' offloaded
    state must fit (None: not checked).
    """
    refused: dict[tuple, str | None] = {}
    speed = speed or speed_for(gpu)
    t = base.training
    eff = t.effective_batch_size
    fixed_method = None if base.method == "auto" else base.method
    if fixed_method == "qlora" and base.quantization is not None and method is None:
        methods = [("qlora", base.quantization.bits)]
    else:
        methods = method_options(method or fixed_method)
    if gpu.platform == "cpu":
        methods = [m for m in methods if m[0] != "qlora"] or methods  # bitsandbytes on CPU: slow, only when asked
    grpo = base.objective == "grpo" and base.grpo is not None
    if grpo and gpus > 1:
        raise UserError(f"{gpus} GPUs: the plan of a GRPO run is made for one card.",
                        hint="Plan for one card: with distributed.strategy ddp each of the N cards holds what one card "
                             "holds in that plan (each process generates and trains on its share of the prompts).")
    if grpo and base.grpo.beta:  # the reference is the base with the adapter off: full fine-tuning has none
        methods = [m for m in methods if m[0] != "full"] or methods
    gcs = [False, True] if t.gradient_checkpointing == "auto" else [bool(t.gradient_checkpointing)]
    from finetuner.memory.vision import vision_cost_of

    vision = vision_cost_of(base)  # a trained projector or vision tower: the LoRA options' extra (None: none)
    out: list[tuple[Candidate, Recipe]] = []
    for m, bits in methods:
        for opt in _optimizers(m, t.optimizer if t.optimizer != "auto" else None, gpu.platform):
            for gc in gcs:
                offloads = [False, True] if (t.offload_activations == "auto" and gc and gpu.platform == "cuda") else (
                    [bool(t.offload_activations)] if t.offload_activations != "auto" else [False])
                for off in offloads:
                    for mb, ga in _micro_batches(eff, t.micro_batch_size, t.gradient_accumulation):
                        if gpus > 1 and ga % gpus:
                            continue
                        o = Option(m, bits, opt, gc, off, mb, ga)
                        recipe = _apply(base, o)
                        s = settings_from_recipe(recipe, gpu, shape.model_type).with_(label_fraction=label_fraction)
                        if vision is not None and m != "full":
                            s = s.with_(vision_trainable=vision.trainable, vision_activation_bytes=vision.activation_bytes(mb))
                        if grpo:
                            g = grpo_settings_of(recipe, gpu.memory_bytes)
                            est = grpo_memory_estimate(shape, s, g, gpu, margin, top_p=recipe.grpo.top_p < 1)
                        else:
                            est = estimate(shape, s, gpu, margin=margin)
                        sharded = None
                        if gpus > 1:
                            sharded, recipe = _strategy_for(recipe, est, shape, gpus, cpu_memory, refused)
                            fits = sharded.fits
                        else:
                            fits = est.total_bytes <= (est.budget_bytes or est.total_bytes)
                            if grpo:  # and vLLM's share (grpo.use_vllm) holds its weights and a sequence's KV cache
                                fits = fits and est.details["grpo"]["vllm_fits"]
                        batch = lengths_batch(recipe, lengths, mb, ga) if lengths else None
                        if grpo:  # the rollout's generation and the loss over the group (as recipe_step_time predicts it)
                            st = grpo_step_time(shape, s, g, speed, est=est, top_p=recipe.grpo.top_p, prompts=batch)
                        else:
                            st = step_time(shape, s, speed, est, sharded, batch=batch)
                        out.append((Candidate(o, est, st.tokens_per_s, fits, sharded, st), recipe))
    out.sort(key=lambda cr: cr[0].sort_key())
    return out


def with_strategy(recipe: Recipe, sharded: Any, gpus: int) -> Recipe:
    """``recipe`` with the ``distributed`` section of a strategy on ``gpus`` processes."""
    keys: dict[str, Any] = {"num_processes": gpus, **distributed_keys(sharded.strategy, sharded.offload)}
    if "fsdp_offload" in type(recipe.distributed).model_fields:  # off unless this strategy turns it on
        keys.setdefault("fsdp_offload", False)
    return recipe.model_copy(update={"distributed": recipe.distributed.model_copy(update=keys)})


def schema_error(recipe: Recipe) -> str | None:
    """Why the recipe's schema (:class:`~finetuner.config.recipe.Recipe`, the one place that says which
    combinations ``finetuner run`` starts) refuses ``recipe``, or None when it accepts it."""
    from pydantic import ValidationError

    from finetuner.config.recipe import Recipe, format_validation_error

    try:
        Recipe.model_validate(recipe.to_dict())
    except ValidationError as e:  # "<source>: the recipe is not valid:" then one "  - key: why" line per error
        lines = format_validation_error(e, "recipe").splitlines()[1:]
        return "; ".join(line.strip().removeprefix("- ") for line in lines)
    return None


def schema_accepts(recipe: Recipe) -> bool:
    """Whether the recipe's schema accepts ``recipe`` (:func:`schema_error`)."""
    return schema_error(recipe) is None


def experts_loading_note(shape: ModelShape, cpu_bytes: int | None) -> str:
    """What loading a mixture of experts for 4-bit QLoRA takes from CPU memory: its 16-bit experts, held there
    while they are quantized onto the GPU one expert at a time (:func:`finetuner.model.loading.load_base_model`)."""
    need = 2 * shape.expert_numel
    have = f"; this machine has {cpu_bytes / 2**30:.0f} GiB" if cpu_bytes else ""
    short = " (too little: load on a machine with more, or from a checkpoint saved already quantized)" \
        if cpu_bytes and cpu_bytes < need * 1.1 else ""
    return (f"its {parameter_count(shape.expert_numel)} expert weights are held in 4-bit on the GPU; loading reads them "
            f"into CPU memory in bf16 first ({need / 2**30:.0f} GiB) and quantizes them onto the GPU one expert at a "
            f"time{have}{short}")


def _strategy_for(recipe: Recipe, est: MemoryEstimate, shape: ModelShape, gpus: int, cpu_memory: int | None,
                  refused: dict[tuple, str | None]) -> tuple[Any, Recipe]:
    """The best strategy for one option (:func:`~finetuner.memory.sharding.compare_strategies`) whose
    recipe the schema accepts, and that recipe. ``refused`` caches the schema's answers by method,
    optimizer, strategy and offload. A UserError when it accepts none (not even ddp: the recipe cannot
    run on several processes at all)."""
    from finetuner.memory.sharding import compare_strategies

    errors: dict[str, str] = {}
    for sh in compare_strategies(est, gpus, shape, cpu_memory):
        r = with_strategy(recipe, sh, gpus)
        key = (r.method, r.quantization.bits if r.quantization else None, r.training.optimizer, sh.strategy, sh.offload)
        if key not in refused:
            refused[key] = schema_error(r)
        if refused[key] is None:
            return sh, r
        errors.setdefault(sh.strategy, refused[key])
    why = errors.get("ddp") or next(iter(errors.values()))
    raise UserError(f"No distributed strategy can run this recipe on {gpus} GPUs: {why}",
                    hint="Change what the message names, or plan for one GPU.")


def _why_rejected(c: Candidate, best: Candidate) -> str:
    o, b = c.option, best.option
    if c.sharded is not None and c.sharded.device_fits and not c.sharded.host_fits:
        return (f"fits the cards, but needs {c.sharded.host_bytes_per_machine / GiB:.1f} GiB of CPU memory, over the "
                f"machine's {c.sharded.machine_host_bytes / GiB:.1f} GiB")
    if not c.fits:
        return f"needs {c.peak_bytes / GiB:.1f} GiB, over the {c.estimate.budget_bytes / GiB:.1f} GiB budget"
    if METHOD_TIER[o.method] > METHOD_TIER[b.method]:
        better = method_name(b.method)
        return f"fits, but {better} fits too and trains a better model"
    if c.tokens_per_s < best.tokens_per_s:
        return f"fits, but slower (~{c.tokens_per_s:,.0f} vs ~{best.tokens_per_s:,.0f} tokens/s)"
    return "fits and is as fast; the chosen one keeps full-precision optimizer states / no offload"


# ====================================================================== the entry points
def _recipe_model_name(model: str) -> str:
    """What the written recipe loads: a local folder's or GGUF file's absolute path, a preset's packaged GGUF
    file or hub id (:func:`~finetuner.model.shapes.preset_model`), else as given."""
    local = Path(model).expanduser()
    if local.exists():
        return str(local.resolve())
    return preset_model(model) or model


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in text.lower()).strip("-._")


def default_run_name(model: str, data: str | None, objective: str) -> str:
    """``<model>-<data>-<objective>`` for the model as the user named it (a preset, a hub id or a folder),
    the data file's stem (or the default data set's name) and the objective: plans of other data or
    another objective never share a run folder."""
    from finetuner.runs.jobs import safe_name

    data_name = Path(str(data)).stem if data else Path(DEFAULT_DATA).name
    return safe_name("-".join([_slug(Path(model).name) or "model", _slug(data_name) or "data", objective]))


def _free_name(name: str, runs_dir: Path) -> tuple[str, str | None]:
    """``name``, or the first ``name-2``, ``name-3``... that no folder in ``runs_dir`` has yet, and the
    note that says so (a finished run's folder is never reused silently)."""
    from finetuner.runs.jobs import free_run_name

    free = free_run_name(runs_dir, name)
    if free == name:
        return name, None
    return free, (f"run named {free}: {runs_dir / name} already holds a run (this plan's run gets a folder of its own, "
                  f"{runs_dir / free}; --name NAME to choose another)")


def _base_recipe(model: str, sizing: Sizing, data: str | None, name: str, device: str,
                 columns: dict[str, str] | None = None, objective: str = "sft", grpo: dict[str, Any] | None = None,
                 max_pixels: int | None = None) -> Recipe:
    from finetuner.config.recipe import Recipe

    training: dict[str, Any] = {
        "epochs": sizing.epochs or 1,
        "micro_batch_size": "auto",
        "gradient_accumulation": "auto",
        "effective_batch": sizing.effective_batch,
        "optimizer": "auto",
        "gradient_checkpointing": "auto",
        "offload_activations": "auto",
        "eval_every": sizing.eval_every,
    }
    raw = {
        "name": name,
        "model": {"name": model},
        "method": "auto",
        **({"objective": objective} if objective != "sft" else {}),
        **({"grpo": grpo} if grpo is not None else {}),
        "data": {"path": data or DEFAULT_DATA, "max_seq_len": sizing.seq_len, "val_size": sizing.val_size,
                 "packing": sizing.packing, **({"columns": columns} if columns else {}),
                 **({"replay": sizing.replay} if sizing.replay else {}),
                 **({"max_pixels": max_pixels} if max_pixels else {})},
        "training": training,
        "checkpointing": {"save_every": sizing.save_every, "keep_last": 2},
        "device": device,
    }
    from pydantic import ValidationError

    from finetuner.config.recipe import format_validation_error

    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:  # e.g. a --name that cannot name a folder
        raise UserError(format_validation_error(e, "the planned recipe")) from None


def data_seq_len(model: str, profile, max_new_tokens: int | None = None) -> int:
    """The sequence length :func:`plan` chooses for ``model`` on the data of ``profile`` when none is
    asked for (:func:`~finetuner.planning.sizing.size_run`): what the web UI's Data tab shows for 0. A
    profile of prompts (objective grpo) adds ``max_new_tokens`` (default: the recipe's ``grpo.max_new_tokens``)."""
    from finetuner.config.sections import GRPOSection

    if profile.kind == "prompts":
        new = GRPOSection.model_fields["max_new_tokens"].default if max_new_tokens is None else max_new_tokens
        return size_run(resolve_shape(model), profile, objective="grpo", max_new_tokens=new).seq_len
    objective = "sft" if profile.kind == "sft" else ("kto" if profile.kind == "rated" else "dpo")
    return size_run(resolve_shape(model), profile, objective=objective).seq_len


def _cpu_memory(cpu_memory: int | str | None) -> tuple[int, str]:
    """The machine's CPU memory a plan is for, and where the figure came from."""
    from finetuner.config.hardware import machine_memory_bytes, parse_memory_size

    if cpu_memory is None:
        return machine_memory_bytes(), "this machine's RAM; --cpu-memory SIZE plans for another machine"
    if isinstance(cpu_memory, str):
        return parse_memory_size(cpu_memory), "--cpu-memory"
    if cpu_memory <= 0:
        raise UserError(f"cpu_memory {cpu_memory}: must be a positive number of bytes.")
    return int(cpu_memory), "--cpu-memory"


def grpo_section(grpo: dict[str, Any] | None) -> dict[str, Any]:
    """The ``grpo`` section a plan writes into its recipe: ``grpo`` validated as the recipe validates it
    (:class:`~finetuner.config.recipe.GRPOSection`, TRL's names accepted), its rewards checked without
    running them (:func:`finetuner.rewards.specs.check_reward_specs`: each file made absolute and checked
    to define its function, each built-in checked by name). A :class:`UserError` naming what is wrong."""
    from pydantic import ValidationError

    from finetuner.config.recipe import format_validation_error
    from finetuner.config.sections import GRPOSection
    from finetuner.rewards.specs import SPEC_FORM, check_reward_specs

    raw = dict(grpo or {})
    if not raw.get("rewards"):
        raise UserError("objective grpo: GRPO trains on rewards, and none is named.",
                        hint=say(cli=f"Name one with --reward {SPEC_FORM}.", ui=f"Name one in Rewards: {SPEC_FORM}."))
    raw["rewards"] = check_reward_specs(raw["rewards"])
    try:
        section = GRPOSection.model_validate(raw)
    except ValidationError as e:
        raise UserError(format_validation_error(e, "grpo").replace("\n  - ", "\n  - grpo.")) from None
    out = section.model_dump(mode="json", exclude_unset=True)
    out["rewards"] = [r.model_dump(mode="json", exclude_defaults=True) | {"function": r.function} for r in section.rewards]
    out.setdefault("max_new_tokens", section.max_new_tokens)
    out.setdefault("num_generations", section.num_generations)
    return out


def _check_objective(objective: str | None) -> str | None:
    """``objective`` as :func:`plan` takes it: ``None`` for ``auto``, else a known objective."""
    from typing import get_args

    from finetuner.config.sections import Objective

    if objective in (None, "auto"):
        return None
    planned = list(get_args(Objective))
    if objective not in planned:
        raise UserError(f"--objective {objective}: not an objective; choose auto, {', '.join(planned)}.")
    return objective


def _objective_for(objective: str | None, profile) -> tuple[str, str | None]:
    """The objective of a plan on data ``profile`` (``objective`` as asked, ``None``: from the data),
    and the reason to print when it came from the data. A :class:`UserError` when the data do not fit it."""
    from finetuner.config.sections import PAIRED_OBJECTIVES
    from finetuner.data.formats import AUTO_OBJECTIVE, KIND_WORDS, OBJECTIVES_OF_KIND, wrong_objective

    kind = profile.kind
    if objective == "grpo":  # any file with prompts: profile_prompts read it as the GRPO trainer will
        return objective, None
    if objective is None:
        chosen = AUTO_OBJECTIVE[kind]
        if kind == "sft":
            return chosen, None
        others = say(cli=" (orpo and simpo need no reference model: --objective orpo|simpo)",
                     ui=" (orpo and simpo need no reference model: choose one in the Objective menu)") if kind == "pairs" else ""
        return chosen, f"objective {chosen}: {profile.path} holds {KIND_WORDS[kind]}{others}"
    need = "sft" if objective == "sft" else "pairs" if objective in PAIRED_OBJECTIVES else "rated"
    if kind != need:
        e = wrong_objective(profile.path, kind, objective)
        where = say(cli="--objective", ui="the Objective menu")
        raise UserError(e.message, hint=f"Plan with objective {OBJECTIVES_OF_KIND[kind]}, or auto ({where}), or give "
                        f"data for '{objective}'.") from None
    return objective, None


def plan(
    model: str,
    gpu: str | GpuProfile | None = None,
    *,
    seq_len: int | None = None,
    data: str | None = None,
    effective_batch: int | None = None,
    method: str | None = None,
    margin: float = DEFAULT_MARGIN,
    name: str | None = None,
    gpus: int = 1,
    columns: dict[str, str] | None = None,
    objective: str | None = None,
    runs_dir: str | Path | None = None,
    cpu_memory: int | str | None = None,
    price_per_hour: float | None = None,
    grpo: dict[str, Any] | None = None,
    currency: str | None = None,
    max_pixels: int | None = None,
    epochs: int | None = None,
    alternatives: bool = True,
    max_hours: float | None = None,
) -> Plan:
    """Plan a fine-tune of ``model`` on ``gpu`` (``finetuner.plan``).

    Args:
        model: a preset (``llama-2-7b``, see ``finetuner plan --help``), a hub id, or a local
            folder with ``config.json``. The written recipe names a preset by its hub id and a
            folder by its absolute path.
        gpu: a card name (``rtx4090``), a size (``24GB``), ``cpu``, a :class:`GpuProfile`, or
            ``None`` / ``auto`` for the detected device (the CPU when there is no GPU).
        seq_len: the sequence length; by default what the data need (see :mod:`finetuner.planning.sizing`),
            else 2048; never beyond the model's positions.
        data: a data file (JSON/JSONL/CSV/Parquet) whose real lengths and size decide the
            sequence, packing, effective batch, epochs and held-out rows; it becomes the
            recipe's ``data.path``. Without it the recipe trains on ``DEFAULT_DATA``, and the plan
            says so.
        effective_batch: examples per optimizer step (micro-batch x accumulation); by default 16,
            lowered for small data sets.
        method: ``auto`` (LoRA or QLoRA), ``lora``, ``qlora``, ``qlora4``, ``qlora8``, ``full``
            or ``any`` (full fine-tuning included).
        margin: fraction of the card kept free.
        gpus: number of such cards: the plan adds the distributed strategy (DDP, ZeRO, FSDP)
            with its per-device memory and communication per step.
        columns: which of the data file's columns holds which role (``{"prompt": "question",
            "response": "answer"}``), as ``data.columns`` in a recipe; written into the recipe.
        objective: ``sft``, ``dpo``, ``orpo``, ``simpo`` or ``kto``; ``None`` or ``auto``: what the
            data file holds (supervised examples: sft, preference pairs: dpo, rated responses: kto).
            A preference objective is searched with its own memory cost (two sequences per pair,
            the reference pass) and sized as :mod:`finetuner.planning.sizing` says; it needs ``data``.
        name: the run's name; by default ``<model>-<data stem>-<objective>``
            (:func:`default_run_name`), with ``-2``, ``-3``... when ``runs_dir`` already has a folder
            of that name (the plan's notes say so).
        runs_dir: where the run folders are (default ``runs`` in the current folder, where
            ``finetuner run`` puts them).
        cpu_memory: the CPU memory of the machine that runs the ``gpus`` processes, in bytes or as
            a size (``64GB``, GiB); by default this machine's RAM. Offloaded state must fit it.
        price_per_hour: what an hour of the machine (all ``gpus`` cards) costs: the plan adds the
            run's predicted cost (``Plan.cost``) to its time (``Plan.wall_s``: the whole run, by part in
            ``Plan.wait``).
        currency: the price's currency (``USD``, ``€``), said with the cost; None: the price's units.
        grpo: for ``objective="grpo"`` (implied when given), the recipe's ``grpo`` section: at least
            ``rewards`` (``[{"function": "my_reward", "file": "rewards.py"}]`` or built-in names), and
            ``num_generations``, ``max_new_tokens`` … as the recipe takes them. ``data`` gives the prompts
            (the prompt side of any supported file, :func:`finetuner.data.stats.profile_prompts`); the
            search uses GRPO's memory terms (:mod:`finetuner.memory.grpo`: the rollout's KV cache, the
            loss over the group, the reference pass) and step time (the generation included), and the
            plan says the largest ``max_new_tokens`` and ``num_generations`` that fit its choice.
        max_pixels: for pictures in ``data`` and a model whose processor sizes them by pixel count (Qwen2-VL,
            Qwen2.5-VL, Qwen3-VL), the most pixels a picture keeps (``data.max_pixels``); None: the largest of the
            data's largest picture and its halvings (down to the processor's least) that fits
            (:func:`plan_picture_size`).
        epochs: the passes over the data (default: enough for ``MIN_TOTAL_STEPS`` optimizer steps, see
            :mod:`finetuner.planning.sizing`).
        alternatives: a plan predicted to take more than a few hours says so in :attr:`Plan.warnings` with its cheaper
            choices and their times (:mod:`finetuner.planning.budget`), and a capped sequence says what keeping the
            rows it cuts costs (:mod:`finetuner.planning.length_cap`): each planned again; False: the plan alone.
        max_hours: a time budget for the whole run (``--max-hours``): the least-reduced of the job as asked, fewer
            epochs, then the sequence at the data's 95th percentile (on the same card) whose predicted time fits it,
            its first reason saying what was reduced; when none fits, the shortest, with :attr:`Plan.over_budget`
            (:func:`finetuner.planning.budget.within_budget`).

    Example:
        >>> p = plan("llama-2-7b", "rtx4090", seq_len=2048)
        >>> p.fits, p.recipe.method, p.recipe.model.name
        (True, 'lora', 'meta-llama/Llama-2-7b-hf')
    """
    from finetuner.config.recipe import Recipe

    asked = {k: v for k, v in locals().items() if k != "Recipe"}  # the arguments, for plan_picture_size
    prof = gpu if isinstance(gpu, GpuProfile) else get_gpu(gpu)
    if seq_len is not None and seq_len < 16:
        raise UserError(f"{say(cli='--seq-len', ui='Sequence length')} {seq_len}: the sequence length must be at least 16 "
                        "(as data.max_seq_len).")
    if effective_batch is not None and effective_batch < 1:
        raise UserError(f"{say(cli='--effective-batch', ui='Effective batch')} {effective_batch}: must be at least 1.")
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: must be at least 1.")
    if epochs is not None and epochs < 1:
        raise UserError(f"--epochs {epochs}: the passes over the data must be at least 1.")
    if price_per_hour is not None and not price_per_hour >= 0:  # also NaN
        raise UserError(f"{say(cli='--price-per-hour', ui='Price per hour')} {price_per_hour}: must be 0 or more.")
    currency = check_currency(currency, price_per_hour)
    if not 0 <= margin < 1:  # also NaN
        raise UserError(f"--margin {margin}: the fraction of the card kept free must be at least 0 and below 1.")
    if effective_batch is not None and effective_batch < gpus:
        raise UserError(f"--effective-batch {effective_batch} is smaller than --gpus {gpus}: each GPU needs an example per step.")
    if max_hours is not None:
        from finetuner.planning.budget import within_budget

        return within_budget(max_hours, lambda **changes: plan(**{**asked, "max_hours": None, **changes}), format_duration)
    if columns:
        from finetuner.data.formats import check_columns

        try:
            check_columns(columns, "auto")
        except ValueError as e:
            raise UserError(f"data.columns (--column): {e}") from None
    objective = _check_objective(objective)
    if grpo is not None and objective is None:
        objective = "grpo"
    grpo_raw = None
    if objective == "grpo":
        if not data:
            raise UserError(f"{say(cli='--objective grpo', ui='Objective grpo')}: GRPO generates completions of prompts: "
                            "give the prompts' file.",
                            hint=say(cli="Plan with --data PROMPTS (any supported format: its prompt side is used).",
                                     ui="Choose a data file in the Data tab (its prompt side is used)."))
        grpo_raw = grpo_section(grpo)
    elif grpo is not None:
        raise UserError(f"GRPO settings (rewards) given, but the objective is {objective}.",
                        hint=say(cli="Use --objective grpo, or leave out --reward.", ui="Choose objective grpo."))
    cpu_bytes, cpu_source = _cpu_memory(cpu_memory)
    shape = resolve_shape(model)
    notes: list[str] = []
    profile = None
    label_fraction = 1.0
    reasons: list[str] = []
    if data and objective == "grpo":
        from finetuner.data.stats import profile_prompts

        profile = profile_prompts(data, model, columns=columns)
        notes += profile.notes
    elif data:
        from finetuner.data.picture_files import PictureTooLarge
        from finetuner.data.stats import profile_data, profile_prompts

        try:
            profile = profile_data(data, model, seq_len, columns=columns, max_pixels=max_pixels)
        except PictureTooLarge:
            raise  # what the file holds is not in question: one of its pictures is refused
        except UserError as e:  # a file of prompts alone is GRPO's data: say so rather than what SFT misses
            try:
                profile_prompts(data, model, columns=columns)
            except UserError:
                raise e from None
            raise UserError(f"{data}: holds prompts without responses: that is data for objective grpo (completions "
                            "generated and scored by reward functions), not for sft or a preference objective.",
                            hint=say(cli="Plan it with --objective grpo --reward FILE.py:FUNCTION, or give a file with responses.",
                                     ui="Choose objective grpo and name a reward, or choose a file with responses.")) from None
        objective, why_objective = _objective_for(objective, profile)
        if why_objective:
            reasons.append(why_objective)
        notes += profile.notes
        label_fraction = profile.label_fraction
        instruct = instruct_variant(model) if profile.format == "chat" else None
        if instruct:
            notes.append(f"{model} is a base model, trained to continue text; a chat assistant usually starts from its "
                         f"instruction-tuned variant {instruct} (the same shape: this plan holds for it; plan it with "
                         f"--model {instruct})")
    elif objective not in (None, "sft"):
        raise UserError(f"--objective {objective}: a preference objective needs --data with its pairs (or rated "
                        "responses for kto); there is no default preference data set.",
                        hint="Plan with --data PAIRS.jsonl, e.g. data/preference_sample.jsonl.")
    objective = objective or "sft"
    sizing = size_run(shape, profile, seq_len=seq_len, effective_batch=effective_batch, gpus=gpus, objective=objective,
                      max_new_tokens=grpo_raw["max_new_tokens"] if grpo_raw else 0, epochs=epochs)
    notes += sizing.notes
    expect = expectation(shape, prof.platform)
    if expect:
        notes.append(expect)
    if not data:
        notes.append(
            f"no --data given: the recipe trains on {DEFAULT_DATA} (public instruction data, downloaded from the hub); "
            "to train on your own file, plan with --data FILE or set data.path in the recipe"
        )
    data_path = str(Path(data).expanduser().resolve()) if data and Path(data).expanduser().exists() else data
    device = "cpu" if prof.platform == "cpu" else "auto"
    if not name:
        name, why_name = _free_name(default_run_name(model, data, objective), Path(runs_dir or "runs").expanduser())
        notes += [why_name] if why_name else []
    if max_pixels is None and profile is not None and profile.pixel_budget and profile.largest_picture and seq_len is None:
        return plan_picture_size(asked, profile)
    base = _base_recipe(_recipe_model_name(model), sizing, data_path, name, device, columns, objective, grpo_raw,
                        max_pixels)
    if data_path and Path(data_path).is_file():  # two prompts the run holds out, answered at its end
        from finetuner.planning.sample_prompts import held_out_prompts

        prompts, why_samples = held_out_prompts(base)
        base = base.model_copy(update={"samples": base.samples.model_copy(update={"prompts": prompts})})
        reasons.append(why_samples)
    lengths = profile.lengths if profile is not None else None  # GRPO's: its prompts' (profile_prompts)
    result = plan_recipe(base, prof, shape=shape, margin=margin, method=method, label_fraction=label_fraction, gpus=gpus,
                         cpu_memory=cpu_bytes, cpu_memory_source=cpu_source, price_per_hour=price_per_hour, lengths=lengths,
                         currency=currency)
    result.model = model
    result.notes = notes + result.notes
    if shape.experts and result.fits and result.recipe.method == "qlora" and result.recipe.quantization.bits == 4 \
            and prof.platform != "cpu":
        result.notes.append(experts_loading_note(shape, cpu_bytes))
    scan_note = kernel_note(shape)  # linear attention and state-space layers: the path their speed assumes
    if scan_note:
        result.notes.append(f"{model}: {scan_note}")
    stored = (shape.config.get("quantization_config") or {}).get("quant_method")
    if stored and stored != "bitsandbytes" and result.fits and result.recipe.method == "qlora":
        result.notes.append(f"{model}'s published checkpoint is stored in {stored}: QLoRA quantizes a bf16 checkpoint, so "
                            f"set model.name to a bf16 copy of it (for MXFP4: load it with transformers' "
                            f"Mxfp4Config(dequantize=True) and save_pretrained)")
    result.data = profile.to_dict() if profile else None
    result.optimizer_steps = sizing.total_steps
    if gpus > 1 and result.fits:  # the same job on one card, for the sentence that opens the plan
        from finetuner.planning.cards import headline

        one = plan_recipe(base, prof, shape=shape, margin=margin, method=method, label_fraction=label_fraction,
                          cpu_memory=cpu_bytes, lengths=lengths)
        result.headline = headline(result, one, format_duration)
    for attr in ("recipe", "closest"):
        if getattr(result, attr) is None:
            continue
        lr, why_lr = learning_rate(getattr(result, attr).method, shape, objective)
        raw = getattr(result, attr).to_dict()
        raw["training"]["lr"] = lr
        setattr(result, attr, Recipe.model_validate(raw))
        if attr == "recipe":
            result.reasons += reasons + sizing.reasons + [why_lr]
    result.wait = plan_wait(result, label_fraction, lengths)  # with the steps counted from the data
    cap = sizing.cap
    if cap is not None:
        result.data["length_cap"] = asdict(cap)

    def replan(**changes: Any) -> Plan:  # the same job with a flag changed, as `finetuner plan` plans it
        return plan(**{**asked, **changes, "alternatives": False})

    if cap is not None and result.fits and alternatives:  # what keeping the cut rows costs: planned at `--seq-len <uncapped>`
        at = next(i for i, r in enumerate(result.reasons) if r.startswith(f"sequence {cap.seq}"))
        result.reasons.insert(at + 1, cap.keeping_text(replan(seq_len=cap.uncapped), result, format_duration))
    if alternatives:
        from finetuner.planning.budget import long_run_warning

        warning = long_run_warning(result, replan, format_duration, profile if objective != "grpo" else None)
        result.warnings += [warning] if warning else []
    return result


def picture_sizes(largest: int, fewest: int, most: int) -> list[int]:
    """The picture sizes (most pixels kept) :func:`plan_picture_size` tries, largest first: the data's largest picture
    (no more than the processor's most, no less than its least), then halved until the processor's least."""
    size = max(fewest, min(largest, most))
    sizes = [size]
    while size // 2 >= fewest:
        size //= 2
        sizes.append(size)
    if sizes[-1] > fewest:
        sizes.append(fewest)
    return sizes


def plan_picture_size(asked: dict[str, Any], profile) -> Plan:
    """:func:`plan` for pictures a processor sizes by their pixel count: the largest picture size of
    :func:`picture_sizes` whose plan fits the card and whose longest example fits the model's positions (a picture
    is never cut), the recipe's ``data.max_pixels``, with the image tokens a picture costs at it; the smallest
    one's plan when none fits."""
    fewest, most = profile.pixel_budget
    tried: list[tuple[int, Plan]] = []
    for size in picture_sizes(profile.largest_picture, fewest, most):
        p = plan(**{**asked, "max_pixels": size})
        tried.append((size, p))
        if p.fits and p.data["max_tokens"] <= p.shape.max_position_embeddings:
            break
    size, chosen = tried[-1]
    per_picture = chosen.data["picture_tokens"] / max(1, chosen.data["pictures"])
    if chosen.fits and chosen.data["max_tokens"] <= chosen.shape.max_position_embeddings:
        why = (f"pictures of at most {size:,} pixels (data.max_pixels), {per_picture:.0f} image tokens a picture: "
               + ((f"the processor's least: the data's pictures (the largest {profile.largest_picture:,} pixels) are "
                   "scaled up to it" if profile.largest_picture < fewest else "all the data's pictures at their size")
                  if size >= min(profile.largest_picture, most) and len(tried) == 1
                  else f"the largest size that fits the card and the model's {chosen.shape.max_position_embeddings:,} "
                       f"positions (tried {', '.join(f'{s:,}' for s, _ in tried)})"))
    else:
        why = (f"pictures of at most {size:,} pixels (data.max_pixels, the processor's least), {per_picture:.0f} image "
               f"tokens a picture: no picture size tried fits this card and the model's "
               f"{chosen.shape.max_position_embeddings:,} positions")
    chosen.reasons.insert(0, why)
    return chosen


def compare_cards(model: str, cards: list[str], *, price_per_hour: float | None = None, currency: str | None = None,
                  **kwargs: Any) -> list[dict[str, Any]]:
    """The same job (:func:`plan`'s other arguments) planned on each of ``cards``: per card its
    recipe, peak memory, speed, time (``steps_s`` of the steps, ``wall_s`` of the whole run) and cost
    (``finetuner plan --compare-cards``)."""
    rows = []
    for card in cards:
        prof = get_gpu(card)
        p = plan(model, prof, price_per_hour=price_per_hour, currency=currency, **kwargs)
        c = p.recipe_choice() or {}
        recipe = ""
        if c:
            recipe = (f"{method_name(c['method'], c['quantization_bits'])}, {c['micro_batch_size']} x "
                      f"{c['gradient_accumulation']}, {c['optimizer']}{', checkpointing' if c['gradient_checkpointing'] else ''}"
                      + (", offload" if c["offload_activations"] else ""))
        rows.append({"card": prof.name, "fits": p.fits, "recipe": recipe, "choice": c or None,
                     "peak_gib": round((p.peak_bytes or 0) / GiB, 2), "card_gib": round(prof.memory_gib, 2),
                     "tokens_per_s": p.tokens_per_s, "step_s": p.step_s, "optimizer_steps": p.optimizer_steps,
                     "steps_s": p.steps_s, "wall_s": p.wall_s, "cost": p.cost, "price_per_hour": price_per_hour,
                     "currency": p.currency,
                     "speed_source": p.speed_source, "suggestions": p.suggestions})
    return rows


def plan_recipe(
    recipe: Recipe,
    gpu: str | GpuProfile | None = None,
    *,
    shape: ModelShape | None = None,
    margin: float = DEFAULT_MARGIN,
    method: str | None = None,
    label_fraction: float = 1.0,
    gpus: int = 1,
    cpu_memory: int | None = None,
    cpu_memory_source: str = "",
    speed: DeviceSpeed | None = None,
    price_per_hour: float | None = None,
    lengths: Sequence[int] | None = None,
    currency: str | None = None,
) -> Plan:
    """Resolve the ``auto`` values of a recipe for a card; the values it sets are kept as given.
    ``lengths``: the training rows' token lengths (see :func:`search`).

    ``cpu_memory``: the CPU memory of the machine that runs the ``gpus`` processes (None: not
    checked), and ``cpu_memory_source`` where that figure came from, for the plan's reasons.
    ``speed``: the device's speed figures (default :func:`speed_for`); ``price_per_hour`` (in ``currency``):
    for the cost. The plan's optimizer steps are the recipe's ``training.max_steps`` when set (:func:`plan`
    counts them from the data otherwise), and its :attr:`Plan.wait` the whole run's time when they are known.
    """
    prof = gpu if isinstance(gpu, GpuProfile) else get_gpu(gpu)
    shape = shape or resolve_shape(recipe.model.name, recipe.model.revision)
    speed = speed or speed_for(prof)
    ranked = search(recipe, shape, prof, margin=margin, method=method, label_fraction=label_fraction, gpus=gpus,
                    cpu_memory=cpu_memory, speed=speed, lengths=lengths)
    chunk_note = None
    every_method = method is None and recipe.method == "auto"  # (with one method asked for, a smaller chunk could
    # fit it where the plan of every method took another at the default chunk: the plans would disagree)
    smaller = smaller_loss_chunk(recipe) if every_method and not any(c.fits for c, _ in ranked) else None
    if smaller is not None:  # a large vocabulary's cross-entropy: in smaller chunks before "nothing fits"
        again = search(smaller, shape, prof, margin=margin, method=method, label_fraction=label_fraction, gpus=gpus,
                       cpu_memory=cpu_memory, speed=speed, lengths=lengths)
        if any(c.fits for c, _ in again):
            chunk_note = (f"Cross-entropy {smaller.training.loss_chunk_size} tokens at a time (training.loss_chunk_size): "
                          f"at {recipe.training.loss_chunk_size} the loss over its {shape.vocab_size:,}-token vocabulary "
                          f"would not fit (the smallest option needs "
                          f"{min(c.peak_bytes for c, _ in ranked) / GiB:.1f} GiB); each chunk computes the same loss.")
            recipe, ranked = smaller, again
    fitting = [(c, r) for c, r in ranked if c.fits]
    eff = recipe.training.effective_batch_size
    out = Plan(
        model=recipe.model.name, gpu=prof, shape=shape, recipe=None, estimate=None, tokens_per_s=None,
        seq_len=recipe.data.max_seq_len, effective_batch=eff, candidates_searched=len(ranked), gpus=gpus,
        cpu_memory=cpu_memory, cpu_memory_source=cpu_memory_source, speed_source=speed.source,
        price_per_hour=price_per_hour, optimizer_steps=recipe.training.max_steps, currency=currency, speed=speed,
    )
    busier = note_now(speed)
    if busier:  # the times above are the calibrated machine's
        out.notes.append(f"{busier[0].upper()}{busier[1:]}.")
    gguf = info_for(recipe.model.name)
    if gguf is not None:
        out.notes.append(gguf.note())
    if not fitting:
        if not ranked:
            raise UserError(f"No option divides the effective batch ({eff}) evenly among {gpus} GPUs.",
                            hint="Make the effective batch a multiple of the number of GPUs.")
        smallest, out.closest = min(ranked, key=lambda cr: cr[0].peak_bytes)
        out.estimate = smallest.estimate
        out.sharded = smallest.sharded
        blocked = [c for c, _ in ranked if c.sharded is not None and c.sharded.device_fits and not c.sharded.host_fits]
        if blocked:
            least = min(blocked, key=lambda c: c.sharded.host_bytes_per_machine)
            out.reasons.append(
                f"Does not fit the machine's CPU memory: {least.to_dict()['settings']} fits the cards "
                f"({least.peak_bytes / GiB:.1f} GiB per card) but needs more CPU memory: {least.sharded.host_summary()}; the machine has "
                f"{cpu_memory / GiB:.1f} GiB ({cpu_memory_source or 'as given'})."
            )
        out.reasons.append(
            f"The smallest option ({smallest.to_dict()['settings']}) needs "
            f"{smallest.peak_bytes / GiB:.1f} GiB, the budget is {smallest.estimate.budget_bytes / GiB:.1f} GiB."
        )
        out.suggestions = what_would_fit(recipe, shape, prof, margin, method, label_fraction, gpus, cpu_memory)
        out.rejected = [dict(c.to_dict(), why=_why_rejected(c, smallest)) for c, _ in ranked[:8]]
        return out
    best, best_recipe = fitting[0]
    out.recipe, out.estimate, out.tokens_per_s, out.step = best_recipe, best.estimate, best.tokens_per_s, best.step
    if gpus > 1:
        from finetuner.memory.sharding import compare_strategies

        out.sharded = best.sharded
        out.strategies = [dict(sh.to_dict(), runnable=schema_accepts(with_strategy(best_recipe, sh, gpus)))
                          for sh in compare_strategies(best.estimate, gpus, shape, cpu_memory)]
    out.reasons = _reasons(best, ranked, prof, shape)
    if chunk_note:
        out.reasons.append(chunk_note)
    if best_recipe.objective == "grpo" and best_recipe.grpo is not None:
        out.reasons.append(grpo_room(best_recipe, best.estimate, shape))
    if best.sharded is not None:
        where = f"the machine has {cpu_memory / GiB:.1f} GiB ({cpu_memory_source or 'as given'})" if cpu_memory else "not checked"
        out.reasons.insert(2, f"CPU memory: {best.sharded.host_summary()}; {where}")
    out.rejected = _runners_up(ranked, best)
    out.wait = plan_wait(out, label_fraction, lengths)
    return out


#: the cross-entropy chunk a plan of every method takes when the recipe's (default 1,024 tokens, not set by the user)
#: leaves no option of any method fitting: its loss peak is 16 bytes x chunk x vocabulary (finetuner.memory.model), a
#: quarter of the default's
SMALL_LOSS_CHUNK = 256


def smaller_loss_chunk(recipe: Recipe) -> Recipe | None:
    """``recipe`` with the cross-entropy in :data:`SMALL_LOSS_CHUNK`-token chunks, when its chunk is larger and the user
    did not set it (``training.loss_chunk_size`` absent from the recipe: the default); None otherwise (a plain loss,
    0, is the user's choice too)."""
    t = recipe.training
    if "loss_chunk_size" in t.model_fields_set or not 0 < SMALL_LOSS_CHUNK < t.loss_chunk_size:
        return None
    return recipe.model_copy(update={"training": t.model_copy(update={"loss_chunk_size": SMALL_LOSS_CHUNK})})


def plan_wait(p: Plan, label_fraction: float, lengths: Sequence[int] | None) -> Wait | None:
    """The whole run's wait of a plan's recipe (:func:`run_wait`); None when nothing fits or the steps are unknown."""
    if p.recipe is None or p.step is None or not p.optimizer_steps:
        return None
    return run_wait(p.recipe, p.gpu, p.speed or speed_for(p.gpu), p.step, p.optimizer_steps, label_fraction,
                    shape=p.shape, lengths=lengths)


#: how far a plan searches the largest GRPO group size and completion length (a tiny model fits any)
GRPO_LARGEST_LIMIT = 1 << 17


def grpo_largest(recipe: Recipe, settings: Settings, shape: ModelShape, budget_bytes: int,
                 limit: int = GRPO_LARGEST_LIMIT, card_bytes: int | None = None) -> dict[str, int | None]:
    """The largest ``max_new_tokens`` (``num_generations`` held) and ``num_generations`` (``max_new_tokens``
    held, the generation batch growing with it as the trainer's does) whose GRPO step fits ``budget_bytes``
    with ``settings`` (:func:`finetuner.memory.grpo.largest_fit`; ``card_bytes``: the card's memory, for
    ``grpo.use_vllm``'s share); None when even 1 does not fit, ``limit`` when the search reached it."""
    from finetuner.memory.grpo import largest_fit

    g, top_p = grpo_settings_of(recipe, card_bytes), recipe.grpo.top_p < 1
    out: dict[str, int | None] = {}
    for vary in ("max_new_tokens", "num_generations"):
        best = largest_fit(shape, settings, g, budget_bytes, vary=vary, top_p=top_p, limit=limit, scale_generation_batch=True)
        out[vary] = getattr(best, vary) if best is not None else None
    return out


def grpo_room(recipe: Recipe, est: MemoryEstimate, shape: ModelShape) -> str:
    """The plan's line on what else fits a GRPO run's choice: the largest ``max_new_tokens`` and
    ``num_generations`` (:func:`grpo_largest`) and their ``num_generations × max_new_tokens``."""
    g = recipe.grpo
    big = grpo_largest(recipe, est.settings, shape, est.budget_bytes, card_bytes=est.device_bytes)

    def text(n: int | None) -> str:
        return "none" if not n else f"more than {n - 1:,}" if n >= GRPO_LARGEST_LIMIT else f"{n:,}"

    tokens, gens = big["max_new_tokens"], big["num_generations"]
    return (f"GRPO room on this choice: {g.num_generations} generations of up to {g.max_new_tokens} new tokens "
            f"({g.num_generations * g.max_new_tokens:,} per prompt); the largest that fit are max_new_tokens {text(tokens)} "
            f"at {g.num_generations} generations ({g.num_generations * (tokens or 0):,} tokens per prompt) or num_generations "
            f"{text(gens)} at {g.max_new_tokens} tokens ({(gens or 0) * g.max_new_tokens:,} per prompt)")


def _runners_up(ranked: list[tuple[Candidate, Recipe]], best: Candidate, n: int = 4) -> list[dict[str, Any]]:
    """What the user might have expected instead: per kind of option (method, checkpointing,
    offload), the nearest one ranked above the choice that does not fit, and the best ones that
    fit but rank below it."""
    def kind(c: Candidate) -> tuple:
        return (c.option.method, c.option.quant_bits, c.option.gradient_checkpointing, c.option.activation_offload)

    i_best = next(i for i, (c, _) in enumerate(ranked) if c is best)
    above: dict[tuple, Candidate] = {}
    for c, _ in ranked[:i_best]:
        if kind(c) not in above or c.estimate.total_bytes < above[kind(c)].estimate.total_bytes:
            above[kind(c)] = c
    below: dict[tuple, Candidate] = {}
    for c, _ in ranked[i_best + 1 :]:
        if c.fits and kind(c) not in below:
            below[kind(c)] = c
    picked = list(above.values())[:n] + list(below.values())[:n]
    return [dict(c.to_dict(), why=_why_rejected(c, best)) for c in picked]


def _reasons(best: Candidate, ranked: list[tuple[Candidate, Recipe]], gpu: GpuProfile, shape: ModelShape) -> list[str]:
    o, e = best.option, best.estimate
    speed = (f"at most {format_duration(best.step.step_s)} per step, the rollout included" if "grpo" in e.details and best.step
             else f"~{best.tokens_per_s:,.0f} tokens/s")
    r = [f"{best.to_dict()['settings']}: predicted peak {best.peak_bytes / GiB:.1f} GiB of {gpu.memory_gib:.1f} GiB "
         f"(budget {e.budget_bytes / GiB:.1f}), {speed}"]
    if best.sharded is not None:
        sh = best.sharded
        r.append(f"{sh.label} on {sh.world_size} GPUs: {sh.per_device_bytes / GiB:.1f} GiB per card "
                 f"(one device alone would need {e.total_bytes / GiB:.1f}), ~{sh.comm_bytes_per_step / GiB:.2f} GiB sent "
                 f"per card per step")
    lora_fits = any(c.fits and c.option.method == "lora" for c, _ in ranked)
    if o.method == "qlora":
        smallest_lora = min((c.estimate.total_bytes for c, _ in ranked if c.option.method == "lora"), default=None)
        if smallest_lora is not None and not lora_fits:
            r.append(f"QLoRA: LoRA on a 16-bit base needs at least {smallest_lora / GiB:.1f} GiB; the {o.quant_bits}-bit base "
                     f"({sum(v for k, v in e.components.items() if k.startswith('weights')) / GiB:.1f} GiB) makes room")
    elif o.method == "lora":
        r.append("LoRA on the unquantized base fits, so no quantization (better quality than QLoRA)")
    if o.gradient_checkpointing:
        no_gc = [c for c, _ in ranked if not c.option.gradient_checkpointing and c.option.method == o.method]
        if no_gc and not any(c.fits for c in no_gc):
            r.append("gradient checkpointing on: without it the activations do not fit")
        else:
            r.append("gradient checkpointing on: it allows a larger micro-batch, which is faster here")
    else:
        r.append("no gradient checkpointing: the activations fit, so nothing is recomputed")
    if o.micro_batch > 1 or o.gradient_accumulation > 1:
        r.append(f"micro-batch {o.micro_batch} x accumulation {o.gradient_accumulation} = effective batch "
                 f"{o.micro_batch * o.gradient_accumulation}: the largest micro-batch that fits and is fastest")
    if o.activation_offload:
        plain = [c for c, _ in ranked if c.fits and not c.option.activation_offload and c.option.method == o.method]
        if plain:
            r.append(f"activation offload: layer inputs wait in CPU memory, so micro-batch {o.micro_batch} fits; predicted "
                     f"faster than the best option without offload (~{max(c.tokens_per_s for c in plain):,.0f} tokens/s)")
        else:
            r.append("activation offload: layer inputs wait in CPU memory; without it this does not fit")
    if o.optimizer.startswith("paged"):
        r.append(f"{o.optimizer}: optimizer states page to CPU memory under pressure")
    return r


def what_would_fit(recipe: Recipe, shape: ModelShape, gpu: GpuProfile, margin: float, method: str | None,
                   label_fraction: float, gpus: int = 1, cpu_memory: int | None = None) -> list[str]:
    """When nothing fits: more CPU memory, a shorter sequence, a bigger card, or a smaller model that would
    (GRPO: fewer or shorter completions instead of a shorter sequence, and no several-card plan)."""
    out: list[str] = []
    grpo = recipe.objective == "grpo" and recipe.grpo is not None
    if grpo:
        out += _grpo_would_fit(recipe, shape, gpu, margin, method, label_fraction)
    if cpu_memory is not None:
        ranked = search(recipe, shape, gpu, margin, method, label_fraction, gpus, None)
        need = min((c.sharded.host_bytes_per_machine for c, _ in ranked if c.fits and c.sharded is not None), default=None)
        if need is not None:
            out.append(f"more CPU memory: a machine with {need / GiB:.1f} GiB of it fits on {gpus} x {gpu.name} "
                       f"(--cpu-memory SIZE plans for another machine)")
    seq = recipe.data.max_seq_len
    s = seq // 2
    while s >= 128 and not grpo:
        shorter = recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_seq_len": s})})
        if any(c.fits for c, _ in search(shorter, shape, gpu, margin, method, label_fraction, gpus, cpu_memory)):
            out.append(f"a shorter sequence: {s} tokens fits on {gpu.name} (examples longer than that are truncated)")
            break
        s //= 2
    for card in list_profiles():
        if card.memory_bytes <= gpu.memory_bytes or card.platform != "cuda":
            continue
        if any(c.fits for c, _ in search(recipe, shape, card, margin, method, label_fraction, gpus, cpu_memory)):
            out.append(f"a bigger card: {card.name} ({card.memory_gib:.0f} GiB) fits this recipe")
            break
    smaller = sorted((p for p in presets() if p.num_params < shape.num_params), key=lambda p: -p.num_params)
    for p in smaller:
        trial = recipe.model_copy(update={"model": recipe.model.model_copy(update={"name": p.name})})
        if any(c.fits for c, _ in search(trial, p, gpu, margin, method, label_fraction, gpus, cpu_memory)):
            out.append(f"a smaller model: {p.name} ({p.num_params / 1e9:.1f}B) fits on {gpu.name}")
            break
    if gpus == 1 and not grpo:
        for n in (2, 4, 8):
            if any(c.fits for c, _ in search(recipe, shape, gpu, margin, method, label_fraction, n, cpu_memory)):
                out.append(f"several cards: {n} x {gpu.name} with a sharded strategy (finetuner plan --gpus {n})")
                break
    if not out:
        out.append("no shorter sequence, bigger card, smaller preset or up to 8 cards fits")
    return out


def _grpo_would_fit(recipe: Recipe, shape: ModelShape, gpu: GpuProfile, margin: float, method: str | None,
                    label_fraction: float) -> list[str]:
    """For a GRPO recipe nothing fits: the group size and completion length that would, on the option
    that needs the least memory."""
    ranked = search(recipe, shape, gpu, margin, method, label_fraction)
    if not ranked:
        return []
    smallest, r = min(ranked, key=lambda cr: cr[0].peak_bytes)
    big = grpo_largest(r, smallest.estimate.settings, shape, smallest.estimate.budget_bytes, card_bytes=gpu.memory_bytes)
    g, out = recipe.grpo, []
    if big["num_generations"] and big["num_generations"] >= 2:
        out.append(f"fewer completions: num_generations {big['num_generations']} (of {g.max_new_tokens} tokens) fits on "
                   f"{gpu.name} with {smallest.option.label}")
    if big["max_new_tokens"]:
        out.append(f"shorter completions: max_new_tokens {big['max_new_tokens']} (with {g.num_generations} generations) fits "
                   f"on {gpu.name} with {smallest.option.label}")
    return out


def resolve_auto(recipe: Recipe, gpu: GpuProfile, label_fraction: float = 1.0, shape: ModelShape | None = None) -> Plan:
    """Resolve a recipe's ``auto`` values for the device a run is on (``finetuner run``); ``shape``: the recipe's
    model when the caller resolved it already.

    Raises a UserError with the planner's suggestions when nothing fits.
    """
    prof = _recipe_file_profile(recipe) if recipe.objective != "grpo" else None
    result = plan_recipe(recipe, gpu, shape=shape, label_fraction=label_fraction, lengths=prof[1] if prof else None)
    if result.recipe is None:
        raise UserError(
            f"No setting of {', '.join(recipe.auto_keys())} fits {recipe.model.name} on {gpu.name} "
            f"({gpu.memory_gib:.1f} GiB): {result.reasons[0]}",
            hint="What would fit: " + "; ".join(result.suggestions),
        )
    return result




@functools.lru_cache(maxsize=16)
def _file_profile(path: str, mtime_ns: int, size: int, model: str, fmt: str,
                  columns: tuple[tuple[str, str], ...], prompts: bool = False,
                  chat_template: str | None = None) -> tuple[float, tuple[int, ...], int]:
    """``(label fraction, token lengths, rows that cannot be used)`` of a data file, once per file version; with
    ``prompts`` its prompts' lengths, read as the GRPO trainer reads them (:func:`finetuner.data.stats.profile_prompts`)."""
    from finetuner.data.stats import profile_data, profile_prompts

    if prompts:
        p = profile_prompts(path, model, columns=dict(columns) or None, chat_template=chat_template)
        return 1.0, tuple(p.lengths), p.bad_rows
    p = profile_data(path, model, fmt=fmt, columns=dict(columns) or None, chat_template=chat_template)
    return p.label_fraction, tuple(p.lengths), p.bad_rows


def _recipe_file_profile(recipe: Recipe, file: str | None = None,
                         prompts: bool | None = None) -> tuple[float, tuple[int, ...], int] | None:
    """:func:`_file_profile` of the recipe's one local data file (or of ``file``, read as the recipe reads
    its data), None when it has none readable here. ``prompts``: its prompts' lengths, as the GRPO trainer
    reads them; by default for a GRPO recipe."""
    if prompts is None:
        prompts = recipe.objective == "grpo"
    d = recipe.data
    file = d.path if file is None else file
    if not isinstance(file, str) or not Path(file).expanduser().is_file():
        return None
    path = Path(file).expanduser().resolve()
    st = path.stat()
    try:
        return _file_profile(str(path), st.st_mtime_ns, st.st_size, recipe.model.name, d.format,
                             tuple(sorted((d.columns or {}).items())), prompts, d.chat_template)
    except (UserError, OSError, ValueError):  # unreadable here: the trainer reports its rows
        return None


def data_batch_of(recipe: Recipe) -> BatchShape | None:
    """The recipe's average micro-batch from its data's token lengths (:mod:`finetuner.planning.lengths`),
    measured as :func:`label_fraction_of` measures them (cached per file version); for GRPO its prompts as
    a step's rollout pads them (:func:`lengths_batch`). None when the data is
    not one local file readable here (the speed model then takes every row, or prompt, at its longest)."""
    prof = _recipe_file_profile(recipe)
    t = recipe.training
    if prof is None or not prof[1] or not isinstance(t.micro_batch_size, int) or not isinstance(t.gradient_accumulation, int):
        return None
    return lengths_batch(recipe, prof[1], t.micro_batch_size, t.gradient_accumulation, source=str(recipe.data.path))


def lengths_batch(recipe: Recipe, lengths: Sequence[int], micro_batch: int, gradient_accumulation: int,
                  source: str = "data") -> BatchShape:
    """The average micro-batch of ``micro_batch`` rows of data with these token ``lengths``
    (:func:`~finetuner.planning.lengths.batch_shape`), or for GRPO, whose ``lengths`` are its prompts', a
    step's ``micro_batch × gradient_accumulation`` prompts as its rollout pads them
    (:func:`~finetuner.planning.lengths.prompt_batch`)."""
    d = recipe.data
    if recipe.objective == "grpo":
        return prompt_batch(lengths, micro_batch * gradient_accumulation, max_prompt_len(recipe), source)
    return batch_shape(lengths, micro_batch, d.max_seq_len, bool(d.packing), source=source)


def max_prompt_len(recipe: Recipe) -> int:
    """A GRPO recipe's longest prompt: ``data.max_seq_len − grpo.max_new_tokens`` (the trainer refuses longer)."""
    return recipe.data.max_seq_len - recipe.grpo.max_new_tokens


def label_fraction_of(recipe: Recipe) -> float:
    """The share of the recipe's tokens that carry a label, measured from its data as :func:`plan`
    measures it (:func:`finetuner.data.stats.profile_data` on ``data.path`` with the recipe's model,
    format and ``data.columns``; cached per file version): the plan, ``estimate``, ``auto``
    resolution, the trainer's predictions and the web UI's estimate all use it. 1.0 (every token, the
    upper bound) with ``data.train_on_prompt``, or when the data is not one local file readable here."""
    if recipe.data.train_on_prompt:
        return 1.0
    prof = _recipe_file_profile(recipe, prompts=False)  # the file's supervised rows, for GRPO too
    return 1.0 if prof is None else prof[0]  # unreadable here: the upper bound


def held_out_of(recipe: Recipe) -> int | None:
    """The held-out rows a run of the recipe evaluates, as the trainer splits them: the rows of
    ``data.val_path``, else ``data.val_size`` of the data file's rows
    (:func:`~finetuner.data.split.held_out_rows`); None when the file cannot be read here."""
    d = recipe.data
    if d.val_path:
        prof = _recipe_file_profile(recipe, d.val_path)
        return len(prof[1]) if prof is not None else None
    prof = _recipe_file_profile(recipe)
    return held_out_rows(d.val_size, len(prof[1])) if prof is not None else None


def training_rows(recipe: Recipe) -> int | None:
    """The rows (GRPO: prompts) a run of the recipe trains on, as the trainer takes them: the data file's usable
    rows up to ``data.max_examples``, less the held-out rows (none with ``data.val_path``), plus ``data.replay``'s
    answers. None when the file cannot be read here, holds more rows than a profile counts
    (:data:`~finetuner.data.stats.MAX_ROWS`: then only a lower bound is known), or holds rows the run stops at
    (``data.on_bad_row: error``: the run's own message names them)."""
    from finetuner.data.stats import MAX_ROWS

    prof = _recipe_file_profile(recipe)
    if prof is None or not prof[1] or len(prof[1]) >= MAX_ROWS or (prof[2] and recipe.data.on_bad_row == "error"):
        return None
    train = user_training_rows(recipe, len(prof[1]))
    return train + replayed_rows(recipe, train) if train > 0 else None


def user_training_rows(recipe: Recipe, rows: int) -> int:
    """The user's rows a run trains on of a data file of ``rows`` usable rows: up to ``data.max_examples``, less the
    held-out rows (none with ``data.val_path``); ``data.replay``'s answers are a share of these."""
    d = recipe.data
    rows = min(rows, d.max_examples or rows)
    return rows - (0 if d.val_path else held_out_rows(d.val_size, rows))


def replayed_rows(recipe: Recipe, train_rows: int) -> int:
    """The base model's answers ``data.replay`` mixes into ``train_rows`` training rows (0 without replay)."""
    if not recipe.data.replay:
        return 0
    from finetuner.data.replay import load_prompts, replay_count

    return replay_count(recipe.data.replay, train_rows, len(load_prompts()))


def run_wait(recipe: Recipe, gpu: GpuProfile, speed: DeviceSpeed, step: StepTime, steps: int | None,
             label_fraction: float = 1.0, *, shape: ModelShape | None = None, runtime: Any = None,
             lengths: Sequence[int] | None = None, loaded_as: tuple[bool, bool] | None = None,
             replay_cached: bool | None = None) -> Wait | None:
    """The whole run's predicted wait (:func:`finetuner.planning.wait.recipe_wait`: download, load, replay, steps,
    evaluations, checkpoints, probe, samples) of a resolved recipe whose step takes ``step``, over ``steps``
    optimizer steps (None: unknown, and so is the wait). The plan, ``estimate``, the trainer's ``start``
    event and the web UI all take it from here. The held-out rows and the evaluations' micro-batches come
    from the data's token ``lengths`` when the caller has them (a plan's data profile), else from the
    recipe's data file (:func:`held_out_of`, :func:`data_batch_of`). ``loaded_as``: whether the model was to be
    downloaded and converted when the run began (:func:`finetuner.planning.wait.first_load`; a run's own prediction);
    ``replay_cached``: whether ``data.replay``'s answers came from its cache (a run's own record). ``data.replay``
    counts its prompts from the data's rows (:func:`user_training_rows`)."""
    if not steps:
        return None
    shape = shape or resolve_shape(recipe.model.name, recipe.model.revision)
    s = settings_from_recipe(recipe, gpu, shape.model_type, runtime=runtime).with_(label_fraction=label_fraction)
    d, t, grpo = recipe.data, recipe.training, recipe.objective == "grpo"
    source = "data"
    if not lengths:
        prof = _recipe_file_profile(recipe)
        lengths, source = (prof[1], str(d.path)) if prof is not None else (None, source)
    if lengths:
        held_out = held_out_of(recipe) if d.val_path else held_out_rows(d.val_size, len(lengths))
        batch = lengths_batch(recipe, lengths, t.micro_batch_size, t.gradient_accumulation, source)
    else:
        held_out, batch = held_out_of(recipe), None
    # GRPO's evaluation samples every held-out prompt's group at once: padded to the longest of them
    # (with data.val_path, taken from the training prompts' lengths)
    eval_prompts = prompt_batch(lengths, held_out, max_prompt_len(recipe), source) if grpo and lengths and held_out else None
    return recipe_wait(recipe, shape, s, speed, step, steps, held_out=held_out, batch=batch, eval_prompts=eval_prompts,
                       loaded_as=loaded_as, train_rows=user_training_rows(recipe, len(lengths)) if lengths else None,
                       replay_cached=replay_cached)


def resolve_for_run(recipe: Recipe, resume: bool = True) -> tuple[Recipe, Plan | None]:
    """The recipe a run starts with: ``auto`` values resolved for the device it runs on.

    A run folder that already holds a resolved recipe with checkpoints keeps its values (a resume
    continues with the same micro-batch, after any out-of-memory back-off); otherwise the planner
    chooses for the detected GPU, or for the CPU (80 % of its RAM) when there is none.
    """
    from finetuner.config.hardware import run_profile
    from finetuner.config.recipe import Recipe
    from finetuner.config.recipe_yaml import load_yaml

    if not recipe.auto_keys():
        return recipe, None
    saved = recipe.output_path() / "recipe.yaml"
    if resume and saved.is_file() and any((recipe.output_path() / "checkpoints").glob("step-*")):
        old = load_yaml(saved.read_text(encoding="utf-8"), str(saved)) or {}
        raw = recipe.to_dict()
        for key in recipe.auto_keys():
            node_new, node_old = raw, old
            *parents, leaf = key.split(".")
            for part in parents:
                node_new, node_old = node_new[part], node_old.get(part, {})
            if leaf in node_old:
                node_new[leaf] = node_old[leaf]
        if "quantization" in old and raw.get("method") == "qlora":
            raw["quantization"] = old["quantization"]
        raw["training"]["effective_batch"] = None
        resolved = Recipe.model_validate(raw)
        if not resolved.auto_keys():
            return resolved, None
    result = resolve_auto(recipe, run_profile(recipe.device), label_fraction=label_fraction_of(recipe))
    return Recipe.model_validate(result.recipe.to_dict()), result


def lengths_text(recipe: Recipe, batch: BatchShape | None) -> str:
    """What ``estimate`` says of the lengths it timed: the data's (``batch``), or the longest."""
    if batch is None:
        if recipe.objective == "grpo":
            return ("every prompt taken as data.max_seq_len - grpo.max_new_tokens tokens long and every completion as "
                    "grpo.max_new_tokens (the data file cannot be read here): an upper bound")
        return "every row taken as data.max_seq_len tokens long (the data file cannot be read here): an upper bound"
    if recipe.objective == "grpo":
        return (f"the prompts of {batch.source}: {batch.real_per_row:.0f} tokens a prompt, {batch.padded_len:.0f} "
                f"positions a generate call's; completions at their longest ({recipe.grpo.max_new_tokens} tokens)")
    return (f"the rows of {batch.source}: {batch.padded_len:.0f} positions a micro-batch row, "
            f"{batch.real_per_row:.0f} of them tokens")


def run_optimizer_steps(recipe: Recipe) -> int | None:
    """The optimizer steps ``finetuner run`` takes for a resolved recipe, counted as the trainer counts
    them (:func:`finetuner.planning.sizing.optimizer_steps`): ``training.max_steps``, else the epochs
    over the training rows left after the held-out split (:func:`~finetuner.data.split.held_out_rows`)
    of the data file, as :func:`plan` counts them. None when the data cannot be read here (a hub data
    set). Packed data are counted by packing the examples' lengths as the trainer packs them
    (:func:`~finetuner.data.split.count_packed_rows`)."""
    from finetuner.data.split import count_packed_rows
    from finetuner.planning.sizing import optimizer_steps

    t = recipe.training
    if t.max_steps:
        return t.max_steps
    d = recipe.data
    if not d.path or not isinstance(d.path, str) or not Path(d.path).expanduser().is_file():
        return None
    from finetuner.data.stats import profile_data, profile_prompts

    try:
        if recipe.objective == "grpo":  # its rows are prompts, read as the GRPO trainer reads them
            profile = profile_prompts(str(Path(d.path).expanduser()), recipe.model.name, columns=d.columns,
                                      on_bad_row=d.on_bad_row, system_prompt=d.system_prompt)
        else:
            profile = profile_data(str(Path(d.path).expanduser()), recipe.model.name, fmt=d.format, columns=d.columns,
                                   on_bad_row=d.on_bad_row, system_prompt=d.system_prompt, thinking=d.thinking)
    except (UserError, OSError, ValueError):
        return None
    rows = profile.rows
    n_val = 0 if d.val_path else held_out_rows(d.val_size, rows)
    packing = d.packing if isinstance(d.packing, bool) else profile.should_pack(d.max_seq_len)
    units = count_packed_rows(profile.lengths, n_val, d.max_seq_len, t.seed) if packing else rows - n_val
    units += replayed_rows(recipe, rows - n_val)  # the base's answers (finetuner.data.replay); packed, each a row: at most
    return optimizer_steps(None, t.epochs, max(1, units), t.effective_batch_size)

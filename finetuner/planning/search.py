"""The planner's search: every option a recipe leaves open, estimated and ranked.

The settings that decide memory — method (LoRA, QLoRA 4-bit or 8-bit, full when asked for), optimizer,
gradient checkpointing, activation offload, micro-batch and gradient accumulation (their product stays
the effective batch) — are each asked of the memory model (:mod:`finetuner.memory.model`) for their
peak; those under the card's memory less a safety margin fit, and :meth:`Candidate.sort_key` ranks them:

1. **quality first**: full fine-tuning (only when asked for) > LoRA on a bf16 base > LoRA on a
   quantized base (QLoRA): a better method that fits always wins over a faster worse one;
2. **then predicted throughput** (:func:`predicted_tokens_per_s`: the speed model of
   :mod:`finetuner.planning.speed`, with this machine's calibration or the card's data sheet);
3. then the optimizer with full-precision states, then the plain (not paged) one, then no
   offload, then the larger headroom.

With several GPUs each option is also split over them by the best strategy the recipe's schema
accepts (:func:`schema_error`; :mod:`finetuner.memory.sharding`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetuner.errors import UserError
from finetuner.config.hardware import GpuProfile
from finetuner.device import CUDA
from finetuner.memory.grpo import ROLLOUT
from finetuner.memory.model import MemoryEstimate, Settings
from finetuner.memory.sharding import distributed_keys
from finetuner.model.shapes import ModelShape
from finetuner.objectives.specs import spec_of
from finetuner.planning.calibrate import speed_for
from finetuner.planning.candidate import candidate_memory
from finetuner.planning.recipe_data import lengths_batch
from finetuner.planning.speed import DeviceSpeed, StepTime, step_time
from finetuner.planning.recipe_speed import recipe_step_time
from finetuner.strategy_table import DEFAULT

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe


#: Fraction of the card kept free on top of the memory model's own allowances.
DEFAULT_MARGIN = 0.05

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
#: the ``--method`` values (the UI's Method menu, ``finetuner.plan``'s ``method``) besides auto
METHODS = ("lora", "qlora", "qlora4", "qlora8", "full", "any")


def asked_method(method: str | None) -> str | None:
    """The method a plan is asked for, whatever the front: None when none is (``None``, ``auto`` or empty: the CLI's
    ``--method auto``, the UI's menu and the API's default are the same plan), else the value, lower-cased and checked.
    Every search (:func:`search`, :func:`~finetuner.planning.planner.plan_recipe`) reads its ``method`` through it."""
    m = (method or "").strip().lower()
    if m in ("", "auto"):
        return None
    if m not in METHODS + ("qlora-4bit", "qlora-8bit"):
        raise UserError(f"--method {method!r}: use auto, {', '.join(METHODS[:-1])} or {METHODS[-1]}.")
    return m


def method_options(method: str | None) -> list[tuple[str, int | None]]:
    """The (method, quantization bits) pairs a ``--method`` value searches (``plan``, ``plan --longest``)."""
    method = asked_method(method)
    if method is None:
        return [("lora", None), ("qlora", 4), ("qlora", 8)]
    if method == "qlora":
        return [("qlora", 4), ("qlora", 8)]
    if method in ("qlora4", "qlora-4bit"):
        return [("qlora", 4)]
    if method in ("qlora8", "qlora-8bit"):
        return [("qlora", 8)]
    if method in ("lora", "full"):
        return [(method, None)]
    return [("full", None), ("lora", None), ("qlora", 4), ("qlora", 8)]  # any


def _optimizers(method: str, fixed: str | None, platform: str = CUDA) -> list[str]:
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
    method = asked_method(method)
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
    grpo = spec_of(base.objective).generates and base.grpo is not None
    if grpo and gpus > 1:
        raise UserError(f"{gpus} GPUs: the plan of a GRPO run is made for one card.",
                        hint="Plan for one card: with distributed.strategy ddp each of the N cards holds what one card "
                             "holds in that plan (each process generates and trains on its share of the prompts).")
    if grpo and base.grpo.beta:  # the reference is the base with the adapter off: full fine-tuning has none
        methods = [m for m in methods if m[0] != "full"] or methods
    gcs = [False, True] if t.gradient_checkpointing == "auto" else [bool(t.gradient_checkpointing)]
    out: list[tuple[Candidate, Recipe]] = []
    for m, bits in methods:
        for opt in _optimizers(m, t.optimizer if t.optimizer != "auto" else None, gpu.platform):
            for gc in gcs:
                offloads = [False, True] if (t.offload_activations == "auto" and gc and gpu.platform == CUDA) else (
                    [bool(t.offload_activations)] if t.offload_activations != "auto" else [False])
                for off in offloads:
                    for mb, ga in _micro_batches(eff, t.micro_batch_size, t.gradient_accumulation):
                        if gpus > 1 and ga % gpus:
                            continue
                        o = Option(m, bits, opt, gc, off, mb, ga)
                        recipe = _apply(base, o)
                        # the same memory as the chosen recipe's prediction (predict())
                        s, est, _ = candidate_memory(recipe, shape, gpu, label_fraction=label_fraction, margin=margin)
                        sharded = None
                        if gpus > 1:
                            sharded, recipe = _strategy_for(recipe, est, shape, gpus, cpu_memory, refused)
                            fits = sharded.fits
                        else:
                            fits = est.total_bytes <= (est.budget_bytes or est.total_bytes)
                            if grpo:  # and vLLM's share (grpo.use_vllm) holds its weights and a sequence's KV cache
                                fits = fits and est.details[ROLLOUT]["vllm_fits"]
                        batch = lengths_batch(recipe, lengths, mb, ga) if lengths else None
                        st = recipe_step_time(recipe, gpu, speed, shape=shape, est=est, batch=batch, settings=s,
                                              sharded=sharded)  # as predict() times the chosen one
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
    why = errors.get(DEFAULT) or next(iter(errors.values()))
    raise UserError(f"No distributed strategy can run this recipe on {gpus} GPUs: {why}",
                    hint="Change what the message names, or plan for one GPU.")

"""The planner's answer, :class:`Plan`: a runnable recipe, its memory estimate, time, cost and reasons, and its
forms: a dictionary (``finetuner plan --json``), the recipe as YAML with a header that says where it came from,
a one-line summary and a notebook's HTML."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetuner.errors import UserError
from finetuner.objectives.specs import spec_of
from finetuner.config.hardware import GpuProfile
from finetuner.memory.model import MemoryEstimate
from finetuner.memory.sharding import distributed_keys, recipe_offload
from finetuner.model.shapes import ModelShape
from finetuner.planning.speed import DeviceSpeed, StepTime
from finetuner.planning.time_text import time_text
from finetuner.planning.wait import Wait, cost_of
from finetuner.units import duration_text, gib_text

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe


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
        grpo = self.recipe is not None and spec_of(self.recipe.objective).generates
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
            f"# predicted peak {gib_text(self.peak_bytes, 1)}{' per device' if self.gpus > 1 else ''}, "
            f"~{self.tokens_per_s:,.0f} tokens/s, {duration_text(self.step_s)} per step (speed model: {self.speed_source}).",
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
            f"{gib_text(self.peak_bytes, 1, unit=False)} of {self.gpu.memory_gib:.1f} GiB{' per device' if self.gpus > 1 else ''})"
        )

    def _repr_html_(self) -> str:
        import html

        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>{gib_text(v, 2, unit=False)}</td></tr>"
            for k, v in (self.estimate.components.items() if self.estimate else [])
        )
        reasons = "".join(f"<li>{html.escape(r)}</li>" for r in self.reasons + self.suggestions)
        return (
            f"<b>{html.escape(self.summary())}</b><ul>{reasons}</ul>"
            f"<table><tr><th>component</th><th>GiB</th></tr>{rows}</table>"
        )


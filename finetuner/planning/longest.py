"""The longest sequence a card can train, by the memory model (``finetuner plan --longest``).

For a model, a card and a method, :func:`longest_sequence` asks the memory model
(:func:`finetuner.memory.model.estimate`) for micro-batch 1 and finds, by bisection over the
sequence length, the longest sequence whose predicted peak stays within the card's memory less
the safety margin — the planner's own test (``total_bytes <= budget_bytes``, paged optimizer
states counted). It does so for every memory-saving setting the trainer has, and keeps the one
that reaches furthest:

* gradient checkpointing (``training.gradient_checkpointing``) on or off;
* activation offload (``training.offload_activations``, CUDA only): with checkpointing each
  layer's input waits in pinned CPU memory (:mod:`finetuner.model.offload`), without it every
  saved activation does (``save_on_cpu``);
* the optimizer: AdamW with fp32 states or bitsandbytes' paged 8-bit AdamW;
* the loss: finetuner's chunked cross-entropy (``training.kernels: none``), or Liger's fused
  linear cross-entropy (``training.kernels: liger``) where Liger can run for the card and the
  architecture;
* the MLP whole or tiled (``training.tiled_mlp``, :mod:`finetuner.model.tiled_mlp`): in chunks of
  2,048 tokens, each recomputed in backward, so a layer's backward holds one chunk's MLP tensors
  instead of the whole sequence's (predicted by the memory model, not yet measured on a GPU);
* for ``qlora`` the 4-bit and the 8-bit base.

Among settings that reach the same length the simpler one is kept (listed first in
:func:`_candidates`: no checkpointing, no offload, fp32 AdamW, chunked loss, untiled MLP, LoRA
before QLoRA, 4-bit before 8-bit). LoRA keeps the recipe's rank (16) and no dropout (a dropout mask and a
copy of each adapted input would be saved for backward in every layer); the loss is computed on
every token (the upper bound of the labelled share).

The answer never exceeds the model's positions (``max_position_embeddings``); when that is what
stops it, :attr:`LongestSequence.capped` says so. Otherwise :attr:`LongestSequence.bound` says
which component of the peak grows with the sequence and by how many bytes per token (a finite
difference of the estimate just below the answer), and the fixed part the line starts from.

Pure arithmetic, no torch: it answers in well under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from finetuner.config.hardware import GpuProfile, get_gpu
from finetuner.device import CUDA
from finetuner.errors import UserError
from finetuner.memory.model import MemoryEstimate, Settings, activation_bytes, estimate, settings_from_recipe
from finetuner.model.shapes import ModelShape, resolve_shape
from finetuner.planning.search import DEFAULT_MARGIN, method_name, method_options
from finetuner.units import gib_text

#: The shortest sequence a recipe allows (``data.max_seq_len``).
MIN_SEQ = 16
#: LoRA settings assumed: the recipe's rank, no dropout.
DEFAULT_LORA_R = 16
DEFAULT_LORA_DROPOUT = 0.0


@dataclass(frozen=True)
class Candidate:
    """One combination of memory settings (a point of the search)."""

    method: str
    quant_bits: int | None
    gradient_checkpointing: bool
    offload_activations: bool
    optimizer: str
    kernels: str  # "none": chunked loss; "liger": fused linear cross-entropy
    tiled_mlp: bool = False  # the MLP in chunks (training.tiled_mlp: true)

    @property
    def label(self) -> str:
        parts = [method_name(self.method, self.quant_bits), "checkpointing" if self.gradient_checkpointing else "no checkpointing"]
        if self.offload_activations:
            parts.append("activation offload")
        parts.append(self.optimizer)
        parts.append("fused linear cross-entropy (Liger)" if self.kernels == "liger" else "chunked cross-entropy")
        if self.tiled_mlp:
            parts.append("tiled MLP")
        return ", ".join(parts)


@dataclass
class LongestSequence:
    """The answer of :func:`longest_sequence`. Bytes everywhere; ``max_seq`` 0 when nothing fits."""

    model: str
    gpu: GpuProfile
    method: str  # as asked
    max_seq: int
    positions: int  # the model's max_position_embeddings
    capped: bool  # the positions, not the memory, stop it
    step: int
    margin: float
    candidate: Candidate | None  # the settings that reach max_seq
    settings: Settings | None
    estimate: MemoryEstimate | None  # the peak at max_seq
    next_estimate: MemoryEstimate | None  # the peak at max_seq + step (None when capped)
    bytes_per_token: dict[str, float] = field(default_factory=dict)  # growth of each component
    fixed_bytes: int = 0  # the total's intercept: total(max_seq) - slope * max_seq
    layer_terms: list[tuple[str, float]] = field(default_factory=list)  # one decoder layer's saved tensors, bytes per token
    considered: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.max_seq > 0

    @property
    def total_bytes_per_token(self) -> float:
        return sum(self.bytes_per_token.values())

    @property
    def bound(self) -> dict[str, Any]:
        """What stops the sequence: the positions, or the memory component that grows fastest."""
        if not self.fits:
            smallest = min(self.considered, key=lambda c: c["bytes_at_min_seq"]) if self.considered else None
            return {"kind": "nothing fits",
                    "text": f"even {MIN_SEQ} tokens do not fit: the smallest option needs "
                            f"{gib_text(smallest['bytes_at_min_seq'], 1)} of the {gib_text(self.budget_bytes, 1)} budget"
                    if smallest else "nothing was tried"}
        if self.capped:
            return {"kind": "positions",
                    "text": f"the model's positions: max_position_embeddings = {self.positions:,}; at that length the "
                            f"peak is {gib_text(self.estimate.total_bytes, 1)} of the {gib_text(self.budget_bytes, 1)} budget"}
        comp, per_tok = max(self.bytes_per_token.items(), key=lambda kv: kv[1])
        layer = sum(b for _, b in self.layer_terms)
        top = sorted(self.layer_terms, key=lambda t: -t[1])[:4]
        return {"kind": "memory", "component": comp, "bytes_per_token": round(per_tok, 1),
                "total_bytes_per_token": round(self.total_bytes_per_token, 1), "fixed_bytes": self.fixed_bytes,
                "layer_saved_bytes_per_token": round(layer, 1),
                "largest_layer_terms": [{"what": n, "bytes_per_token": round(b, 1)} for n, b in top],
                "text": f"memory: '{comp}' grows by {per_tok / 1e3:,.1f} KB per token (all components together "
                        f"{self.total_bytes_per_token / 1e3:,.1f} KB per token above {gib_text(self.fixed_bytes)}); "
                        f"{self.max_seq + self.step:,} tokens would need {gib_text(self.next_estimate.total_bytes)}, "
                        f"over the {gib_text(self.budget_bytes)} budget. One decoder layer saves "
                        f"{layer / 1e3:,.1f} KB per token for backward, most in: "
                        + ", ".join(f"{n} {b / 1e3:,.1f} KB" for n, b in top)}

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu.memory_bytes * (1 - self.margin))

    def recipe_values(self) -> dict[str, Any] | None:
        """The recipe keys the answer assumes (micro-batch 1)."""
        c = self.candidate
        if c is None:
            return None
        out: dict[str, Any] = {
            "method": c.method,
            "data.max_seq_len": self.max_seq,
            "training.micro_batch_size": 1,
            "training.gradient_checkpointing": c.gradient_checkpointing,
            "training.offload_activations": c.offload_activations,
            "training.optimizer": c.optimizer,
            "training.kernels": c.kernels,
            "training.tiled_mlp": c.tiled_mlp,
            "training.loss_chunk_size": self.settings.loss_chunk if self.settings else None,
        }
        if c.method != "full":
            out["lora.r"] = self.settings.lora_r
            out["lora.dropout"] = self.settings.lora_dropout
        if c.method == "qlora":
            out["quantization.bits"] = c.quant_bits
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": self.gpu.name,
            "device_bytes": self.gpu.memory_bytes,
            "budget_bytes": self.budget_bytes,
            "margin": self.margin,
            "method": self.method,
            "fits": self.fits,
            "max_seq": self.max_seq,
            "positions": self.positions,
            "capped_by_positions": self.capped,
            "step": self.step,
            "settings": self.candidate.label if self.candidate else None,
            "recipe": self.recipe_values(),
            "bound": self.bound,
            "bytes_per_token": {k: round(v, 1) for k, v in self.bytes_per_token.items()},
            "total_bytes": self.estimate.total_bytes if self.estimate else None,
            "host_offload_bytes": self.estimate.offloaded_bytes if self.estimate else 0,
            "components": dict(self.estimate.components) if self.estimate else None,
            "considered": self.considered,
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        if not self.fits:
            return f"{self.model} ({self.method}) does not train on {self.gpu.name} at any length: {self.bound['text']}"
        cap = " (capped by the model's positions)" if self.capped else ""
        return f"{self.model} on {self.gpu.name}: {self.max_seq:,} tokens{cap} with {self.candidate.label}; bound: {self.bound['text']}"


def _liger_possible(shape: ModelShape, gpu: GpuProfile) -> bool:
    from finetuner.config.runtime import Device
    from finetuner.model.kernels import LIGER_MODEL_TYPES

    return Device.of(gpu).liger and shape.model_type in LIGER_MODEL_TYPES


def _candidates(method: str, shape: ModelShape, gpu: GpuProfile, *, gradient_checkpointing: bool | None,
                offload_activations: bool | None, optimizer: str | None, kernels: str | None,
                tiled_mlp: bool | None = None) -> list[Candidate]:
    """Every combination left open, simplest first."""
    cuda = gpu.platform == CUDA
    gcs = [False, True] if gradient_checkpointing is None else [gradient_checkpointing]
    offs = ([False, True] if cuda else [False]) if offload_activations is None else [offload_activations]
    # simplest first: no checkpointing, checkpointing, offloaded checkpointing, then every saved
    # activation offloaded (``save_on_cpu``: the most PCIe traffic)
    order = [(False, False), (True, False), (True, True), (False, True)]
    memory = [(gc, off) for gc, off in order if gc in gcs and off in offs]
    if offload_activations and not cuda:
        raise UserError("activation offload moves activations from a CUDA card to CPU memory: the CPU has none to offload.")
    if kernels is None:
        kerns = ["none", "liger"] if _liger_possible(shape, gpu) else ["none"]
    elif kernels in ("none", "liger"):
        kerns = [kernels]
    else:
        raise UserError(f"kernels {kernels!r}: use none (chunked cross-entropy) or liger (fused linear cross-entropy).")
    tiles = [False, True] if tiled_mlp is None else [tiled_mlp]
    out = []
    for m, bits in method_options((method or "auto").lower()):
        if optimizer is not None:
            opts = [optimizer]
        elif not cuda:
            opts = ["adamw_torch"]  # bitsandbytes' paged optimizers are CUDA unified memory
        elif m == "full":
            opts = ["adamw_torch", "adamw_8bit", "paged_adamw_8bit", "adafactor"]
        else:
            opts = ["adamw_torch", "paged_adamw_8bit"]
        for gc, off in memory:
            for opt in opts:
                for k in kerns:
                    for tiled in tiles:
                        out.append(Candidate(m, bits, gc, off, opt, k, tiled))
    return out


def _settings(shape: ModelShape, gpu: GpuProfile, c: Candidate, lora_r: int, lora_dropout: float, loss_chunk: int) -> Settings:
    """The memory model's settings for a candidate, through a recipe and the trainer's runtime rules."""
    from pydantic import ValidationError

    from finetuner.config.recipe import Recipe, format_validation_error

    raw: dict[str, Any] = {
        "name": "longest",
        "model": {"name": shape.name},
        "method": c.method,
        "lora": {"r": lora_r, "dropout": lora_dropout},
        "data": {"path": "longest.jsonl", "max_seq_len": 2048},
        "training": {
            "micro_batch_size": 1, "gradient_accumulation": 1, "optimizer": c.optimizer,
            "gradient_checkpointing": c.gradient_checkpointing, "offload_activations": c.offload_activations,
            "kernels": c.kernels, "loss_chunk_size": loss_chunk, "tiled_mlp": c.tiled_mlp,
        },
        "device": "cpu" if gpu.platform == "cpu" else "auto",
    }
    if c.method == "qlora":
        raw["quantization"] = {"bits": c.quant_bits}
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise UserError(format_validation_error(e, "the longest-sequence settings")) from None
    return settings_from_recipe(recipe, gpu, shape.model_type, shape=shape)


def _fits(shape: ModelShape, s: Settings, gpu: GpuProfile, margin: float, n: int) -> tuple[bool, MemoryEstimate]:
    est = estimate(shape, s.with_(seq_len=n), gpu, margin=margin)
    return est.total_bytes <= est.budget_bytes, est


def _longest(shape: ModelShape, s: Settings, gpu: GpuProfile, margin: float, step: int, positions: int) -> int:
    """The largest multiple of ``step`` in ``[MIN_SEQ, positions]`` that fits (0: none). Bisection:
    every term of the estimate grows with the sequence, so fitting is monotone."""
    lo_k = math.ceil(MIN_SEQ / step)
    hi_k = positions // step
    if hi_k < lo_k or not _fits(shape, s, gpu, margin, lo_k * step)[0]:
        return 0
    if _fits(shape, s, gpu, margin, hi_k * step)[0]:
        return hi_k * step
    good, bad = lo_k, hi_k
    while bad - good > 1:
        mid = (good + bad) // 2
        if _fits(shape, s, gpu, margin, mid * step)[0]:
            good = mid
        else:
            bad = mid
    return good * step


def _growth(shape: ModelShape, s: Settings, gpu: GpuProfile, margin: float, n: int) -> tuple[dict[str, float], int]:
    """Bytes per token of each component just below ``n``, and the total's intercept at ``n``."""
    d = max(1, n // 16)
    lo = max(1, n - d)
    a = estimate(shape, s.with_(seq_len=lo), gpu, margin=margin)
    b = estimate(shape, s.with_(seq_len=n), gpu, margin=margin)
    keys = list(dict.fromkeys([*b.components, *a.components]))
    span = n - lo
    growth = {k: (b.components.get(k, 0) - a.components.get(k, 0)) / span for k in keys}
    growth = {k: v for k, v in growth.items() if v > 0}
    slope = (b.total_bytes - a.total_bytes) / span
    return growth, int(b.total_bytes - slope * n)


def longest_sequence(
    model: str | ModelShape,
    gpu: str | GpuProfile | None,
    method: str = "qlora",
    *,
    margin: float = DEFAULT_MARGIN,
    step: int = 1,
    lora_r: int = DEFAULT_LORA_R,
    lora_dropout: float = DEFAULT_LORA_DROPOUT,
    gradient_checkpointing: bool | None = None,
    offload_activations: bool | None = None,
    optimizer: str | None = None,
    kernels: str | None = None,
    loss_chunk: int | None = None,
    tiled_mlp: bool | None = None,
) -> LongestSequence:
    """The longest sequence ``model`` trains on ``gpu`` with ``method`` at micro-batch 1, by the memory model.

    Args:
        model: a preset (``llama-3.1-8b``), a hub id, a local model folder, or a :class:`ModelShape`.
        gpu: a card name (``rtx4090``), a size (``24GB``), a :class:`GpuProfile`, or ``auto`` / None
            for the detected GPU. Not the CPU.
        method: ``qlora`` (4- or 8-bit base), ``qlora4``, ``qlora8``, ``lora``, ``full``, ``auto``
            (LoRA and QLoRA: the longest; LoRA when they tie) or ``any`` (full fine-tuning too).
        margin: fraction of the card kept free (the planner's default 0.05).
        step: the answer is a multiple of ``step``; ``max_seq + step`` does not fit (or passes the
            model's positions).
        lora_r, lora_dropout: the adapter assumed (dropout 0 saves a mask and an input copy per
            adapted layer).
        gradient_checkpointing, offload_activations, optimizer, kernels, tiled_mlp: fix a setting
            instead of searching it (``kernels``: ``none`` for the chunked loss, ``liger`` for the
            fused one; ``tiled_mlp``: the MLP whole or in chunks).
        loss_chunk: tokens per chunk of the chunked loss (default the recipe's auto: finetuner.losses.chunk).

    Example:
        >>> r = longest_sequence("llama-3.1-8b", "rtx4090", "qlora")
        >>> r.max_seq > 32768, r.candidate.offload_activations
        (True, True)
    """
    from finetuner.config.sections import TrainingSection

    prof = gpu if isinstance(gpu, GpuProfile) else get_gpu(gpu)
    if prof.platform != CUDA:
        raise UserError(
            f"The longest sequence is asked of a GPU card, and '{prof.name}' is the CPU.",
            hint="Name the card: --gpu rtx4090 (see `finetuner gpus`) or a size such as --gpu 24GB.",
        )
    if not 0 <= margin < 1:  # also NaN
        raise UserError(f"--margin {margin}: the fraction of the card kept free must be at least 0 and below 1.")
    if not isinstance(step, int) or step < 1:
        raise UserError(f"step {step!r}: must be a whole number of tokens, at least 1.")
    if optimizer is not None:
        from finetuner.memory.settings import OPTIMIZERS

        if optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer {optimizer!r}: one of {', '.join(OPTIMIZERS)}.")
    shape = model if isinstance(model, ModelShape) else resolve_shape(model)
    chunk = TrainingSection.model_fields["loss_chunk_size"].default if loss_chunk is None else loss_chunk
    positions = int(shape.max_position_embeddings)
    cands = _candidates(method, shape, prof, gradient_checkpointing=gradient_checkpointing,
                        offload_activations=offload_activations, optimizer=optimizer, kernels=kernels,
                        tiled_mlp=tiled_mlp)
    best: tuple[int, Candidate, Settings] | None = None
    considered: list[dict[str, Any]] = []
    for c in cands:
        s = _settings(shape, prof, c, lora_r, lora_dropout, chunk)
        n = _longest(shape, s, prof, margin, step, positions)
        considered.append({"settings": c.label, "max_seq": n,
                           "bytes_at_min_seq": _fits(shape, s, prof, margin, max(MIN_SEQ, step))[1].total_bytes})
        if best is None or n > best[0]:
            best = (n, c, s)
    n, c, s = best
    out = LongestSequence(model=shape.name, gpu=prof, method=method, max_seq=n, positions=positions,
                          capped=False, step=step, margin=margin, candidate=None, settings=None,
                          estimate=None, next_estimate=None, considered=considered)
    if n == 0:
        return out
    out.candidate, out.settings = c, s.with_(seq_len=n)
    out.estimate = _fits(shape, s, prof, margin, n)[1]
    out.capped = n + step > positions
    if not out.capped:
        out.next_estimate = _fits(shape, s, prof, margin, n + step)[1]
    out.bytes_per_token, out.fixed_bytes = _growth(shape, s, prof, margin, n)
    out.layer_terms = [(name, float(b)) for name, b in activation_bytes(shape, out.settings).terms]
    if out.estimate.offloaded_bytes:
        out.notes.append(f"activation offload keeps {gib_text(out.estimate.offloaded_bytes, 1)} in pinned CPU memory at this length")
    if s.optimizer.startswith("paged_"):
        out.notes.append("paged optimizer states are counted on the card (they could move to CPU memory under pressure)")
    if lora_dropout == 0 and c.method != "full":
        out.notes.append("LoRA dropout 0: with dropout each adapted layer would also keep a mask and a copy of its input")
    return out

"""What a plan says of its choice: the reasons it was chosen, why each runner-up was not, what else fits a GRPO
run's choice (its group size and completion length), and, when nothing fits, what would."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetuner.config.hardware import GpuProfile, list_profiles
from finetuner.device import CUDA
from finetuner.objectives.specs import spec_of
from finetuner.memory.grpo import ROLLOUT, grpo_settings_of
from finetuner.memory.model import MemoryEstimate, Settings
from finetuner.model.shapes import ModelShape, presets
from finetuner.planning.search import METHOD_TIER, Candidate, method_name, search
from finetuner.units import duration_text, gib_text

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe


def why_rejected(c: Candidate, best: Candidate) -> str:
    o, b = c.option, best.option
    if c.sharded is not None and c.sharded.device_fits and not c.sharded.host_fits:
        return (f"fits the cards, but needs {gib_text(c.sharded.host_bytes_per_machine, 1)} of CPU memory, over the "
                f"machine's {gib_text(c.sharded.machine_host_bytes, 1)}")
    if not c.fits:
        return f"needs {gib_text(c.peak_bytes, 1)}, over the {gib_text(c.estimate.budget_bytes, 1)} budget"
    if METHOD_TIER[o.method] > METHOD_TIER[b.method]:
        better = method_name(b.method)
        return f"fits, but {better} fits too and trains a better model"
    if c.tokens_per_s < best.tokens_per_s:
        return f"fits, but slower (~{c.tokens_per_s:,.0f} vs ~{best.tokens_per_s:,.0f} tokens/s)"
    return "fits and is as fast; the chosen one keeps full-precision optimizer states / no offload"



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


def runners_up(ranked: list[tuple[Candidate, Recipe]], best: Candidate, n: int = 4) -> list[dict[str, Any]]:
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
    return [dict(c.to_dict(), why=why_rejected(c, best)) for c in picked]


def reasons_for(best: Candidate, ranked: list[tuple[Candidate, Recipe]], gpu: GpuProfile, shape: ModelShape) -> list[str]:
    o, e = best.option, best.estimate
    speed = (f"at most {duration_text(best.step.step_s)} per step, the rollout included" if ROLLOUT in e.details and best.step
             else f"~{best.tokens_per_s:,.0f} tokens/s")
    r = [f"{best.to_dict()['settings']}: predicted peak {gib_text(best.peak_bytes, 1)} of {gpu.memory_gib:.1f} GiB "
         f"(budget {gib_text(e.budget_bytes, 1, unit=False)}), {speed}"]
    if best.sharded is not None:
        sh = best.sharded
        r.append(f"{sh.label} on {sh.world_size} GPUs: {gib_text(sh.per_device_bytes, 1)} per card "
                 f"(one device alone would need {gib_text(e.total_bytes, 1, unit=False)}), ~{gib_text(sh.comm_bytes_per_step)} sent "
                 f"per card per step")
    lora_fits = any(c.fits and c.option.method == "lora" for c, _ in ranked)
    if o.method == "qlora":
        smallest_lora = min((c.estimate.total_bytes for c, _ in ranked if c.option.method == "lora"), default=None)
        if smallest_lora is not None and not lora_fits:
            r.append(f"QLoRA: LoRA on a 16-bit base needs at least {gib_text(smallest_lora, 1)}; the {o.quant_bits}-bit base "
                     f"({gib_text(sum(v for k, v in e.components.items() if k.startswith('weights')), 1)}) makes room")
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
    grpo = spec_of(recipe.objective).generates and recipe.grpo is not None
    if grpo:
        out += _grpo_would_fit(recipe, shape, gpu, margin, method, label_fraction)
    if cpu_memory is not None:
        ranked = search(recipe, shape, gpu, margin, method, label_fraction, gpus, None)
        need = min((c.sharded.host_bytes_per_machine for c, _ in ranked if c.fits and c.sharded is not None), default=None)
        if need is not None:
            out.append(f"more CPU memory: a machine with {gib_text(need, 1)} of it fits on {gpus} x {gpu.name} "
                       f"(--cpu-memory SIZE plans for another machine)")
    seq = recipe.data.max_seq_len
    s = seq // 2
    while s >= 128 and not grpo:
        shorter = recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_seq_len": s})})
        if any(c.fits for c, _ in search(shorter, shape, gpu, margin, method, label_fraction, gpus, cpu_memory)):
            out.append(f"a shorter sequence: {s} tokens fits on {gpu.name} (examples longer than that are truncated)")
            break
        s //= 2
    tried: set[tuple[int, bool]] = set()  # cards of one memory and precision fit alike: one of them is searched
    for card in list_profiles():
        if card.memory_bytes <= gpu.memory_bytes or card.platform != CUDA or (card.memory_bytes, card.bf16) in tried:
            continue
        tried.add((card.memory_bytes, card.bf16))
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


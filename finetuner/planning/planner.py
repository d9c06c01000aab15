"""The planner: pick the recipe that fits the card and trains fastest, and say why.

Given a model, a card and the data (or a sequence length), :func:`plan` turns its arguments into a recipe
whose memory-deciding values are ``auto`` (:mod:`finetuner.planning.plan_inputs`), searches those values —
method, optimizer, gradient checkpointing, activation offload, micro-batch and gradient accumulation — and
ranks the options that fit the card less a safety margin: quality first, then predicted throughput
(:mod:`finetuner.planning.search`). Its answer is a :class:`~finetuner.planning.plan_result.Plan`: the
recipe, its memory, time and cost, and the reasons for it (:mod:`finetuner.planning.reasons`).

With several GPUs (``gpus``) each option is also split over them by the best strategy the recipe's
schema accepts (:mod:`finetuner.memory.sharding`: DDP, ZeRO 1-3, FSDP2, their CPU offload; QLoRA
sharded by fsdp), and it must fit the machine's CPU memory too: every process's offloaded state
and activations (``cpu_memory``, by default this machine's RAM). A plan says how much CPU memory
it needs, and one that needs more than the machine has does not fit.

The sequence length is the user's, or what the data need: it is never cut below the data's
longest example without a note saying how many examples are truncated. When nothing fits, the
plan says what would: a shorter sequence, a bigger card, a smaller model. A run resolves its own ``auto``
values with :mod:`finetuner.planning.resolve`.

Everything here is arithmetic (no torch): ``finetuner plan`` answers in well under a second.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from finetuner.errors import UserError
from finetuner.surface import say
from finetuner.config.hardware import GpuProfile, get_gpu
from finetuner.data import template_choice
from finetuner.model.gguf_base import info_for
from finetuner.losses.chunk import loss_chunk_of
from finetuner.memory.model import with_loss_chunk
from finetuner.model.shapes import (ModelShape, instruct_variant, is_sixteen_bit_copy, parameter_count, resolve_shape,
                                     sixteen_bit_copy)
from finetuner.objectives.specs import first_for_kind, spec_of
from finetuner.planning.calibrate import speed_for
from finetuner.planning.load import note_now
from finetuner.planning.expectations import expectation
from finetuner.planning.plan_inputs import (DEFAULT_DATA, base_recipe, check_objective, cpu_memory_of, default_run_name,
                                            free_name, grpo_section, objective_for, recipe_model_name)
from finetuner.planning.plan_result import Plan
from finetuner.planning.reasons import grpo_room, reasons_for, runners_up, what_would_fit, why_rejected
from finetuner.planning.recipe_data import run_wait
from finetuner.planning.search import DEFAULT_MARGIN, asked_method, method_name, schema_accepts, search, with_strategy
from finetuner.planning.sizing import learning_rate, size_run
from finetuner.planning.speed import DeviceSpeed
from finetuner.planning.scans import kernel_note
from finetuner.planning.wait import Wait, check_currency
from finetuner.units import gib_text, in_gib

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe


def experts_loading_note(shape: ModelShape, cpu_bytes: int | None) -> str:
    """What loading a mixture of experts for 4-bit QLoRA takes from CPU memory: its 16-bit experts, held there
    while they are quantized onto the GPU one expert at a time (:func:`finetuner.model.loading.load_base_model`)."""
    need = 2 * shape.expert_numel
    have = f"; this machine has {gib_text(cpu_bytes, 0)}" if cpu_bytes else ""
    short = " (too little: load on a machine with more, or from a checkpoint saved already quantized)" \
        if cpu_bytes and cpu_bytes < need * 1.1 else ""
    return (f"its {parameter_count(shape.expert_numel)} expert weights are held in 4-bit on the GPU; loading reads them "
            f"into CPU memory in bf16 first ({gib_text(need, 0)}) and quantizes them onto the GPU one expert at a "
            f"time{have}{short}")


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
            (:func:`~finetuner.planning.plan_inputs.default_run_name`), with ``-2``, ``-3``... when ``runs_dir`` already has a folder
            of that name (the plan's notes say so).
        runs_dir: where the run folders are (default ``runs`` in the current folder, where
            ``finetuner run`` puts them).
        cpu_memory: the CPU memory of the machine that runs the ``gpus`` processes, in bytes or as
            a size (``64GB``, GiB); by default this machine's RAM. Offloaded state must fit it.
        price_per_hour: what an hour of the machine (all ``gpus`` cards) costs: the plan adds the
            run's predicted cost (``Plan.cost``) to its time (``Plan.wall_s``: the whole run, by part in
            ``Plan.wait``).
        currency: the price's currency (``USD``, ``€``), said with the cost; None: the price's units.
        grpo: for objective grpo (implied when given), the recipe's ``grpo`` section: at least
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
    method = asked_method(method)  # --method auto, the UI's auto and the API's None: one plan
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

        return within_budget(max_hours, lambda **changes: plan(**{**asked, "max_hours": None, **changes}))
    if columns:
        from finetuner.config.columns import check_columns

        try:
            check_columns(columns, "auto")
        except ValueError as e:
            raise UserError(f"data.columns (--column): {e}") from None
    objective = check_objective(objective)
    if grpo is not None and objective is None:
        objective = first_for_kind("prompts")
    generates = objective is not None and spec_of(objective).generates
    grpo_raw = None
    if generates:
        if not data:
            raise UserError(f"{say(cli='--objective grpo', ui='Objective grpo')}: GRPO generates completions of prompts: "
                            "give the prompts' file.",
                            hint=say(cli="Plan with --data PROMPTS (any supported format: its prompt side is used).",
                                     ui="Choose a data file in the Data tab (its prompt side is used)."))
        grpo_raw = grpo_section(grpo)
    elif grpo is not None:
        raise UserError(f"GRPO settings (rewards) given, but the objective is {objective}.",
                        hint=say(cli="Use --objective grpo, or leave out --reward.", ui="Choose objective grpo."))
    cpu_bytes, cpu_source = cpu_memory_of(cpu_memory)
    shape = resolve_shape(model)
    notes: list[str] = []
    profile = None
    label_fraction = 1.0
    reasons: list[str] = []
    if data and generates:
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
        objective, why_objective = objective_for(objective, profile)
        if why_objective:
            reasons.append(why_objective)
        notes += profile.notes
        label_fraction = profile.label_fraction
        instruct = instruct_variant(model) if profile.format == "chat" else None
        if instruct:
            notes.append(f"{model} is a base model, trained to continue text; a chat assistant usually starts from its "
                         f"instruction-tuned variant {instruct} (the same shape: this plan holds for it; plan it with "
                         f"--model {instruct})")
    elif objective is not None and spec_of(objective).section == "preference":
        raise UserError(f"--objective {objective}: a preference objective needs --data with its pairs (or rated "
                        "responses for kto); there is no default preference data set.",
                        hint="Plan with --data PAIRS.jsonl, e.g. data/preference_sample.jsonl.")
    objective = spec_of(objective).name
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
        name, why_name = free_name(default_run_name(model, data, objective), Path(runs_dir or "runs").expanduser())
        notes += [why_name] if why_name else []
    if max_pixels is None and profile is not None and profile.pixel_budget and profile.largest_picture and seq_len is None:
        return plan_picture_size(asked, profile)
    base = base_recipe(recipe_model_name(model), sizing, data_path, name, device, columns, objective, grpo_raw,
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
    stored = None if is_sixteen_bit_copy(model) else (shape.config.get("quantization_config") or {}).get("quant_method")
    if stored and stored != "bitsandbytes" and result.fits and result.recipe.method == "qlora":
        copy_id = sixteen_bit_copy(model)
        if copy_id:  # the recipe loads what QLoRA can quantize
            raw = result.recipe.to_dict()
            raw["model"]["name"] = copy_id
            result.recipe = Recipe.model_validate(raw)
            result.notes.append(f"{model}'s published checkpoint is stored in {stored}, which QLoRA cannot quantize: "
                                f"the recipe's model.name is {copy_id}, a bf16 copy of it (method: lora would load "
                                "the published one, dequantized as it loads)")
        else:
            result.notes.append(f"{model}'s published checkpoint is stored in {stored}: QLoRA quantizes a bf16 checkpoint, "
                                f"so set model.name to a bf16 copy of it (for MXFP4: load it with transformers' "
                                f"Mxfp4Config(dequantize=True) and save_pretrained)")
    result.data = profile.to_dict() if profile else None
    result.optimizer_steps = sizing.total_steps
    if gpus > 1 and result.fits:  # the same job on one card, for the sentence that opens the plan
        from finetuner.planning.cards import headline

        one = plan_recipe(base, prof, shape=shape, margin=margin, method=method, label_fraction=label_fraction,
                          cpu_memory=cpu_bytes, lengths=lengths)
        result.headline = headline(result, one)
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
        result.reasons.insert(at + 1, cap.keeping_text(replan(seq_len=cap.uncapped), result))
    if alternatives:
        from finetuner.planning.budget import long_run_warning

        warning = long_run_warning(result, replan, None if generates else profile)
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
                     "peak_gib": round(in_gib(p.peak_bytes or 0), 2), "card_gib": round(prof.memory_gib, 2),
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
    ``lengths``: the training rows' token lengths (see :func:`~finetuner.planning.search.search`).

    ``cpu_memory``: the CPU memory of the machine that runs the ``gpus`` processes (None: not
    checked), and ``cpu_memory_source`` where that figure came from, for the plan's reasons.
    ``speed``: the device's speed figures (default :func:`speed_for`); ``price_per_hour`` (in ``currency``):
    for the cost. The plan's optimizer steps are the recipe's ``training.max_steps`` when set (:func:`plan`
    counts them from the data otherwise), and its :attr:`Plan.wait` the whole run's time when they are known.
    """
    prof = gpu if isinstance(gpu, GpuProfile) else get_gpu(gpu)
    method = asked_method(method)  # every front's "auto" is None here, as every_method reads it
    shape = shape or resolve_shape(recipe.model.name, recipe.model.revision)
    speed = speed or speed_for(prof)
    asked, recipe = recipe, with_loss_chunk(recipe, shape)  # the plan's recipe names the chunk it was predicted with
    ranked = search(recipe, shape, prof, margin=margin, method=method, label_fraction=label_fraction, gpus=gpus,
                    cpu_memory=cpu_memory, speed=speed, lengths=lengths)
    chunk_note = None
    every_method = method is None and recipe.method == "auto"  # (with one method asked for, a smaller chunk could
    # fit it where the plan of every method took another at the default chunk: the plans would disagree)
    smaller = smaller_loss_chunk(asked, shape) if every_method and not any(c.fits for c, _ in ranked) else None
    if smaller is not None:  # a large vocabulary's cross-entropy: in smaller chunks before "nothing fits"
        again = search(smaller, shape, prof, margin=margin, method=method, label_fraction=label_fraction, gpus=gpus,
                       cpu_memory=cpu_memory, speed=speed, lengths=lengths)
        if any(c.fits for c, _ in again):
            chunk_note = (f"Cross-entropy {smaller.training.loss_chunk_size} tokens at a time (training.loss_chunk_size): "
                          f"at {recipe.training.loss_chunk_size} the loss over its {shape.vocab_size:,}-token vocabulary "
                          f"would not fit (the smallest option needs "
                          f"{gib_text(min(c.peak_bytes for c, _ in ranked), 1)}); each chunk computes the same loss.")
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
    template = template_choice.for_model(recipe.model.name, recipe.data.chat_template)
    if template is not None and template.source == "fallback":  # a base model without one: said before it trains
        out.notes.append(f"Chat template: {template.why}; the run's samples, chat, merge, GGUF export and the Ollama "
                         "Modelfile use the same one.")
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
                f"({gib_text(least.peak_bytes, 1)} per card) but needs more CPU memory: {least.sharded.host_summary()}; the machine has "
                f"{gib_text(cpu_memory, 1)} ({cpu_memory_source or 'as given'})."
            )
        out.reasons.append(
            f"The smallest option ({smallest.to_dict()['settings']}) needs "
            f"{gib_text(smallest.peak_bytes, 1)}, the budget is {gib_text(smallest.estimate.budget_bytes, 1)}."
        )
        out.suggestions = what_would_fit(recipe, shape, prof, margin, method, label_fraction, gpus, cpu_memory)
        out.rejected = [dict(c.to_dict(), why=why_rejected(c, smallest)) for c, _ in ranked[:8]]
        return out
    best, best_recipe = fitting[0]
    out.recipe, out.estimate, out.tokens_per_s, out.step = best_recipe, best.estimate, best.tokens_per_s, best.step
    if gpus > 1:
        from finetuner.memory.sharding import compare_strategies

        out.sharded = best.sharded
        out.strategies = [dict(sh.to_dict(), runnable=schema_accepts(with_strategy(best_recipe, sh, gpus)))
                          for sh in compare_strategies(best.estimate, gpus, shape, cpu_memory)]
    out.reasons = reasons_for(best, ranked, prof, shape)
    if chunk_note:
        out.reasons.append(chunk_note)
    if spec_of(best_recipe.objective).generates and best_recipe.grpo is not None:
        out.reasons.append(grpo_room(best_recipe, best.estimate, shape))
    if best.sharded is not None:
        where = f"the machine has {gib_text(cpu_memory, 1)} ({cpu_memory_source or 'as given'})" if cpu_memory else "not checked"
        out.reasons.insert(2, f"CPU memory: {best.sharded.host_summary()}; {where}")
    out.rejected = runners_up(ranked, best)
    out.wait = plan_wait(out, label_fraction, lengths)
    return out


#: the cross-entropy chunk a plan of every method takes when the recipe's (``auto``, not a number the user set) is
#: larger and leaves no option of any method fitting: its loss peak is 16 bytes x chunk x vocabulary
#: (finetuner.memory.model); ``auto`` (finetuner.losses.chunk) is smaller already for vocabularies over 131,072 tokens
SMALL_LOSS_CHUNK = 256


def smaller_loss_chunk(recipe: Recipe, shape: ModelShape) -> Recipe | None:
    """``recipe`` with the cross-entropy in :data:`SMALL_LOSS_CHUNK`-token chunks, when its chunk is ``auto`` and
    larger for ``shape``; None otherwise (a number the user set, the plain loss 0 among them, is kept)."""
    t = recipe.training
    if t.loss_chunk_size != "auto" or not SMALL_LOSS_CHUNK < loss_chunk_of("auto", shape):
        return None
    return recipe.model_copy(update={"training": t.model_copy(update={"loss_chunk_size": SMALL_LOSS_CHUNK})})


def plan_wait(p: Plan, label_fraction: float, lengths: Sequence[int] | None) -> Wait | None:
    """The whole run's wait of a plan's recipe (:func:`~finetuner.planning.recipe_data.run_wait`); None when nothing
    fits or the steps are unknown."""
    if p.recipe is None or p.step is None or not p.optimizer_steps:
        return None
    return run_wait(p.recipe, p.gpu, p.speed or speed_for(p.gpu), p.step, p.optimizer_steps, label_fraction,
                    shape=p.shape, lengths=lengths)

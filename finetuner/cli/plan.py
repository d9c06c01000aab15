"""``finetuner plan``, ``finetuner estimate`` and ``finetuner gpus``: the memory model at the prompt.

None of these import torch (only ``--gpu auto`` does, to look at the device), so they answer in a
fraction of a second. Exit status: 0 when the recipe fits the card, 1 when it does not (the
output then says what would fit), 2 for a user error.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from finetuner.objectives.specs import described, in_words, names_where
from finetuner.rewards.builtin import BUILTINS
from finetuner.units import duration_text, gib_text


log = logging.getLogger(__name__)


def _presets_help() -> str:
    from finetuner.model.shapes import preset_names

    return ", ".join(preset_names())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="Pick the recipe that fits a card and trains fastest (writes a runnable recipe).",
        description=(
            "Search method (LoRA/QLoRA 4-bit/8-bit), optimizer, gradient checkpointing, activation offload and "
            "micro-batch x accumulation for MODEL on GPU; keep what the memory model says fits (with a safety "
            "margin); choose the best quality, then the fastest. With --gpus N: the strategy (DDP, ZeRO, FSDP, CPU "
            "offload) and the CPU memory the machine needs (--cpu-memory). Exit status 1 when nothing fits (the output says "
            "what would). Models: a preset (" + _presets_help() + "), a hub id, a local folder with config.json, or a GGUF file (*.gguf)."
        ),
    )
    p.add_argument("--model", "-m", required=True, help="Preset name (e.g. llama-2-7b, smollm2-135m-instruct), hub id, local model folder or GGUF file (*.gguf).")
    p.add_argument("--gpu", "-g", default="auto", help="Card name (rtx4090, a100-80gb, ... see `finetuner gpus`), a size like 24GB, cpu, or auto (default: the detected GPU, else the CPU).")
    p.add_argument("--seq-len", type=int, help="Sequence length (default: what --data needs, else 2048).")
    p.add_argument("--data", help="Data file (JSON/JSONL/CSV/Parquet): its token lengths set the sequence length and packing.")
    p.add_argument("--column", dest="columns", action="append", default=[], metavar="ROLE=COLUMN",
                   help="Which column of --data holds a role (prompt, input, response, system, messages, text), e.g. "
                        "--column prompt=question --column response=answer (repeatable; written as data.columns).")
    p.add_argument("--epochs", type=int, help="Passes over --data (default: enough for 100 optimizer steps, at most 10).")
    p.add_argument("--max-hours", type=float, metavar="H",
                   help="A time budget for the whole run: the least-reduced plan predicted to end within H hours on this "
                        "card (fewer epochs first, then the sequence at the data's 95th percentile), its reasons saying what "
                        "was reduced; exit status 1 (no recipe written) when none does, saying the shortest.")
    p.add_argument("--effective-batch", type=int, help="Examples per optimizer step = micro-batch x accumulation (default 16).")
    p.add_argument("--method", default="auto", help="auto (LoRA or QLoRA), lora, qlora, qlora4, qlora8, full, or any.")
    p.add_argument("--objective", default="auto",
                   help=f"auto (from --data: the first objective listed that takes its kind of data; "
                        f"{in_words(names_where(generates=True))} when --reward is given), or one of {described()}. "
                        "Plans with the objective's memory (two sequences per pair, the reference pass; GRPO: the "
                        "rollout's KV cache and the group's sequences), no packing, at most 3 epochs and its learning rate.")
    p.add_argument("--reward", dest="rewards", action="append", default=[], metavar="FILE.py:FUNCTION|BUILTIN",
                   help="GRPO: a reward function with TRL's signature fn(prompts, completions, **columns) -> list[float] "
                        f"in a Python file, or a built-in ({', '.join(BUILTINS)}); repeatable (weights and "
                        "arguments: edit the written recipe). Implies --objective grpo; --data gives the prompts.")
    p.add_argument("--num-generations", type=int, metavar="G", help="GRPO: completions per prompt (default 4).")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="GRPO: the longest completion in tokens (default 64).")
    p.add_argument("--gpus", type=int, default=1, help="Number of such cards: adds the strategy (DDP, ZeRO 1-3, FSDP, offload) with per-device memory and communication.")
    p.add_argument("--cpu-memory", metavar="SIZE",
                   help="CPU memory of the machine running the --gpus processes, e.g. 64GB (GiB; default: this machine's "
                        "RAM): plans whose offloaded state needs more do not fit.")
    p.add_argument("--margin", type=float, help="Fraction of the card kept free (default 0.05: the planner's, as "
                                                  "finetuner.plan and the web UI keep).")
    p.add_argument("--price-per-hour", type=float, metavar="PRICE",
                   help="What an hour of the machine costs (all --gpus cards): the plan adds the whole run's cost (download, "
                        "load, replay, steps, evaluations, checkpoints, probe, samples) to its time.")
    p.add_argument("--currency", metavar="CODE",
                   help="The currency of --price-per-hour (USD, EUR, $), said with the cost (default: none, the price's units).")
    p.add_argument("--compare-cards", metavar="CARDS",
                   help="Comma-separated cards (e.g. rtx4090,a100-80gb,h100): plan the same job on each and print, per "
                        "card, the recipe, memory, time and (with --price-per-hour) cost.")
    p.add_argument("--name", help="Run name written into the recipe.")
    p.add_argument("-o", "--output", help="Write the planned recipe to this YAML file (never overwrites; see --force).")
    p.add_argument("--force", action="store_true", help="Overwrite --output if it exists.")
    p.add_argument("--json", action="store_true", help="Print one JSON object (fits, total_bytes, device_bytes, components, recipe, ...).")
    p.add_argument("--longest", action="store_true",
                   help="Instead of a recipe: the longest sequence the card trains for --model and --method at "
                        "micro-batch 1, with the most memory-frugal settings (checkpointing, activation offload, "
                        "paged 8-bit AdamW, chunked loss, tiled MLP), capped at the model's positions, and what bounds it, e.g. "
                        "`finetuner plan --model llama-3.1-8b --gpu rtx4090 --method qlora --longest` (with --json: "
                        "one JSON object).")
    p.set_defaults(func=_cmd_plan)

    e = sub.add_parser(
        "estimate",
        help="Predicted peak GPU memory of a recipe, by component, and whether it fits.",
        description="Exit status 1 when the recipe does not fit the card.",
    )
    e.add_argument("recipe", help="Recipe YAML.")
    e.add_argument("--gpu", "-g", default="auto", help="Card name, size (24GB) or auto (the detected GPU; the CPU when there is none).")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="Override a recipe value (repeatable).")
    e.add_argument("--price-per-hour", type=float, metavar="PRICE",
                   help="What an hour of the machine costs: adds the whole run's cost (download, load, replay, steps, evaluations, "
                        "checkpoints, probe, samples).")
    e.add_argument("--currency", metavar="CODE",
                   help="The currency of --price-per-hour (USD, EUR, $), said with the cost (default: none, the price's units).")
    e.add_argument("--json", action="store_true", help="Print one JSON object (fits, total_bytes, device_bytes, components, ...).")
    e.set_defaults(func=_cmd_estimate)

    g = sub.add_parser("gpus", help="List the GPU profiles the planner knows, and the detected device.")
    g.add_argument("--json", action="store_true")
    g.add_argument("--no-detect", action="store_true", help="Do not look for a CUDA device (avoids importing torch); "
                   "without it, also says which fast kernels (FlashAttention-2, Liger Kernel) a run here uses and how to install the missing ones.")
    g.add_argument("--calibrate", action="store_true",
                   help="Measure this machine's device for the speed model (matmul rate per dtype and width, memory "
                        "bandwidth, attention, cross-entropy, dropout, per-operation cost; and for a run's wait besides its steps the "
                        "libraries' import in a new process and the disk's read and write rates; some seconds) and cache it "
                        "for plans on this device (per device and library version).")
    g.set_defaults(func=_cmd_gpus)


# ---------------------------------------------------------------------- plan
def parse_columns(items: list[str], data: str | None) -> dict[str, str]:
    """``--column ROLE=COLUMN`` items (``plan`` and ``eval``) as ``data.columns``."""
    from finetuner.errors import UserError

    columns: dict[str, str] = {}
    for item in items:
        role, eq, column = item.partition("=")
        if not eq or not role.strip() or not column.strip():
            raise UserError(f"--column {item!r}: write ROLE=COLUMN, e.g. --column prompt=question.")
        columns[role.strip()] = column.strip()
    if columns and not data:
        raise UserError("--column names columns of a data file: give the file with --data.")
    return columns


def parse_rewards(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--reward``, ``--num-generations`` and ``--max-new-tokens`` as :func:`finetuner.plan`'s ``grpo``
    (None when none is given): ``FILE.py:FUNCTION`` names a function of a file, a bare name a built-in."""
    from finetuner.errors import UserError
    from finetuner.rewards.specs import parse_reward_spec

    rewards = []
    for item in args.rewards:
        try:
            rewards.append(parse_reward_spec(item))
        except UserError as e:
            raise UserError(f"--{e.message}") from None
    extra = {k: v for k, v in (("num_generations", args.num_generations), ("max_new_tokens", args.max_new_tokens)) if v is not None}
    if not rewards and not extra:
        return None
    if not rewards:
        raise UserError("--num-generations / --max-new-tokens plan a GRPO run, which needs a reward.",
                        hint=f"Add --reward FILE.py:FUNCTION (or a built-in: {', '.join(BUILTINS)}).")
    return {"rewards": rewards, **extra}


def planner_margin(args: argparse.Namespace) -> dict[str, float]:
    """``--margin`` for the planner when it is given; else nothing, so that the planner's own default
    (:data:`~finetuner.planning.search.DEFAULT_MARGIN`) holds here as in the API and the web UI."""
    return {} if args.margin is None else {"margin": args.margin}


def _cmd_plan(args: argparse.Namespace) -> int:
    from finetuner.cli.progress import command_phases
    from finetuner.errors import UserError
    from finetuner.planning.planner import plan

    if args.longest:
        return _cmd_longest(args)
    if args.compare_cards:
        return _cmd_compare(args)
    out_path = Path(args.output).expanduser() if args.output else None
    if out_path is not None and out_path.exists() and not args.force:
        raise UserError(f"{out_path} exists; finetuner will not overwrite it.", hint="Choose another -o, or add --force.")
    columns = parse_columns(args.columns, args.data)
    with command_phases():  # measuring the data, and this machine's speed the first time: on stderr
        p = plan(
            args.model, args.gpu, seq_len=args.seq_len, data=args.data, effective_batch=args.effective_batch,
            epochs=args.epochs, method=args.method, **planner_margin(args), name=args.name, gpus=args.gpus,
            columns=columns or None, objective=args.objective, cpu_memory=args.cpu_memory,
            price_per_hour=args.price_per_hour, grpo=parse_rewards(args), currency=args.currency,
            max_hours=args.max_hours,
        )
    if p.over_budget:  # the shortest plan is over the budget: said in one line, not written
        if args.json:
            print(json.dumps(p.to_dict(), indent=2))
        else:
            print(f"Over budget: {p.over_budget}.")
        return 1
    if p.recipe is not None:  # what `finetuner run` would refuse is not written (finetuner.planning.bounds)
        from finetuner.planning.bounds import check_run

        t = p.recipe.training  # an --effective-batch the data cannot fill is said as that option
        asked = p.recipe.model_copy(update={"training": t.model_copy(update={"effective_batch": args.effective_batch})})
        for warning in check_run(asked, p.gpu):
            log.warning(warning)
    if out_path is not None and p.recipe is not None:
        from finetuner.fileio import atomic_write_text

        out_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_path, p.to_yaml(out_path))
    if args.json:
        d = p.to_dict()
        d["written_to"] = str(out_path) if out_path is not None and p.recipe is not None else None
        print(json.dumps(d, indent=2))
        return 0 if p.fits else 1
    _print_plan(p, out_path)
    return 0 if p.fits else 1


def _cmd_compare(args: argparse.Namespace) -> int:
    """``plan --compare-cards A,B,C``: the same job planned on each card (exit 1 when it fits none)."""
    from finetuner.errors import UserError
    from finetuner.planning.planner import compare_cards

    if args.max_hours is not None:
        raise UserError("--max-hours plans one card within a budget: drop --compare-cards, or plan each card with it.")
    if args.output:
        raise UserError("--compare-cards writes no recipe: drop -o/--output, and plan one card to write its recipe.")
    cards = [c.strip() for c in args.compare_cards.split(",") if c.strip()]
    if not cards:
        raise UserError("--compare-cards: give card names separated by commas, e.g. rtx4090,a100-80gb,h100.")
    rows = compare_cards(
        args.model, cards, seq_len=args.seq_len, data=args.data, effective_batch=args.effective_batch, method=args.method,
        **planner_margin(args), gpus=args.gpus, columns=parse_columns(args.columns, args.data) or None, objective=args.objective,
        cpu_memory=args.cpu_memory, price_per_hour=args.price_per_hour, grpo=parse_rewards(args), currency=args.currency)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0 if any(r["fits"] for r in rows) else 1
    from rich.console import Console
    from rich.table import Table

    from finetuner.planning.time_text import format_cost

    t = Table(title=f"{args.model} on each card (the same job)", title_justify="left")
    unit = f" ({rows[0]['currency']})" if rows and rows[0].get("currency") else ""
    for col in ("card", "recipe", "GiB", "tokens/s", "per step", "steps", "total", "cost" + unit):
        t.add_column(col, justify="left" if col in ("card", "recipe") else "right")
    for r in rows:
        if not r["fits"]:
            t.add_row(r["card"], "nothing fits: " + (r["suggestions"][0] if r["suggestions"] else ""), f"{r['peak_gib']:.1f}", "", "", "", "", "")
            continue
        t.add_row(r["card"], r["recipe"], f"{r['peak_gib']:.1f} of {r['card_gib']:.0f}", f"{r['tokens_per_s']:,.0f}",
                  duration_text(r["step_s"]), f"{r['optimizer_steps']:,}" if r["optimizer_steps"] else "?",
                  duration_text(r["wall_s"]) if r["wall_s"] else "?", format_cost(r["cost"]) if r["cost"] is not None else "")
    con = Console()
    con.print(t)
    for r in rows:
        con.print(f"  [dim]{r['card']}: speed from {r['speed_source']}[/]", highlight=False)
    if args.price_per_hour is None:
        con.print("  [dim]--price-per-hour PRICE adds the cost (the same price for every card: compare one card at a time for its own price).[/]")
    return 0 if any(r["fits"] for r in rows) else 1


def _cmd_longest(args: argparse.Namespace) -> int:
    """``plan --longest``: the longest sequence (finetuner.planning.longest). Exit 1 when nothing fits."""
    from finetuner.errors import UserError
    from finetuner.objectives.specs import DEFAULT as DEFAULT_OBJECTIVE
    from finetuner.planning.longest import longest_sequence

    given = [flag for flag, value in (("--seq-len", args.seq_len), ("--data", args.data), ("--column", args.columns),
                                      ("--effective-batch", args.effective_batch), ("--name", args.name),
                                      ("-o/--output", args.output), ("--cpu-memory", args.cpu_memory),
                                      ("--max-hours", args.max_hours is not None)) if value]
    if args.gpus != 1:
        given.append("--gpus")
    if given:
        raise UserError(f"--longest searches the sequence length for one card and writes no recipe: drop {', '.join(given)}.",
                        hint="Plan a recipe at that length afterwards with --seq-len.")
    if args.objective not in ("auto", DEFAULT_OBJECTIVE):
        raise UserError(f"--longest sizes supervised fine-tuning (objective sft), not --objective {args.objective}.")
    r = longest_sequence(args.model, args.gpu, args.method, **planner_margin(args))
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
        return 0 if r.fits else 1
    from rich.console import Console
    from rich.markup import escape

    con = Console()
    budget = f"{gib_text(r.budget_bytes, 1)} budget (margin {r.margin:g})"
    con.print(f"[bold]{escape(r.model)}[/] on {r.gpu.name} ({r.gpu.memory_gib:.1f} GiB, {budget}), method {r.method}, micro-batch 1")
    if not r.fits:
        con.print(f"[bold red]No sequence fits[/]: {escape(r.bound['text'])}")
        return 1
    cap = " [yellow](capped by the model's positions)[/]" if r.capped else ""
    con.print(f"[bold green]Longest sequence: {r.max_seq:,} tokens[/]{cap}")
    con.print(f"Settings: {escape(r.candidate.label)}")
    con.print("Recipe values: " + ", ".join(f"{k}: {v}" for k, v in r.recipe_values().items()))
    con.print(f"Bound: {escape(r.bound['text'])}")
    for n in r.notes:
        con.print(f"  [dim]{escape(n)}[/]")
    others: dict[str, int] = {}
    for c in r.considered:
        if c["settings"] != r.candidate.label:
            others[c["settings"]] = c["max_seq"]
    best_other = sorted(others.items(), key=lambda kv: -kv[1])[:3]
    if best_other:
        con.print("Next best: " + "; ".join(f"{escape(k)}: {v:,}" for k, v in best_other))
    return 0


def _print_plan(p: Any, out_path: Path | None) -> None:
    from rich.console import Console
    from rich.markup import escape  # the planner's texts are plain: `finetuner[kernels]` is no markup

    from finetuner.data.formats import KIND_UNITS
    from finetuner.objectives.specs import spec_of

    con = Console()
    con.print(f"[bold]{escape(p.shape.describe())}[/]")
    con.print(f"Card: {p.gpu.name} — {p.gpu.description}, {p.gpu.memory_gib:.1f} GiB")
    if p.data:
        d = p.data
        trained = ("the completions are generated" if d["kind"] == "prompts"
                   else f"{100 * d['label_fraction']:.0f}% of tokens trained on")
        con.print(
            f"Data: {d['rows']} {KIND_UNITS[d['kind']]} ({d['format_label']}), tokens mean {d['mean_tokens']:.0f} / p95 {d['p95_tokens']} / "
            f"max {d['max_tokens']} ({d['counted_with']}); {trained}"
        )
    for w in p.warnings:
        con.print(f"[bold yellow]Warning:[/] {escape(w)}", highlight=False)
    for n in p.notes:
        con.print(f"[yellow]Note:[/] {escape(n)}")
    if not p.fits:
        con.print(f"[bold red]Nothing fits.[/] {escape(p.reasons[0]) if p.reasons else ''}")
        con.print("What would fit:")
        for s in p.suggestions:
            con.print(f"  • {escape(s)}")
        return
    if p.headline:
        con.print(f"\n[bold]{escape(p.headline)}[/]", highlight=False)
    c = p.recipe_choice()
    method = c["method"].upper() if c["method"] != "qlora" else f"QLoRA {c['quantization_bits']}-bit"
    if spec_of(p.recipe.objective).label:
        method = f"{spec_of(p.recipe.objective).label} with {method}"
    con.print(
        f"\n[bold green]Plan:[/] {method}, seq {c['max_seq_len']}{' packed' if c['packing'] else ''}, micro-batch "
        f"{c['micro_batch_size']} x accumulation {c['gradient_accumulation']}, {c['optimizer']}, checkpointing "
        f"{'on' if c['gradient_checkpointing'] else 'off'}{', activation offload' if c['offload_activations'] else ''}"
    )
    for r in p.reasons:
        con.print(f"  • {escape(r)}")
    if p.step is not None:
        con.print(f"[bold]Time:[/] {p.time_line()}", highlight=False)
    if p.sharded is not None:
        _print_strategies(con, p)
    else:
        _print_breakdown(con, p.estimate)
    if p.rejected:
        from rich.table import Table

        t = Table(title="Also considered", title_justify="left")
        t.add_column("option")
        t.add_column("GiB", justify="right")
        t.add_column("why not")
        for r in p.rejected:
            t.add_row(r["settings"], gib_text(r['total_bytes'], 1, unit=False), r["why"])
        con.print(t)
    if out_path is not None:
        from finetuner.runs.folder import shown

        con.print(f"Recipe written to [bold]{out_path}[/]: run it with `finetuner run {out_path}` "
                  f"(its run folder: {shown(p.recipe.output_path())})")
    else:
        con.print("Write the recipe with -o recipe.yaml, then `finetuner run recipe.yaml`.")


def _print_strategies(con: Any, p: Any) -> None:
    from rich.table import Table

    t = Table(title=f"Per device on {p.gpus} x {p.gpu.name} (one device alone: {gib_text(p.estimate.total_bytes, 1)})",
              title_justify="left")
    for col in ("strategy", "GiB per card", "CPU GiB, machine", "sent per card per step", "fits"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for st in p.strategies:
        label = st["label"]
        chosen = " (chosen)" if label == p.sharded.label else ("" if st.get("runnable", True) else " (the recipe refuses it)")
        fits = "yes" if st["fits"] else ("no: CPU memory" if st["device_fits"] else "no")
        t.add_row(label + chosen, gib_text(st['per_device_bytes'], 1, unit=False), gib_text(st['host_bytes_per_machine'], 1, unit=False),
                  gib_text(st['comm_bytes_per_step']), fits)
    con.print(t)
    for k, v in p.sharded.components.items():
        con.print(f"  [dim]{k}: {gib_text(v)}[/]")


def _print_breakdown(con: Any, est: Any) -> None:
    from rich.table import Table

    t = Table(title=f"Predicted peak memory ({est.peak_phase})", title_justify="left")
    t.add_column("component")
    t.add_column("GiB", justify="right")
    t.add_column("share", justify="right")
    for k, v in est.components.items():
        t.add_row(k, gib_text(v, 2, unit=False), f"{100 * v / est.total_bytes:.0f}%")
    t.add_row("[bold]total[/]", f"[bold]{gib_text(est.total_bytes, 2, unit=False)}[/]", "")
    if est.device_bytes:
        colour = "green" if est.fits else "red"
        t.add_row(f"[{colour}]card / budget[/]", f"{gib_text(est.device_bytes, 2, unit=False)} / {gib_text(est.budget_bytes, 2, unit=False)}", "")
    con.print(t)
    for n in est.notes:
        con.print(f"  [dim]{n}[/]")


# ---------------------------------------------------------------------- estimate
def _cmd_estimate(args: argparse.Namespace) -> int:
    from finetuner.cli.progress import command_phases
    from finetuner.config.hardware import get_gpu, run_profile
    from finetuner.data.follow import load_recipe
    from finetuner.objectives.specs import spec_of
    from finetuner.planning.bounds import check_prediction
    from finetuner.planning.predict import predict

    recipe = load_recipe(args.recipe, args.overrides)
    gpu = run_profile(recipe.device) if str(args.gpu).lower() in ("auto", "") else get_gpu(args.gpu)
    with command_phases():  # measuring the data, and this machine's speed the first time: on stderr
        p = predict(recipe, gpu)  # the auto values, the model, the share of trained tokens: resolved once
    for warning in check_prediction(p):  # what `finetuner run` refuses (exit 2) and warns about, on this card
        log.warning(warning)
    recipe, planned = p.recipe, p.planned
    if spec_of(recipe.objective).generates:
        return _grpo_estimate(args, p)
    est = p.memory
    timing = p.time(args.price_per_hour, args.currency)
    sharded = p.sharded
    if args.json:
        d = est.to_dict()
        d["gpu_profile"] = gpu.to_dict()
        if sharded is not None:
            d["per_device"] = sharded.to_dict()
            d["total_bytes"], d["components"], d["fits"] = sharded.per_device_bytes, dict(sharded.components), sharded.fits
        if planned is not None:
            d["resolved"] = planned.recipe_choice()
        d["time"] = timing
        print(json.dumps(d, indent=2))
        return 0 if (sharded.fits if sharded is not None else est.fits) else 1
    from rich.console import Console

    con = Console()
    if sharded is not None:
        con.print(f"[bold]{args.recipe}[/]: {recipe.model.name}, {sharded.label} on {sharded.world_size} process(es) of {gpu.name}")
        for k, v in sharded.components.items():
            con.print(f"  {k}: {gib_text(v)}")
        con.print(f"per device {gib_text(sharded.per_device_bytes, 1)} (one device alone {gib_text(est.total_bytes, 1, unit=False)}); "
                  f"CPU {gib_text(sharded.host_bytes_per_machine, 1)} for the machine; sent per device per step "
                  f"{gib_text(sharded.comm_bytes_per_step)} ({sharded.comm_formula})")
        con.print(f"[bold]Time:[/] {_time_text(timing)}", highlight=False)
        con.print("[green]Fits[/]" if sharded.fits else "[red]Does not fit[/]")
        return 0 if sharded.fits else 1
    con.print(f"[bold]{args.recipe}[/]: {recipe.model.name} ({est.settings.label}), on {gpu.name} ({gpu.memory_gib:.1f} GiB)")
    if planned is not None:
        con.print(f"auto values resolved by the planner: {json.dumps(planned.recipe_choice())}")
    _print_breakdown(con, est)
    con.print(f"[bold]Time:[/] {_time_text(timing)}", highlight=False)
    if est.fits:
        con.print(f"[green]Fits[/] with {gib_text(est.headroom_bytes, 1)} to spare.")
        return 0
    con.print(f"[red]Does not fit[/]: {gib_text(est.total_bytes, 1)} needed, budget {gib_text(est.budget_bytes, 1)}.")
    con.print(f"Try: finetuner plan --model {recipe.model.name} --gpu {gpu.name} --seq-len {recipe.data.max_seq_len}")
    return 1


#: how far ``estimate`` searches the largest GRPO group size and length (a tiny model fits any)
LARGEST_LIMIT = 1 << 17


def _grpo_estimate(args: argparse.Namespace, p: Any) -> int:
    """``estimate`` of a GRPO recipe's prediction ``p``: its phases' peaks and components, and what else would fit."""
    from finetuner.planning.predict import grpo_report

    recipe, gpu, planned = p.recipe, p.gpu, p.planned
    r = grpo_report(p, limit=LARGEST_LIMIT)
    timing = p.time(args.price_per_hour, args.currency)
    mem, g = r["memory"], recipe.grpo
    if args.json:
        print(json.dumps({"objective": recipe.objective, "gpu_profile": gpu.to_dict(), "total_bytes": mem.total_bytes,
                          "allocated_bytes": mem.allocated_bytes, "peak_phase": mem.peak_phase, "phases": dict(mem.phases),
                          "components": dict(mem.components), "budget_bytes": r["budget_bytes"], "fits": r["fits"],
                          "largest_max_new_tokens": r["largest_max_new_tokens"],
                          "largest_num_generations": r["largest_num_generations"], "time": timing,
                          "resolved": planned.recipe_choice() if planned is not None else None}, indent=2))
        return 0 if r["fits"] else 1
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{args.recipe}[/]: {recipe.model.name} ({recipe.method}, GRPO: {g.num_generations} generations "
              f"of up to {g.max_new_tokens} tokens), on {gpu.name} ({gpu.memory_gib:.1f} GiB)", highlight=False)
    if planned is not None:
        con.print(f"auto values resolved by the planner: {json.dumps(planned.recipe_choice())}", highlight=False)
    t = Table(title=f"Predicted peak memory of a GRPO step ({mem.peak_phase})", title_justify="left")
    t.add_column("phase or component")
    t.add_column("GiB", justify="right")
    for k, v in mem.phases.items():
        t.add_row(f"phase: {k}" + (" (peak)" if k == mem.peak_phase else ""), gib_text(v, 2, unit=False))
    for k, v in mem.components.items():
        t.add_row(k, gib_text(v, 2, unit=False))
    t.add_row("[bold]total[/] (with allocator slack and context)", f"[bold]{gib_text(mem.total_bytes, 2, unit=False)}[/]")
    if r["budget_bytes"]:
        colour = "green" if r["fits"] else "red"
        t.add_row(f"[{colour}]card / budget[/]", f"{gib_text(r['device_bytes'], 2, unit=False)} / {gib_text(r['budget_bytes'], 2, unit=False)}")
    con.print(t)
    for key, what, held in (("largest_max_new_tokens", "max_new_tokens", f"num_generations {g.num_generations}"),
                            ("largest_num_generations", "num_generations", f"max_new_tokens {g.max_new_tokens}")):
        n = r[key]
        text = "none (even 1 does not fit)" if not n else f"more than {n - 1:,}" if n >= LARGEST_LIMIT else f"{n:,}"
        con.print(f"largest {what} that fits ({held}): {text}", highlight=False)
    con.print(f"[bold]Time:[/] {_time_text(timing)}", highlight=False)
    if r["fits"]:
        con.print(f"[green]Fits[/] with {gib_text(r['budget_bytes'] - mem.total_bytes, 1)} to spare.")
        return 0
    con.print(f"[red]Does not fit[/]: {gib_text(mem.total_bytes, 1)} needed, budget {gib_text(r['budget_bytes'], 1)}. "
              "Lower grpo.num_generations or grpo.max_new_tokens (the largest values that fit are above) or "
              "training.micro_batch_size (the loss's rows), set training.gradient_checkpointing: true, or use method: qlora.")
    return 1


def _time_text(t: dict[str, Any]) -> str:
    """``estimate``'s time: tokens/s, time per step, the whole run by part, cost, where the speed figures
    came from (:func:`finetuner.planning.time_text.time_text`, as the plan says it), and the lengths it timed."""
    from finetuner.planning.time_text import estimate_text

    return estimate_text(t, " (real tokens, padding excluded)") + f"\nLengths: {t['lengths']}."


# ---------------------------------------------------------------------- gpus
def _cmd_gpus(args: argparse.Namespace) -> int:
    from finetuner.config.hardware import detect, list_profiles

    if args.calibrate:
        return _cmd_calibrate(args)
    detected = None if args.no_detect else detect()
    fast = None
    if not args.no_detect:
        from finetuner.config.runtime import Device, fast_path

        fast = fast_path(Device.here())
    profiles = list_profiles()
    from finetuner.planning.calibrate import place

    where = place(this_device=not args.no_detect)
    if args.json:
        print(json.dumps({"profiles": [p.to_dict() for p in profiles], "detected": detected.to_dict() if detected else None,
                          "fast_path": fast, "calibration": where}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="GPU profiles (--gpu NAME, or a size such as --gpu 24GB)", title_justify="left")
    numbers = ("memory GiB", "bf16 TFLOP/s", "fp8 TFLOP/s", "GB/s")
    for col in ("name", "memory GiB", "bf16", "bf16 TFLOP/s", "fp8 TFLOP/s", "GB/s", "description"):
        t.add_column(col, justify="right" if col in numbers else "left")
    for p in profiles:
        t.add_row(p.name, f"{p.memory_gib:.1f}", "yes" if p.bf16 else "no", f"{p.tflops:g}",
                  f"{p.fp8_tflops:g}" if p.fp8_tflops else "-", f"{p.bandwidth_gbs:g}", p.description)
    con = Console()
    con.print(t)
    from finetuner.config.hardware import REPRESENTATIVE

    sizes = ", ".join(f"{g} GB {name}" for g, name in REPRESENTATIVE.items())
    con.print(f"A bare size (--gpu 12GB) is timed as the card of the nearest size, which its plan names: {sizes}.",
              highlight=False)
    if detected:
        con.print(f"Detected: {detected.description}, {detected.memory_gib:.1f} GiB → profile '{detected.name}'")
    elif not args.no_detect:
        con.print("Detected: no CUDA device.")
    if fast is not None:
        con.print(f"Fast path here (kernels: auto, attention: auto): attention {fast['attention']}, kernels {fast['kernels']}, "
                  f"loss {fast['loss_path']}; a run's start event records what it used.", highlight=False)
        for m in fast["missing"]:
            con.print(f"  not used: {m}", highlight=False)
    con.print(_calibration_text(where), highlight=False)
    return 0


def _calibration_text(where: dict[str, Any]) -> str:
    """Where the speed calibration lives (:func:`finetuner.planning.calibrate.place`), in a line."""
    if where["speed_file"]:
        return f"Speed calibration: {where['speed_file']} ($FINETUNER_SPEED_FILE, used instead of the cache in {where['folder']})."
    if "file" not in where:
        return f"Speed calibration: cached in {where['folder']} (the CLI, scripts/demo.sh, the web UI and the API share it)."
    state = "measured" if where["cached"] else "not measured yet: `finetuner gpus --calibrate` or the first plan on the CPU measures it"
    return (f"Speed calibration: {where['file']} ({state}; the CLI, scripts/demo.sh, the web UI and the API share this "
            "folder; $FINETUNER_CACHE_DIR moves it).")



def _cmd_calibrate(args: argparse.Namespace) -> int:
    """``gpus --calibrate``: measure this machine's device, cache it, print what was measured."""
    from finetuner.cli.progress import command_phases
    from finetuner.planning import calibrate

    with command_phases():
        speed = calibrate.measure()
    _, name = calibrate.device_key()
    path = calibrate.save(speed, calibrate.cache_file(name))
    summary = calibrate.describe(speed) | {"cached_in": str(path)}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console

    con = Console()
    con.print(f"[bold]{speed.name}[/] ({speed.platform}), measured in {speed.details.get('measured_in_s')} s", highlight=False)
    for dt, rows in summary["matmul_gflops"].items():
        con.print(f"  matmul {dt}, GFLOP/s by width: " + ", ".join(f"{w}: {r:,.0f}" for w, r in rows.items()), highlight=False)
    for kind, rows in summary["attention_gflops"].items():
        con.print(f"  attention ({kind}), GFLOP/s by sequence: " + ", ".join(f"{q}: {r:,.0f}" for q, r in rows.items()), highlight=False)
    con.print(f"  memory bandwidth {summary['bandwidth_gbs']} GB/s; {summary['op_overhead_us']} us an operation; "
              f"dequantization {summary['dequant_gweights_per_s']} G weights/s ({speed.details.get('dequantization')})", highlight=False)
    con.print(f"  cross-entropy M elements/s by vocabulary: {summary['cross_entropy_m_elements_per_s']}; "
              f"dropout {summary['dropout_m_elements_per_s']} M elements/s", highlight=False)
    con.print(f"  a run's wait besides its steps: start-up (importing the libraries) {summary['startup_s']} s; disk read "
              f"{summary['disk_read_mb_per_s']:,} MB/s, write {summary['disk_write_mb_per_s']:,} MB/s, "
              f"{summary['file_sync_ms']} ms to write and fsync a small file", highlight=False)
    con.print(f"Cached in {path}: plans for this device use it (`finetuner plan --gpu auto`).", highlight=False)
    return 0

"""The "what fits where" table of docs/planning.md, from the planner (tests/test_readme.py checks the page matches).

    python -m scripts.dev.fit_table

Paste the output between ``<!-- fit-table:start -->`` and ``<!-- fit-table:end -->`` in docs/planning.md (``python -m scripts.validate.gpu_all --tables`` does it).

The table is the same wherever it is made: every card is planned for a default install
(``GpuProfile.with_default_install``: no Liger Kernel, no FlashAttention-2), whatever this
environment has installed.
The measured column is read from ``docs/validation/`` (the runs ``scripts/validate/memory.py
--planned CARD`` recorded as ``planned-<card>-capped``), never typed in; a recorded run whose
settings are no longer the planner's choice leaves the cell empty, and a note says what that run
measured and what the planner chooses now (measure the new recipe on a GPU to fill the cell).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MODELS = ["llama-2-7b", "qwen2.5-7b", "llama-3.1-8b", "llama-2-13b"]
CARDS = ["rtx4090", "a100-40gb", "a100-80gb"]
#: The settings that make a recorded run the planner's recipe (the rest: the run's own, said in the note).
SAME_RECIPE = ("method", "lora_r", "lora_targets", "micro_batch", "seq_len", "gradient_checkpointing", "optimizer",
               "activation_offload")
SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"
GiB = 2**30

FOOTNOTES = """\
Predicted peak: the memory model's total for full 2,048-token rows (weights, LoRA, gradients,
optimizer states, activations, allocator slack and the {context:.1f} GiB CUDA context) against the card's
usable memory; the planner keeps 5 % of the card free. Planned for a default install: no Liger
Kernel and no FlashAttention-2 (SDPA attention, finetuner's chunked loss); with `finetuner[speed]`
installed, `finetuner plan` counts Liger's fused loss instead, and some of its peaks differ.
`finetuner plan --model M --gpu G --seq-len 2048` prints the choice with its reasons and the
options it rejected.
"""

NOTE = """\
{mark} Measured on an {device} capped at {cap:.2f} GiB (`torch.cuda.set_per_process_memory_fraction`)
by `scripts/validate/memory.py --preset {model} --planned {card}`
([docs/memory.md](memory.md)): the planner's recipe ({method} r{r} on {targets},
micro-batch {mb}, sequence {seq:,} packed, {gc}, {opt}) on a random-weight model of
{model}'s shape, {steps} steps, with accumulation {run_ga} instead of {plan_ga} and packed rows averaging {avg:,.0f}
of {seq:,} tokens{liger}. Measured figures are torch's counters (`max_memory_allocated`,
`max_memory_reserved`); the CUDA context (about {context:.1f} GiB) comes on top, so {card_total:.1f} GiB is the figure
to set against the predicted {predicted:.1f}. The memory model predicts {pa:.1f} GiB allocated ({ea:+.1f} %)
and {pr:.1f} GiB reserved ({er:+.1f} %) for that run{under}.
"""


STALE = """\
{mark} Not measured yet: the recorded run `{config}` ran an earlier planner's recipe for this card
({ran}), on an {device} capped at {cap:.2f} GiB: {alloc:.1f} GiB allocated, {res:.1f} GiB reserved, so {card_total:.1f} GiB with the
CUDA context, above the {keep:.1f} GiB the planner lets itself use ({margin:.0f} % of the card kept free); the memory
model predicts {pa:.1f} GiB allocated ({ea:+.1f} %) and {pr:.1f} GiB reserved ({er:+.1f} %) for that run. The planner
now chooses {now}. `python -m scripts.validate.memory --preset {model} --planned {card}` on a GPU measures it.
"""


def measured_runs() -> dict[tuple[str, str], dict]:
    """(model, card) → the recorded GPU run of the planner's recipe, re-predicted by the current
    memory model (:func:`scripts.validate.memory.replay`), with the file's ``steps``. Where a
    model and card have runs with and without Liger's fused loss, the default install's (without)."""
    import json

    from scripts.validate.memory import VALIDATION, replay

    steps = {json.loads(p.read_text())["preset"]: json.loads(p.read_text()).get("steps") for p in VALIDATION.glob("validate_*.json")}
    out = {}
    for r in replay(VALIDATION):
        m = re.fullmatch(r"planned-(.+)-capped", r["config"])
        if m and "error" not in r:
            key = (r["preset"], m.group(1))
            if key in out and r["predicted_settings"].get("fused_ce") and not out[key]["predicted_settings"].get("fused_ce"):
                continue
            out[key] = {**r, "steps": steps[r["preset"]]}
    return out


def _targets(t) -> str:
    return "all linear layers" if t == "all-linear" else ", ".join(t) if isinstance(t, (list, tuple)) else str(t)


def _under(run: dict, card_bytes: int) -> str:
    """What an under-predicted reserved peak meant for the card."""
    from finetuner.memory.model import CUDA_CONTEXT_BYTES

    if run["error_reserved_pct"] >= 0:
        return ""
    total = run["measured_reserved_bytes"] + CUDA_CONTEXT_BYTES
    return (" (reserved below the measurement: near the cap the allocator fragmented more than the model allows for; "
            f"the run's {total / GiB:.1f} GiB {'still fit in' if total <= card_bytes else 'did not fit in'} the card's "
            f"{card_bytes / GiB:.1f} GiB)")


def table() -> str:
    from finetuner.config.hardware import get_gpu
    from finetuner.memory.model import CUDA_CONTEXT_BYTES
    from finetuner.planning.planner import plan
    from scripts.validate.memory import VALIDATION, replay

    measured = measured_runs()
    context = CUDA_CONTEXT_BYTES / GiB
    lines = ["| model | card | finetuner's plan (seq 2048, effective batch 16) | predicted peak | measured |",
             "|---|---|---|---|---|"]
    notes: list[str] = []
    for m in MODELS:
        for c in CARDS:
            p = plan(m, get_gpu(c).with_default_install(), seq_len=2048)
            if not p.fits:
                lines.append(f"| {m} | {c} | nothing fits: {p.suggestions[0]} | | |")
                continue
            ch = p.recipe_choice()
            method = "LoRA" if ch["method"] == "lora" else f"QLoRA {ch['quantization_bits']}-bit"
            how = (f"{method}, micro-batch {ch['micro_batch_size']} x {ch['gradient_accumulation']}, {ch['optimizer']}, "
                   f"{'checkpointing' if ch['gradient_checkpointing'] else 'no checkpointing'}"
                   f"{', activation offload' if ch['offload_activations'] else ''}")
            cell = ""
            run = measured.get((m, c))
            if run:
                planned, ran = p.estimate.settings, run["predicted_settings"]
                differ = [k for k in SAME_RECIPE if _targets(getattr(planned, k)) != _targets(ran[k])]
                if differ:
                    from finetuner.planning.search import DEFAULT_MARGIN as SAFETY_MARGIN

                    mark = SUPERSCRIPTS[len(notes)]
                    cell = f"not measured {mark}"
                    notes.append(STALE.format(
                        mark=mark, config=run["config"], device=run["device"], cap=run["cap_gib"], model=m, card=c,
                        ran=", ".join(f"{k.replace('_', ' ')} {ran[k]}" for k in differ),
                        now=", ".join(f"{k.replace('_', ' ')} {getattr(planned, k)}" for k in differ),
                        alloc=run["measured_allocated_bytes"] / GiB, res=run["measured_reserved_bytes"] / GiB,
                        card_total=(run["measured_reserved_bytes"] + CUDA_CONTEXT_BYTES) / GiB,
                        keep=p.gpu.memory_bytes * (1 - SAFETY_MARGIN) / GiB, margin=100 * SAFETY_MARGIN,
                        pa=run["predicted_allocated_bytes"] / GiB, ea=run["error_allocated_pct"],
                        pr=run["predicted_reserved_bytes"] / GiB, er=run["error_reserved_pct"]))
                    lines.append(f"| {m} | {c} | {how} | {p.estimate.total_bytes / GiB:.1f} of {p.gpu.memory_gib:.1f} GiB | {cell} |")
                    continue
                mark = SUPERSCRIPTS[len(notes)]
                cell = (f"{run['measured_allocated_bytes'] / GiB:.1f} GiB allocated, "
                        f"{run['measured_reserved_bytes'] / GiB:.1f} GiB reserved {mark}")
                notes.append(NOTE.format(
                    mark=mark, device=run["device"], cap=run["cap_gib"], model=m, card=c,
                    method=method, r=ran["lora_r"], targets=_targets(ran["lora_targets"]), mb=ran["micro_batch"],
                    seq=ran["seq_len"], gc="checkpointing" if ran["gradient_checkpointing"] else "no checkpointing",
                    opt=ran["optimizer"], steps=run["steps"], run_ga=ran["gradient_accumulation"],
                    plan_ga=ch["gradient_accumulation"], avg=run["tokens_per_step"] / ran["micro_batch"],
                    liger=(",\nwith Liger Kernel installed (its fused loss; planned without it, the recipe is the same)"
                           if ran.get("fused_ce") else ""),
                    context=context, card_total=(run["measured_reserved_bytes"] + CUDA_CONTEXT_BYTES) / GiB,
                    predicted=p.estimate.total_bytes / GiB, pa=run["predicted_allocated_bytes"] / GiB,
                    ea=run["error_allocated_pct"], pr=run["predicted_reserved_bytes"] / GiB, er=run["error_reserved_pct"],
                    under=_under(run, p.gpu.memory_bytes)))
            lines.append(f"| {m} | {c} | {how} | {p.estimate.total_bytes / GiB:.1f} of {p.gpu.memory_gib:.1f} GiB | {cell} |")
    others = sum(1 for r in replay(VALIDATION) if not re.fullmatch(r"planned-.+-capped", r["config"]))
    rest = (f"The other {others} GPU runs in `docs/validation/` used settings the planner does not choose for these\n"
            "cards, so they are not in the table: [docs/memory.md](memory.md) lists them all, and\n"
            "[docs/benchmarks.md](benchmarks.md) gives the measured speeds.\n")
    return "\n".join(lines) + "\n\n" + FOOTNOTES.format(context=context) + "".join("\n" + n for n in notes) + "\n" + rest


if __name__ == "__main__":
    print(table(), end="")

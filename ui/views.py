"""Pure functions from finetuner's objects to what the page shows (markdown, HTML, tables, charts).

No gradio here: each function takes engine objects and returns strings, pandas frames or
Vega-Lite chart specifications (plain dicts), so the UI's glue is unit-tested without a browser.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

import pandas as pd

GiB = 1024**3

STATE_LABELS = {
    "starting": ("●", "starting", "#d97706"),
    "running": ("●", "training", "#059669"),
    "finishing": ("●", "finishing", "#059669"),
    "stopped": ("■", "stopped — resume to continue", "#6b7280"),
    "done": ("✓", "finished", "#2563eb"),
    "error": ("✕", "failed", "#dc2626"),
    "interrupted": ("!", "interrupted — resume to continue", "#d97706"),
    "new": ("○", "not started", "#6b7280"),
}


def gib(n: int | float | None, digits: int = 2) -> str:
    if n is None:
        return "–"
    if n < 0.01 * GiB:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / GiB:.{digits}f} GiB"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# --------------------------------------------------------------------------- model & data
def model_card_md(shape: Any, gpu: Any) -> str:
    parts = [f"**{html.escape(shape.name)}** · {shape.model_type} · {shape.num_params / 1e9:.3g} B parameters"
             if shape.num_params >= 1e8 else
             f"**{html.escape(shape.name)}** · {shape.model_type} · {shape.num_params / 1e6:.3g} M parameters",
             f"{shape.num_layers} layers · hidden {shape.hidden_size} · vocabulary {shape.vocab_size:,}"]
    card = f"**{html.escape(gpu.name)}** — {html.escape(gpu.description)} · {gpu.memory_gib:.1f} GiB"
    card += " · bf16" if gpu.bf16 else " · no bf16"
    return "  \n".join(parts) + "\n\n" + card


def data_summary_md(profile: Any, preview: Any | None, seq_len: int) -> str:
    d = profile.to_dict()
    over = profile.truncated(seq_len)
    lines = [
        f"**Format:** `{d['format']}` · **{d['rows']:,}** examples · mean **{d['mean_tokens']:.0f}** tokens, "
        f"95 % under {d['p95_tokens']}, longest **{d['max_tokens']}** · trained on {100 * d['label_fraction']:.0f} % of tokens",
    ]
    if over:
        lines.append(f"**Note:** {over} example(s) are longer than the sequence length {seq_len} and would be cut.")
    else:
        lines.append(f"✓ every example fits in {seq_len} tokens.")
    lines.append(f"<small>counted with {html.escape(d['counted_with'])}</small>")
    return "\n\n".join(lines)


def histogram_df(profile: Any, seq_len: int, bins: int = 24) -> pd.DataFrame:
    """Examples per length bin over 0..max(longest, seq_len): where the data sit against the limit."""
    import math

    top = max(max(profile.lengths), seq_len)
    width = max(1, math.ceil(top / bins))
    counts = [0] * bins
    for n in profile.lengths:
        counts[min(bins - 1, n // width)] += 1
    rows = []
    for i, c in enumerate(counts):
        lo, hi = i * width, (i + 1) * width
        rows.append((f"{lo}–{hi}", c, "fits" if hi <= seq_len else ("cut" if lo >= seq_len else "partly cut")))
    return pd.DataFrame(rows, columns=["tokens", "examples", "fits"])


def preview_highlights(preview: Any) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for i, ex in enumerate(preview.examples):
        if i:
            out.append(("\n\n", None))
        where = ex.where.replace(str(Path(ex.where.split(",")[0]).parent) + "/", "") if "," in ex.where else ex.where
        out.append((f"[{where} · {ex.n_tokens} tokens, {ex.n_trained} trained{' · cut' if ex.truncated else ''}]\n", None))
        out += ex.highlighted()
    return out


# --------------------------------------------------------------------------- plan
def memory_df(estimate: Any) -> pd.DataFrame:
    """The predicted peak by component, then the peak itself, then the card's budget (GiB)."""
    rows = [(name, round(b / GiB, 3), "component") for name, b in estimate.components.items() if b > 0]
    peak = "predicted peak" if estimate.fits else "predicted peak (too big)"
    rows.append(("predicted peak", round(estimate.total_bytes / GiB, 3), peak))
    if estimate.budget_bytes is not None:
        rows.append(("card budget", round(estimate.budget_bytes / GiB, 3), "card budget (95 %)"))
    return pd.DataFrame(rows, columns=["component", "GiB", "kind"])


MEMORY_COLORS = {"component": "#818cf8", "predicted peak": "#10b981", "predicted peak (too big)": "#ef4444",
                 "card budget (95 %)": "#64748b"}

#: the memory chart is drawn against the card's budget unless the budget is more than this many
#: times the predicted peak (a CPU's "card" is most of its RAM): then against the peak, so the
#: components stay readable, and the budget's bar runs off the scale with its value written on it
OFF_SCALE = 4.0


def chart(spec: dict[str, Any]) -> dict[str, Any]:
    """A Vega-Lite specification with what every chart of the page shares: the width of its block,
    labels never shortened, SVG rendering (its text takes the theme's colour from the page's CSS,
    its marks can be read back), no action menu."""
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "width": "container",
        "autosize": {"type": "fit", "contains": "padding"},
        "background": "transparent",
        "config": {
            "font": "ui-sans-serif, system-ui, sans-serif",
            "view": {"stroke": None},
            "axis": {"labelLimit": 0, "labelFontSize": 12, "titleFontSize": 12, "titleFontWeight": "normal",
                     "domain": False, "gridColor": "#94a3b8", "gridOpacity": 0.3, "tickColor": "#94a3b8"},
            "legend": {"labelLimit": 0, "labelFontSize": 12},
            "title": {"fontSize": 14, "subtitleFontSize": 12},
        },
        "usermeta": {"embedOptions": {"renderer": "svg", "actions": False}},
        **spec,
    }


def memory_chart(estimate: Any, gpu: Any) -> dict[str, Any]:
    """The predicted peak by component, the peak and the card's budget as horizontal bars (see
    :data:`OFF_SCALE` for the scale); each bar carries its value."""
    df = memory_df(estimate)
    total = estimate.total_bytes / GiB
    budget = estimate.budget_bytes / GiB if estimate.budget_bytes is not None else None
    against_peak = budget is not None and budget > OFF_SCALE * total
    top = total if against_peak or budget is None else max(total, budget)
    end = top * 1.05
    rows = []
    for r in df.itertuples(index=False):
        off = bool(r.GiB > end)
        label = gib(r.GiB * GiB, 2) + ("  ▸ off the scale" if off else "")
        rows.append({"what": r.component, "GiB": r.GiB, "bar": min(r.GiB, end), "kind": r.kind, "label": label, "off": off,
                     "inside": off or r.GiB >= 0.55 * end})  # a long bar carries its value, a short one after it
    kinds = list(dict.fromkeys(df["kind"]))
    title: dict[str, Any] = {"text": [f"Predicted peak {gib(estimate.total_bytes, 1)}",
                                      f"against {gpu.name} ({gpu.memory_gib:.1f} GiB)"], "frame": "bounds"}
    if against_peak:
        title["subtitle"] = ["drawn to the scale of the peak:", f"the card's budget is {budget / total:,.0f}× larger"]
    bar_y = {"field": "what", "type": "nominal", "sort": None, "title": None, "axis": {"labelLimit": 0}}
    return chart({
        "title": title,
        "height": {"step": 24},
        "data": {"values": rows},
        "encoding": {
            "y": bar_y,
            "x": {"field": "bar", "type": "quantitative", "title": "GiB", "scale": {"domain": [0, end], "nice": False}},
            "tooltip": [{"field": "what", "title": "component"}, {"field": "label", "title": "size"}],
        },
        "layer": [
            {"mark": {"type": "bar", "cornerRadiusEnd": 3},
             "encoding": {"color": {"field": "kind", "type": "nominal", "legend": None,
                                    "scale": {"domain": kinds, "range": [MEMORY_COLORS[k] for k in kinds]}}}},
            {"transform": [{"filter": "!datum.inside"}],
             "mark": {"type": "text", "align": "left", "baseline": "middle", "dx": 4, "fill": "#64748b"},
             "encoding": {"text": {"field": "label"}}},
            {"transform": [{"filter": "datum.inside"}],
             "mark": {"type": "text", "align": "right", "baseline": "middle", "dx": -6, "fill": "#ffffff"},
             "encoding": {"text": {"field": "label"}}},
        ],
    })


def estimate_md(estimate: Any, gpu: Any) -> str:
    total = gib(estimate.total_bytes, 1)
    if estimate.budget_bytes is None:
        return f"Predicted peak **{total}**."
    if estimate.fits:
        return (f"✓ **Fits**: predicted peak **{total}** of {gpu.memory_gib:.1f} GiB on {html.escape(gpu.name)} "
                f"({gib(estimate.headroom_bytes, 1)} to spare).")
    return (f"✕ **Does not fit**: predicted peak **{total}**, but {html.escape(gpu.name)} has a budget of "
            f"{gib(estimate.budget_bytes, 1)}. Lower the micro-batch or sequence length, turn on gradient "
            "checkpointing, or use QLoRA.")


PACKING = {True: " (packed)", "auto": " (packing auto)"}


def recipe_headline(recipe: Any) -> str:
    """The recipe's choice in one line: method, micro-batch × accumulation, sequence, optimizer."""
    t = recipe.training
    quant = f" {recipe.quantization.bits}-bit" if recipe.method == "qlora" and recipe.quantization else ""
    gc = t.gradient_checkpointing
    return (f"{str(recipe.method).upper()}{quant} · micro-batch {t.micro_batch_size} × {t.gradient_accumulation} · "
            f"seq {recipe.data.max_seq_len}{PACKING.get(recipe.data.packing, '')} · {t.optimizer}"
            f"{' · checkpointing' if gc is True else (' · checkpointing auto' if gc == 'auto' else '')}")


def planned(plan: Any) -> dict[str, Any] | None:
    """What the page keeps of a plan to tell, later, whether the recipe shown is still the planner's."""
    if plan.recipe is None:
        return None
    return {"headline": recipe_headline(plan.recipe), "reasons": list(plan.reasons), "notes": list(plan.notes),
            "model": plan.recipe.model.name, "data": plan.recipe.data.path}


def _bullets(items: list[str]) -> str:
    return "\n".join(f"- {html.escape(x)}" for x in items)


def recipe_md(recipe: Any, plan: dict[str, Any] | None) -> str:
    """The headline of the recipe that Train runs, then why: the planner's reasons when it is the
    planner's choice (``plan``, from :func:`planned`), what was changed when it was edited."""
    head = f"### {html.escape(recipe_headline(recipe))}"
    notes = f"\n\n**Notes**\n{_bullets(plan['notes'])}" if plan and plan["notes"] else ""
    if plan is None or (recipe.model.name, recipe.data.path) != (plan["model"], plan["data"]):
        return (f"{head}\n\nA recipe of your own (not a plan for this model and data): press **Make the plan** "
                "for the planner's choice and its reasons.")
    if recipe_headline(recipe) == plan["headline"]:
        return f"{head}\n\n**Why**\n{_bullets(plan['reasons'])}{notes}"
    return (f"{head}\n\n**Changed from the plan.** The planner chose {html.escape(plan['headline'])}, because:\n"
            f"{_bullets(plan['reasons'])}{notes}")


def invalid_recipe_md(message: str) -> str:
    return f"### The recipe below is not valid\n\n{html.escape(message)}"


def plan_md(plan: Any) -> str:
    if not plan.fits:
        return (f"### ✕ Nothing fits {html.escape(plan.gpu.name)}\n{_bullets(plan.reasons)}\n\n"
                f"**What would fit:**\n{_bullets(plan.suggestions)}")
    return recipe_md(plan.recipe, planned(plan))


def rejected_df(plan: Any) -> pd.DataFrame:
    rows = [(r.get("settings", ""), gib(r.get("total_bytes"), 1), r.get("why", "")) for r in plan.rejected]
    return pd.DataFrame(rows, columns=["alternative", "predicted peak", "why not chosen"])


# --------------------------------------------------------------------------- train
def status_html(st: Any | None) -> str:
    if st is None:
        return "<div class='ft-status'><span class='ft-muted'>No run yet. Plan a recipe, then press <b>Start training</b>.</span></div>"
    icon, label, colour = STATE_LABELS.get(st.state, ("?", st.state, "#6b7280"))
    pct = 100.0 * st.progress
    bits = [f"step <b>{st.step}</b> / {st.max_steps or '?'}"]
    if st.state in ("running", "starting") and st.eta_s is not None:
        bits.append(f"ETA <b>{duration(st.eta_s)}</b>")
    if st.elapsed_s is not None:
        bits.append(f"elapsed {duration(st.elapsed_s)}")
    if st.tokens_per_s:
        bits.append(f"<b>{st.tokens_per_s:,.0f}</b> tokens/s")
    if st.last_loss is not None:
        bits.append(f"loss <b>{st.last_loss:.3f}</b>")
    if st.evals:
        bits.append(f"eval loss <b>{st.evals[-1][1]:.3f}</b>")
    err = f"<div class='ft-error'>{html.escape(st.error)}</div>" if st.error and st.state == "error" else ""
    notes = "".join(f"<div class='ft-muted'>{html.escape(n)}</div>" for n in st.notes[-3:])
    return (
        f"<div class='ft-status' data-state='{st.state}'>"
        f"<div class='ft-head'><span style='color:{colour}' class='ft-state'>{icon} {label}</span>"
        f"<span class='ft-run'>{html.escape(st.name)}</span></div>"
        f"<div class='ft-progress'><div class='ft-bar' style='width:{pct:.1f}%;background:{colour}'></div></div>"
        f"<div class='ft-facts'>{' · '.join(bits)}</div>{err}{notes}</div>"
    )


#: the most training-loss points sent to the chart (longer runs are thinned evenly, the last point kept)
MAX_PLOT_POINTS = 400


LOSS_COLORS = {"train": "#6366f1", "eval": "#f97316"}
#: a training-loss line with up to this many points also marks each point (eval points always)
DOTS_UP_TO = 40


def loss_df(st: Any | None) -> pd.DataFrame:
    rows: list[tuple[int, float, str]] = []
    if st is not None:
        train = st.losses
        if len(train) > MAX_PLOT_POINTS:
            every = -(-len(train) // MAX_PLOT_POINTS)
            train = train[::every] + ([train[-1]] if (len(train) - 1) % every else [])
        rows = [(s, round(v, 4), "train") for s, v in train] + [(s, round(v, 4), "eval") for s, v in st.evals]
    return pd.DataFrame(rows, columns=["step", "loss", "series"])


def loss_chart(st: Any | None) -> dict[str, Any]:
    """Training and eval loss against the step, on numeric axes from step 0 to the run's last step:
    a line from two points on, and a dot on each point while there are few (eval points always)."""
    df = loss_df(st)
    series = [s for s in LOSS_COLORS if (df["series"] == s).any()] or ["train"]
    few = int((df["series"] == "train").sum()) <= DOTS_UP_TO
    rows = [{"step": int(r.step), "loss": float(r.loss), "series": r.series, "dot": r.series == "eval" or few}
            for r in df.itertuples(index=False)]
    end = max([getattr(st, "max_steps", None) or 0, 1] + [r["step"] for r in rows])
    every = next(k * 10**e for e in range(12) for k in (1, 2, 5) if k * 10**e * 8 >= end)  # at most 9 ticks
    title = ("Loss — " + " and ".join(series)) if rows else "Loss — waiting for the first step"
    return chart({
        "title": {"text": title, "frame": "bounds"},
        "height": 280,
        "data": {"values": rows},
        "encoding": {
            "x": {"field": "step", "type": "quantitative", "title": "step",
                  "scale": {"domain": [0, end], "nice": False}, "axis": {"values": list(range(0, end + 1, every)), "format": "d"}},
            "y": {"field": "loss", "type": "quantitative", "title": "loss", "scale": {"zero": False}, "axis": {"format": ".3~f"}},
            "color": {"field": "series", "type": "nominal", "title": None, "legend": {"orient": "bottom", "labelLimit": 0},
                      "scale": {"domain": series, "range": [LOSS_COLORS[s] for s in series]}},
            "tooltip": [{"field": "series"}, {"field": "step", "type": "quantitative"},
                        {"field": "loss", "type": "quantitative", "format": ".4f"}],
        },
        "layer": [
            {"mark": {"type": "line", "strokeWidth": 2}, "encoding": {}},
            {"transform": [{"filter": "datum.dot"}], "encoding": {},
             "mark": {"type": "point", "filled": True, "size": 50, "opacity": 1, "strokeWidth": 0}},
        ],
    })


def memory_md(st: Any | None) -> str:
    if st is None:
        return ""
    what = st.measured_what or ("process peak RSS" if (st.device or "cpu") == "cpu" else "peak allocated")
    line = f"**Memory** — predicted peak {gib(st.predicted_bytes)} allocated · measured {gib(st.measured_peak_bytes)} ({what})"
    if st.device == "cpu":
        line += "  \n<small>On CPU the measurement is the whole process (Python, libraries, data), so it is not comparable 1:1 with the device prediction.</small>"
    elif st.predicted_bytes and st.measured_peak_bytes:
        err = 100 * (st.predicted_bytes - st.measured_peak_bytes) / st.measured_peak_bytes
        line += f" · prediction {err:+.1f} %"
    return line + ("  \n<small>Allocated: what tensors hold at the peak. The Plan tab's peak is what the card must "
                   "hold: that plus the allocator's reserve and the CUDA context.</small>")


def samples_md(st: Any | None) -> str:
    if st is None or not st.samples:
        return ""
    rows = ["| prompt | base model | fine-tuned |", "|---|---|---|"]
    for s in st.samples:
        cells = [html.escape(str(s.get(k, ""))).replace("\n", " ").replace("|", "\\|") for k in ("prompt", "base", "fine_tuned")]
        rows.append("| " + " | ".join(cells) + " |")
    return "**Samples after training**\n\n" + "\n".join(rows)


def runs_df(runs: list[Any]) -> pd.DataFrame:
    rows = []
    for r in runs:
        rows.append(
            (
                r.name,
                STATE_LABELS.get(r.state, ("", r.state, ""))[1].split(" —")[0],
                f"{r.step}/{r.max_steps or '?'}",
                "–" if r.last_loss is None else f"{r.last_loss:.3f}",
                "–" if not r.evals else f"{r.evals[-1][1]:.3f}",
                time.strftime("%Y-%m-%d %H:%M", time.localtime(r.modified)) if r.modified else "",
            )
        )
    return pd.DataFrame(rows, columns=["run", "state", "steps", "loss", "eval loss", "updated"])

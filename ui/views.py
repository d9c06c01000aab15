"""Pure functions from finetuner's objects to what the page shows (markdown, HTML, tables, charts).

No gradio here: each function takes engine objects and returns strings, pandas frames or
Vega-Lite chart specifications (plain dicts), so the UI's glue is unit-tested without a browser.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pandas as pd

from finetuner.model.shapes import parameter_count
from finetuner.objectives.specs import DEFAULT as DEFAULT_OBJECTIVE
from finetuner.text import CUT_MARK, cut_words
from finetuner.units import GiB, gib_text, in_gib

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
    return gib_text(n, digits)


# --------------------------------------------------------------------------- model & data
def model_card_md(shape: Any, gpu: Any, gguf_note: str | None = None) -> str:
    """The Model tab's card: the model's size and shape, the card; ``gguf_note``: what loading it from a GGUF file means."""
    parts = [f"**{html.escape(shape.name)}** · {shape.model_type} · {parameter_count(shape.num_params)} parameters"
             if shape.num_params >= 1e8 else
             f"**{html.escape(shape.name)}** · {shape.model_type} · {shape.num_params / 1e6:.3g} M parameters",
             f"{shape.num_layers} layers · hidden {shape.hidden_size} · vocabulary {shape.vocab_size:,}"]
    card = f"**{html.escape(gpu.name)}** — {html.escape(gpu.description)} · {gpu.memory_gib:.1f} GiB"
    card += " · bf16" if gpu.bf16 else " · no bf16"
    if gguf_note:
        parts.append(f"**Note:** {html.escape(gguf_note)}")
    return "  \n".join(parts) + "\n\n" + card


def data_summary_md(profile: Any, preview: Any | None, seq_len: int) -> str:
    d = profile.to_dict()
    over = profile.truncated(seq_len)
    lines = [
        f"**Format:** `{d['format_label']}` · **{d['rows']:,}** examples · mean **{d['mean_tokens']:.0f}** tokens, "
        f"95 % under {d['p95_tokens']}, longest **{d['max_tokens']}** · trained on {100 * d['label_fraction']:.0f} % of tokens",
    ]
    if d["pictures"] and d["picture_tokens"]:  # counted through the model's processor, in the lengths above
        lines.append(f"**{d['pictures']:,}** pictures · {d['picture_tokens'] / d['pictures']:.0f} image tokens a picture "
                     f"({d['picture_tokens']:,} in all, in the lengths above)")
    elif d["pictures"]:
        lines.append(f"**{d['pictures']:,}** pictures, not counted: this model reads no pictures here (an "
                     "image-text-to-text model with its processor does)")
    if over:
        lines.append(f"**Note:** {over} example(s) are longer than the sequence length {seq_len} and would be cut.")
    else:
        lines.append(f"✓ every example fits in {seq_len} tokens.")
    lines += bad_rows_lines(d)  # a missing picture, or one outside a served UI's folders, is said here
    lines.append(f"<small>counted with {html.escape(d['counted_with'])}</small>")
    return "\n\n".join(lines)


#: the most characters of one text shown in the Data tab's table of pairs (the rest is counted)
CELL_CHARS = 600


def preference_summary_md(profile: Any, seq_len: int) -> str:
    """What a file of preference pairs or rated responses holds, the objectives it fits (and the one
    the Plan tab's objective ``auto`` takes), its size and token lengths against ``seq_len``."""
    from finetuner.data.formats import KIND_WORDS, OBJECTIVES_OF_KIND
    from finetuner.data.formats import AUTO_OBJECTIVE

    d = profile.to_dict()
    kind = d["kind"]
    unit = "pairs" if kind == "pairs" else "rated responses"
    lines = [
        f"**Holds** {html.escape(KIND_WORDS[kind])} · layout `{d['format_label']}` · **{d['rows']:,}** {unit}",
        f"**Fits objective {OBJECTIVES_OF_KIND[kind]}** (the plan's objective *auto* takes **{AUTO_OBJECTIVE[kind]}**)",
        f"mean **{d['mean_tokens']:.0f}** tokens, 95 % under {d['p95_tokens']}, longest **{d['max_tokens']}**"
        + (" (prompt and the longer response)" if kind == "pairs" else " (prompt and response)"),
    ]
    over = profile.truncated(seq_len)
    if over:
        lines.append(f"**Note:** {over} example(s) are longer than the sequence length {seq_len}: their prompts would be "
                     "cut from the start.")
    else:
        lines.append(f"✓ every example fits in {seq_len} tokens.")
    lines += bad_rows_lines(d)
    lines.append(f"<small>counted with {html.escape(d['counted_with'])}</small>")
    return "\n\n".join(lines)


def bad_rows_lines(d: dict[str, Any]) -> list[str]:
    """How many rows of a profile (its ``to_dict()``) cannot be used and the first one's reason; none when all can."""
    if not d.get("bad_rows"):
        return []
    return [f"**{d['bad_rows']} row(s) cannot be used**, the first: {html.escape(str(d['first_bad_row']))}"]


def _cell_text(text: str) -> str:
    shown = cut_words(text, CELL_CHARS)  # between words
    more = len(text) - len(shown.removesuffix(CUT_MARK)) if shown != text else 0
    return html.escape(shown) + (f"<span class='ft-muted'> ({more:,} more characters)</span>" if more > 0 else "")


def _prompt_cell(prompt: list[dict[str, str]], where: str) -> str:
    """The prompt's messages (a lone user message as its text, a conversation with its roles) and the row."""
    if len(prompt) == 1:
        body = _cell_text(prompt[0]["content"])
    else:
        body = "".join(f"<div class='ft-msg'><b>{html.escape(m['role'])}</b> {_cell_text(m['content'])}</div>" for m in prompt)
    row = where.rsplit(", ", 1)[-1]
    return f"{body}<div class='ft-where'>{html.escape(row)}</div>"


#: the longest side of a picture's thumbnail in the Data tab, in pixels
THUMBNAIL = 96


def thumbnail_src(path: str) -> str:
    """A picture as a ``data:`` URI of a PNG thumbnail (at most :data:`THUMBNAIL` pixels a side): the page shows it
    without serving the file; an unreadable picture gives an empty string, one over finetuner's most pixels its
    one-line refusal (:func:`finetuner.data.picture_files.thumbnail_png`, which decodes it reduced)."""
    import base64

    from finetuner.data.picture_files import thumbnail_png

    png = thumbnail_png(path, THUMBNAIL)
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii") if png else ""


def pictures_html(preview: Any) -> str:
    """The pictures of the first examples of a file with pictures, as thumbnails under each example's place (a
    :class:`finetuner.data.preview.DataPreview`); empty when none has a picture."""
    blocks = []
    for ex in preview.examples:
        if not ex.images:
            continue
        thumbs = "".join(
            f"<figure class='ft-thumb'><img src='{thumbnail_src(p)}' alt='{html.escape(Path(p).name)}'>"
            f"<figcaption>{html.escape(Path(p).name)}</figcaption></figure>" for p in ex.images)
        blocks.append(f"<div class='ft-thumbs'><div class='ft-thumbs-where'>{html.escape(ex.where)}</div>{thumbs}</div>")
    if not blocks:
        return ""
    return f"<div class='ft-pairs-title'>The pictures of the first {len(blocks)} examples</div>" + "".join(blocks)


def pairs_html(preview: Any) -> str:
    """The first examples of a preference file side by side: prompt | chosen | rejected for pairs,
    prompt | response | label for rated responses (a :class:`finetuner.data.preview.PreferencePreview`)."""
    pairs = preview.kind == "pairs"
    heads = ("prompt", "chosen ✓", "rejected ✕") if pairs else ("prompt", "response", "label")
    rows = []
    for ex in preview.examples:
        if pairs:
            cells = (f"<td class='ft-chosen'>{_cell_text(ex.chosen)}</td>"
                     f"<td class='ft-rejected'>{_cell_text(ex.rejected)}</td>")
        else:
            label = "<td class='ft-chosen'>✓ desirable</td>" if ex.desirable else "<td class='ft-rejected'>✕ undesirable</td>"
            cells = f"<td>{_cell_text(ex.response)}</td>{label}"
        rows.append(f"<tr><td class='ft-prompt'>{_prompt_cell(ex.prompt, ex.where)}</td>{cells}</tr>")
    cols = "<colgroup><col style='width:30%'><col style='width:35%'><col style='width:35%'></colgroup>" if pairs else \
        "<colgroup><col style='width:35%'><col style='width:47%'><col style='width:18%'></colgroup>"
    head = "".join(f"<th>{h}</th>" for h in heads)
    what = "pairs" if pairs else "rated responses"
    return (f"<div class='ft-pairs-title'>The first {len(preview.examples)} {what} as training reads them "
            f"(layout {html.escape(preview.layout)})</div>"
            f"<table class='ft-pairs' data-kind='{preview.kind}'>{cols}<thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def prompts_summary_md(profile: Any, seq_len: int, not_sft: str) -> str:
    """What a file of prompts alone holds (``kind`` prompts, :func:`finetuner.data.stats.profile_prompts`): the
    objective it fits (grpo, with a reward), its size and prompt lengths against ``seq_len``; ``not_sft``: why
    it is not supervised data (the reader's message)."""
    from finetuner.data.formats import KIND_WORDS

    d = profile.to_dict()
    over = profile.truncated(seq_len)
    lines = [
        f"**Holds** {html.escape(KIND_WORDS['prompts'])} · **{d['rows']:,}** prompts, no responses to train on",
        "**Fits objective grpo**: choose it in the Plan tab's Objective menu and name a reward",
        f"prompts of mean **{d['mean_tokens']:.0f}** tokens, 95 % under {d['p95_tokens']}, longest **{d['max_tokens']}**",
        (f"**Note:** {over} prompt(s) are longer than the sequence length {seq_len}." if over
         else f"✓ every prompt fits in {seq_len} tokens."),
    ]
    if d.get("bad_rows"):
        lines.append(f"**{d['bad_rows']} row(s) cannot be used**, the first: {html.escape(str(d['first_bad_row']))}")
    lines.append(f"<small>Not supervised examples: {html.escape(not_sft.splitlines()[0])} · counted with "
                 f"{html.escape(d['counted_with'])}</small>")
    return "\n\n".join(lines)


def prompts_html(preview: Any) -> str:
    """The first prompts of a file as objective grpo reads them, with the columns the reward functions get
    (a :class:`finetuner.data.preview.PromptsPreview`)."""
    rows = []
    for ex in preview.examples:
        cols = "".join(f"<div class='ft-msg'><b>{html.escape(str(k))}</b> {_cell_text(str(v))}</div>" for k, v in ex.columns.items())
        rows.append(f"<tr><td class='ft-prompt'>{_prompt_cell(ex.messages, ex.where)}</td><td>{cols or '—'}</td></tr>")
    return (f"<div class='ft-pairs-title'>The first {len(preview.examples)} prompts as GRPO reads them "
            "(completions are generated; the rewards get the other columns by name)</div>"
            "<table class='ft-pairs' data-kind='prompts'><colgroup><col style='width:55%'><col style='width:45%'></colgroup>"
            f"<thead><tr><th>prompt</th><th>other columns (for the rewards)</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


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
    rows = [(name, round(in_gib(b), 3), "component") for name, b in estimate.components.items() if b > 0]
    peak = "predicted peak" if estimate.fits else "predicted peak (too big)"
    rows.append(("predicted peak", round(in_gib(estimate.total_bytes), 3), peak))
    if estimate.budget_bytes is not None:
        rows.append(("card budget", round(in_gib(estimate.budget_bytes), 3), "card budget (95 %)"))
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
    total = in_gib(estimate.total_bytes)
    budget = in_gib(estimate.budget_bytes) if estimate.budget_bytes is not None else None
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
    """The recipe's choice in one line: the objective (when not the default, sft), method, micro-batch ×
    accumulation, sequence, optimizer."""
    t = recipe.training
    quant = f" {recipe.quantization.bits}-bit" if recipe.method == "qlora" and recipe.quantization else ""
    gc = t.gradient_checkpointing
    head = f"{recipe.objective.upper()} · " if recipe.objective != DEFAULT_OBJECTIVE else ""
    return (f"{head}{str(recipe.method).upper()}{quant} · micro-batch {t.micro_batch_size} × {t.gradient_accumulation} · "
            f"seq {recipe.data.max_seq_len}{PACKING.get(recipe.data.packing, '')} · {t.optimizer}"
            f"{' · checkpointing' if gc is True else (' · checkpointing auto' if gc == 'auto' else '')}")


def planned(plan: Any) -> dict[str, Any] | None:
    """What the page keeps of a plan to tell, later, whether the recipe shown is still the planner's;
    when nothing fits, of the option that needs the least memory (``plan.closest``), with the card
    it does not fit and what would."""
    recipe = plan.recipe if plan.recipe is not None else getattr(plan, "closest", None)
    if recipe is None:
        return None
    kept = {"headline": recipe_headline(recipe), "reasons": list(plan.reasons), "notes": list(plan.notes),
            "model": recipe.model.name, "data": recipe.data.path}
    if plan.recipe is None:
        kept |= {"nothing_fits": plan.gpu.name, "suggestions": list(plan.suggestions)}
    elif getattr(plan, "step", None) is not None:
        kept["time"] = plan.time_line()  # tokens/s, time per step, optimizer steps, total time (the speed model)
        kept["timed"] = timed_settings(recipe)
    return kept


def timed_settings(recipe: Any) -> list[Any]:
    """What a plan's time depends on beyond its headline: the steps (``max_steps``, ``epochs``) and the batch."""
    t = recipe.training
    return [t.max_steps, t.epochs, t.effective_batch_size, recipe.data.max_seq_len]


def _bullets(items: list[str]) -> str:
    return "\n".join(f"- {html.escape(x)}" for x in items)


def recipe_md(recipe: Any, plan: dict[str, Any] | None, time: str | None = None) -> str:
    """The headline of the recipe that Train runs, then why: the planner's reasons when it is the
    planner's choice (``plan``, from :func:`planned`), what was changed when it was edited. ``time``:
    the recipe's predicted time as it now stands (:func:`time_text`), shown instead of the plan's."""
    head = f"### {html.escape(recipe_headline(recipe))}"
    timed = f"\n\n**Time:** {html.escape(time)}" if time else ""
    notes = f"\n\n**Notes**\n{_bullets(plan['notes'])}" if plan and plan["notes"] else ""
    if plan is None or (recipe.model.name, recipe.data.path) != (plan["model"], plan["data"]):
        return (f"{head}\n\nA recipe of your own (not a plan for this model and data): press **Make the plan** "
                f"for the planner's choice and its reasons.{timed}")
    if recipe_headline(recipe) == plan["headline"] and plan.get("nothing_fits"):
        return (f"### ✕ Nothing fits {html.escape(plan['nothing_fits'])}\n{_bullets(plan['reasons'])}\n\n"
                f"**What would fit:**\n{_bullets(plan['suggestions'])}\n\nThe recipe below is the option that needs the "
                f"least memory ({html.escape(plan['headline'])}): it does not fit either.{notes}")
    if recipe_headline(recipe) == plan["headline"]:
        # the plan's time only while the recipe is still timed as planned (the line under the editor follows every edit)
        same = plan.get("timed") is None or plan["timed"] == timed_settings(recipe)
        if not timed and plan.get("time") and same:
            timed = f"\n\n**Time:** {html.escape(plan['time'])}"
        return f"{head}{timed}\n\n**Why**\n{_bullets(plan['reasons'])}{notes}"
    return (f"{head}\n\n**Changed from the plan.** The planner chose {html.escape(plan['headline'])}, because:\n"
            f"{_bullets(plan['reasons'])}{timed}{notes}")


def invalid_recipe_md(message: str) -> str:
    return f"### The recipe below is not valid\n\n{html.escape(message)}"


def plan_md(plan: Any) -> str:
    if plan.recipe is None and getattr(plan, "closest", None) is not None:
        return recipe_md(plan.closest, planned(plan))
    if not plan.fits:
        return (f"### ✕ Nothing fits {html.escape(plan.gpu.name)}\n{_bullets(plan.reasons)}\n\n"
                f"**What would fit:**\n{_bullets(plan.suggestions)}")
    return recipe_md(plan.recipe, planned(plan))


def rejected_df(plan: Any) -> pd.DataFrame:
    rows = [(r.get("settings", ""), gib(r.get("total_bytes"), 1), r.get("why", "")) for r in plan.rejected]
    return pd.DataFrame(rows, columns=["alternative", "predicted peak", "why not chosen"])


# --------------------------------------------------------------------------- train

def time_text(t: dict[str, Any]) -> str:
    """A recipe's predicted time, from :func:`finetuner.planning.predict.estimate_time`, in a few words
    (:func:`finetuner.planning.time_text.time_text`, brief: as ``estimate`` says it, without the parts)."""
    from finetuner.planning.time_text import estimate_text

    return estimate_text(t, brief=True)

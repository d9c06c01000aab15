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

from finetuner.model.shapes import parameter_count
from finetuner.runs.schema import ACTIVE_STATES
from finetuner.text import CUT_MARK, cut_words

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
    """The recipe's choice in one line: the objective (when not sft), method, micro-batch ×
    accumulation, sequence, optimizer."""
    t = recipe.training
    quant = f" {recipe.quantization.bits}-bit" if recipe.method == "qlora" and recipe.quantization else ""
    gc = t.gradient_checkpointing
    head = f"{recipe.objective.upper()} · " if recipe.objective != "sft" else ""
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
def tracked_html(where: dict[str, str]) -> str:
    """Where the trackers keep the run (:func:`finetuner.tracking.report.tracked_at`): a server's page as a link,
    a folder or a store as text."""
    def one(name: str, place: str) -> str:
        if place.startswith(("http://", "https://")):
            return f"{html.escape(name)}: <a href='{html.escape(place, quote=True)}' target='_blank'>{html.escape(place)}</a>"
        return f"{html.escape(name)}: <code>{html.escape(place)}</code>"
    return "".join(f"<div class='ft-muted ft-tracked'>{one(n, p)}</div>" for n, p in where.items())


def status_html(st: Any | None, tracked: dict[str, str] | None = None) -> str:
    """The Train tab's status line of the run ``st``; ``tracked``: where its trackers keep it (:func:`tracked_html`)."""
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
    rewards = getattr(st, "rewards", None) or {}
    if rewards.get("reward_accuracy"):
        bits.append(f"reward accuracy <b>{rewards['reward_accuracy'][-1][1]:.0%}</b>")
    if rewards.get("eval_reward_accuracy"):
        bits.append(f"eval reward accuracy <b>{rewards['eval_reward_accuracy'][-1][1]:.0%}</b>")
    phase = getattr(st, "phase", None)
    if phase and st.state in ACTIVE_STATES:  # loading, tokenizing, replay answers, an evaluation ... (finetuner.phases)
        bits.insert(0, f"<span class='ft-phase'>{html.escape(phase)}</span>")
    err = f"<div class='ft-error'>{html.escape(st.error)}</div>" if st.error and st.state == "error" else ""
    notes = "".join(f"<div class='ft-muted'>{html.escape(n)}</div>" for n in st.notes[-3:])
    return (
        f"<div class='ft-status' data-state='{st.state}'>"
        f"<div class='ft-head'><span style='color:{colour}' class='ft-state'>{icon} {label}</span>"
        f"<span class='ft-run'>{html.escape(st.name)}</span></div>"
        f"<div class='ft-progress'><div class='ft-bar' style='width:{pct:.1f}%;background:{colour}'></div></div>"
        f"<div class='ft-facts'>{' · '.join(bits)}</div>{err}{notes}{tracked_html(tracked or {})}</div>"
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


def step_axis(st: Any | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The x encoding of a chart against the step: 0 to the run's last step (or the last point), at most 9 ticks."""
    end = max([getattr(st, "max_steps", None) or 0, 1] + [r["step"] for r in rows])
    every = next(k * 10**e for e in range(12) for k in (1, 2, 5) if k * 10**e * 8 >= end)
    return {"field": "step", "type": "quantitative", "title": "step",
            "scale": {"domain": [0, end], "nice": False}, "axis": {"values": list(range(0, end + 1, every)), "format": "d"}}


def loss_chart(st: Any | None) -> dict[str, Any]:
    """Training and eval loss against the step, on numeric axes from step 0 to the run's last step:
    a line from two points on, and a dot on each point while there are few (eval points always)."""
    df = loss_df(st)
    series = [s for s in LOSS_COLORS if (df["series"] == s).any()] or ["train"]
    few = int((df["series"] == "train").sum()) <= DOTS_UP_TO
    rows = [{"step": int(r.step), "loss": float(r.loss), "series": r.series, "dot": r.series == "eval" or few}
            for r in df.itertuples(index=False)]
    x_axis = step_axis(st, rows)
    title = ("Loss — " + " and ".join(series)) if rows else "Loss — waiting for the first step"
    return chart({
        "title": {"text": title, "frame": "bounds"},
        "height": 280,
        "data": {"values": rows},
        "encoding": {
            "x": x_axis,
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


#: the reward chart's series: (field of RunStatus.rewards, name in the legend, colour, dashed)
REWARD_SERIES = (
    ("reward_accuracy", "accuracy", "#059669", False),
    ("eval_reward_accuracy", "eval accuracy", "#f97316", False),
    ("reward_margin", "margin", "#64748b", True),
    ("eval_reward_margin", "eval margin", "#a855f7", True),
)


def is_preference(st: Any | None) -> bool:
    """Whether ``st`` is a run of an objective scored by rewards, a preference objective or GRPO (its start event names
    it, or it logged rewards); not one that trains on the token loss alone, as SFT and NEFTune do."""
    from finetuner.objectives.specs import SPECS

    objective = getattr(st, "objective", None)
    return st is not None and ((objective in SPECS and SPECS[objective].scorer != "loss") or bool(getattr(st, "rewards", None)))


def _thin(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(points) <= MAX_PLOT_POINTS:
        return points
    every = -(-len(points) // MAX_PLOT_POINTS)
    return points[::every] + ([points[-1]] if (len(points) - 1) % every else [])


def _series_rows(values: dict[str, list[tuple[int, float]]], series: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """A chart's rows: each series ``(key of values, name, extra fields)`` as ``{"step", "value",
    "series", "dot", **extra}``; training series thinned (dots while they are few), eval points
    (keys ``eval_…``) always dots."""
    rows = []
    for key, name, extra in series:
        points = values.get(key) or []
        train = not key.startswith("eval_")
        few = len(points) <= DOTS_UP_TO
        for step, v in (_thin(points) if train else points):
            rows.append({"step": int(step), "value": round(float(v), 4), "series": name, "dot": (not train) or few, **extra})
    return rows


#: colours of a GRPO run's reward functions (after the total's and the held-out total's)
FUNCTION_COLOURS = ("#64748b", "#a855f7", "#0ea5e9", "#eab308", "#ec4899", "#14b8a6")


def grpo_reward_chart(st: Any) -> dict[str, Any]:
    """A GRPO run's mean total reward of each step's completions, the held-out prompts' mean reward as
    dots, and each reward function's mean dashed (their weighted sum is the total)."""
    rewards = getattr(st, "group_rewards", None) or {}
    functions = sorted({k.split(":", 1)[1] for k in rewards if ":" in k})
    series = [("reward", "reward (total)", "#059669", False), ("eval_reward", "held-out reward", "#f97316", False)]
    series += [(f"reward:{f}", f, FUNCTION_COLOURS[i % len(FUNCTION_COLOURS)], True) for i, f in enumerate(functions)]
    rows = _series_rows(rewards, [(key, name, {"dashed": dashed}) for key, name, _c, dashed in series])
    shown = [x for x in series if rewards.get(x[0])] or series[:1]
    last = rewards.get("reward") or []
    title = (f"Mean reward — {last[-1][1]:.3f} at step {last[-1][0]}" if last else "Mean reward — waiting for the first step")
    colour = {"field": "series", "type": "nominal", "title": None, "legend": {"orient": "bottom", "labelLimit": 0, "columns": 2},
              "scale": {"domain": [n for _k, n, _c, _d in shown], "range": [c for _k, _n, c, _d in shown]}}
    tooltip = [{"field": "series"}, {"field": "step", "type": "quantitative"},
               {"field": "value", "type": "quantitative", "format": ".3f"}]
    return chart({
        "title": {"text": title, "frame": "bounds"},
        "height": 280,
        "data": {"values": rows},
        "encoding": {"x": step_axis(st, rows), "y": {"field": "value", "type": "quantitative", "title": "mean reward",
                                                      "scale": {"zero": False}},
                     "color": colour, "tooltip": tooltip},
        "layer": [
            {"transform": [{"filter": "!datum.dashed"}], "mark": {"type": "line", "strokeWidth": 2}},
            {"transform": [{"filter": "datum.dashed"}], "mark": {"type": "line", "strokeWidth": 2, "strokeDash": [5, 3]}},
            {"transform": [{"filter": "datum.dot"}], "mark": {"type": "point", "filled": True, "size": 50, "opacity": 1,
                                                               "strokeWidth": 0}},
        ],
    })


def reward_chart(st: Any | None) -> dict[str, Any]:
    """A preference run's reward accuracy (the share of pairs whose chosen response the model
    rewards more; KTO: of responses rewarded on the side of their label) on a 0–100 % axis, and the
    reward margin (chosen − rejected) dashed on an axis of its own on the right; eval points as dots.
    A GRPO run's chart is :func:`grpo_reward_chart`."""
    if st is not None and getattr(st, "objective", None) == "grpo":
        return grpo_reward_chart(st)
    rewards = (getattr(st, "rewards", None) or {}) if st is not None else {}
    rows = _series_rows(rewards, [(key, name, {"metric": "accuracy" if key.endswith("accuracy") else "margin"})
                                  for key, name, _c, _d in REWARD_SERIES])
    shown = [r for r in REWARD_SERIES if rewards.get(r[0])] or [REWARD_SERIES[0]]
    series = [name for _k, name, _c, _d in shown]
    colours = [c for _k, _n, c, _d in shown]
    x_axis = step_axis(st, rows)
    last = rewards.get("reward_accuracy") or []
    title = (f"Reward accuracy — {last[-1][1]:.0%} at step {last[-1][0]}" if last
             else "Reward accuracy — waiting for the first step")
    colour = {"field": "series", "type": "nominal", "title": None,
              "legend": {"orient": "bottom", "labelLimit": 0, "columns": 2},
              "scale": {"domain": series, "range": colours}}
    tooltip = [{"field": "series"}, {"field": "step", "type": "quantitative"},
               {"field": "value", "type": "quantitative", "format": ".3f"}]

    def lines(metric: str, y: dict[str, Any], dash: list[int] | None) -> dict[str, Any]:
        line = {"type": "line", "strokeWidth": 2, **({"strokeDash": dash} if dash else {})}
        return {
            "transform": [{"filter": f"datum.metric === '{metric}'"}],
            "encoding": {"y": y, "color": colour, "tooltip": tooltip},
            "layer": [
                {"mark": line},
                {"transform": [{"filter": "datum.dot"}],
                 "mark": {"type": "point", "filled": True, "size": 50, "opacity": 1, "strokeWidth": 0}},
            ],
        }

    layers = [lines("accuracy", {"field": "value", "type": "quantitative", "title": "reward accuracy",
                                 "scale": {"domain": [0, 1]}, "axis": {"format": ".0%", "values": [0, 0.25, 0.5, 0.75, 1]}},
                    None)]
    if any(r["metric"] == "margin" for r in rows):
        layers.append(lines("margin", {"field": "value", "type": "quantitative", "title": "margin (dashed)",
                                       "scale": {"zero": False}, "axis": {"orient": "right", "format": ".3~r", "grid": False}},
                            [5, 3]))
    return chart({
        "title": {"text": title, "frame": "bounds"},
        "height": 280,
        "data": {"values": rows},
        "encoding": {
            "x": x_axis,
        },
        "layer": layers,
        "resolve": {"scale": {"y": "independent"}},
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


def _cell(value: Any) -> str:
    return html.escape(str(value)).replace("\n", " ").replace("|", "\\|")


def completions_md(st: Any | None) -> str:
    """A GRPO run's latest sampled completions with their rewards (total and per function)."""
    comps = getattr(st, "completions", None) if st is not None else None
    if not comps:
        return ""
    names = list(dict.fromkeys(k for c in comps for k in (c.get("rewards") or {})))
    rows = ["| prompt | completion | reward | " + " | ".join(_cell(n) for n in names) + (" |" if names else ""),
            "|---|---|---|" + "---|" * len(names)]
    for c in comps:
        per = c.get("rewards") or {}
        cells = [_cell(c.get("prompt", "")), _cell(c.get("completion", "")), f"{c.get('reward', float('nan')):.3f}",
                 *("–" if per.get(n) is None else f"{per[n]:.3f}" for n in names)]
        rows.append("| " + " | ".join(cells) + " |")
    return f"**Sampled completions at step {st.completions_step}**\n\n" + "\n".join(rows)


def samples_md(st: Any | None) -> str:
    """The samples after training (base against fine-tuned), then a GRPO run's latest sampled completions with
    their rewards (:func:`completions_md`): a planned recipe carries sample prompts, and the rewards stay in view."""
    completions = completions_md(st)
    if st is None or not st.samples:
        return completions
    rows = ["| prompt | base model | fine-tuned |", "|---|---|---|"]
    for s in st.samples:
        cells = [html.escape(str(s.get(k, ""))).replace("\n", " ").replace("|", "\\|") for k in ("prompt", "base", "fine_tuned")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n\n".join(filter(None, ["**Samples after training**\n\n" + "\n".join(rows), completions]))


#: the Past runs table's columns
RUNS_COLUMNS = ["run", "state", "data", "objective", "steps", "loss", "eval loss", "updated"]


def run_row(r: Any) -> tuple:
    """A run's row in the Past runs table: what it trains on and how, and how far it got."""
    return (
        r.name,
        STATE_LABELS.get(r.state, ("", r.state, ""))[1].split(" —")[0],
        ", ".join(Path(p).name for p in r.data) or "–",
        r.objective or "–",
        f"{r.step}/{r.max_steps or '?'}",
        "–" if r.last_loss is None else f"{r.last_loss:.3f}",
        "–" if not r.evals else f"{r.evals[-1][1]:.3f}",
        time.strftime("%Y-%m-%d %H:%M", time.localtime(r.modified)) if r.modified else "",
    )


def runs_table(rows: list[tuple]) -> pd.DataFrame:
    """The Past runs table of rows made by :func:`run_row`."""
    return pd.DataFrame(rows, columns=RUNS_COLUMNS)


def runs_df(runs: list[Any]) -> pd.DataFrame:
    return runs_table([run_row(r) for r in runs])


def time_text(t: dict[str, Any]) -> str:
    """A recipe's predicted time, from :func:`finetuner.planning.predict.estimate_time`, in a few words
    (:func:`finetuner.planning.time_text.time_text`, brief: as ``estimate`` says it, without the parts)."""
    from finetuner.planning.time_text import estimate_text

    return estimate_text(t, brief=True)

"""What the Train and Runs tabs show of a run: its status line, the loss and reward charts, memory,
samples and completions, and the table of runs. Pure functions like :mod:`ui.views` (no gradio).
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

import pandas as pd

from finetuner.infer.generate import sample_cell
from finetuner.runs.schema import ACTIVE_STATES
from finetuner.units import clock_text
from ui.views import STATE_LABELS, chart, gib


def tracked_html(where: dict[str, str]) -> str:
    """Where the trackers keep the run (:func:`finetuner.tracking.report.tracked_at`): a server's page as a link,
    a folder or a store as text."""
    def one(name: str, place: str) -> str:
        if place.startswith(("http://", "https://")):
            return f"{html.escape(name)}: <a href='{html.escape(place, quote=True)}' target='_blank'>{html.escape(place)}</a>"
        return f"{html.escape(name)}: <code>{html.escape(place)}</code>"
    return "".join(f"<div class='ft-muted ft-tracked'>{one(n, p)}</div>" for n, p in where.items())


def terminal_note(st: Any) -> str:
    """What the Train tab says of a run another process trains (:attr:`finetuner.runs.jobs.RunStatus.terminal`):
    where it was started, where to stop it, and that Start here waits for it."""
    from finetuner.runs.jobs import TERMINAL_WHERE

    pid = f" (pid {st.pid})" if st.pid else ""
    return (f"{st.name} was {TERMINAL_WHERE}{pid}: stop it there (Ctrl-C saves a checkpoint). This page does not stop "
            "it, and starts no other run on its device until it ends.")


def status_html(st: Any | None, tracked: dict[str, str] | None = None) -> str:
    """The Train tab's status line of the run ``st``; ``tracked``: where its trackers keep it (:func:`tracked_html`)."""
    if st is None:
        return "<div class='ft-status'><span class='ft-muted'>No run yet. Plan a recipe, then press <b>Start training</b>.</span></div>"
    icon, label, colour = STATE_LABELS.get(st.state, ("?", st.state, "#6b7280"))
    pct = 100.0 * st.progress
    bits = [f"step <b>{st.step}</b> / {st.max_steps or '?'}"]
    if st.state in ("running", "starting") and st.eta_s is not None:
        bits.append(f"ETA <b>{clock_text(st.eta_s)}</b>")
    if st.elapsed_s is not None:
        bits.append(f"elapsed {clock_text(st.elapsed_s)}")
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
    if getattr(st, "terminal", False):  # a `finetuner run` in a terminal: shown here, stopped there
        notes = f"<div class='ft-terminal'>{html.escape(terminal_note(st))}</div>" + notes
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


#: the height of a run's charts (loss, rewards), in pixels
RUN_CHART_HEIGHT = 280


def run_chart(title: str, rows: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """A chart of a run's series over its steps: ``spec`` (encoding, layers) under ``title``, at
    :data:`RUN_CHART_HEIGHT`, on ``rows``."""
    return chart({"title": {"text": title, "frame": "bounds"}, "height": RUN_CHART_HEIGHT, "data": {"values": rows}, **spec})


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
    return run_chart(title, rows, {
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
    return run_chart(title, rows, {
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
    from finetuner.objectives.specs import names_where

    if st is not None and getattr(st, "objective", None) in names_where(generates=True):
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
    return run_chart(title, rows, {
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
        cells = [html.escape(text).replace("\n", " ").replace("|", "\\|")
                 for text in (str(s.get("prompt", "")), sample_cell(s, "base"), sample_cell(s, "fine_tuned"))]
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

"""The finetuner web UI: model → data → plan → train → chat → export, in that order.

Thin by design: every action calls finetuner's Python API (:mod:`finetuner.planning.planner`,
:mod:`finetuner.memory.model`, :mod:`finetuner.data.preview`, :mod:`finetuner.runs.jobs`,
:mod:`finetuner.infer.chat_worker`). Training and chat run in their own processes; the Train tab
follows the run's ``events.jsonl``, so closing or reloading the page loses nothing, and what it
shows comes from disk, not from the browser session.

``build_app(runs_dir=...)`` returns the ``gr.Blocks``; :func:`launch` serves it (``finetuner ui``).
"""

from __future__ import annotations

import functools
import hashlib
import html
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # never call out (version check, telemetry), whatever the environment says

import gradio as gr  # noqa: E402
import yaml  # noqa: E402
from gradio.components.plot import PlotData  # noqa: E402

from finetuner.runs import jobs  # noqa: E402
from finetuner.errors import UserError, did_you_mean  # noqa: E402
from finetuner.config.recipe import Optimizer  # noqa: E402
from ui import paths, views  # noqa: E402
from ui.estimate import recipe_estimate  # noqa: E402

#: seconds between two looks at the run shown on the Train tab (status, progress, ETA)
TRAIN_POLL_S = 2.0
#: seconds between redraws of the loss chart while a run trains
PLOT_EVERY_S = 6

CPU_CARD = "cpu"
#: labels that messages name (the text says which box to tick)
START_ANYWAY = "Start even if it does not fit"
OVERWRITE_LABEL = "overwrite"
OUTPUT_LABEL = "Output folder"
METHODS = ["auto", "lora", "qlora", "full"]
OPTIMIZERS = list(get_args(Optimizer))
COLORS = {"trained": "#10b981", "masked": "#cbd5e1"}

#: what a browser remembers of its choices (gr.BrowserState, in localStorage): the inputs of on_restore
REMEMBER_JS = "(model, card, data, run) => ({model: model, card: card, data: data, run: run})"

CSS = """
.gradio-container {width: 100% !important; max-width: 1240px !important; margin: auto;}
.gradio-container .tabs, .gradio-container .tabitem {width: 100%;}
#ft-title h1 {margin-bottom: 0; font-size: 1.7em;}
#ft-title p {margin-top: 2px; color: var(--body-text-color-subdued);}
.ft-status {padding: 10px 14px; border: 1px solid var(--border-color-primary); border-radius: 10px;
            background: var(--block-background-fill);}
.ft-head {display: flex; justify-content: space-between; align-items: baseline; margin-bottom: 8px;}
.ft-state {font-weight: 700; font-size: 1.1em;}
.ft-run {font-family: var(--font-mono); color: var(--body-text-color-subdued); font-size: .9em;}
.ft-progress {height: 14px; border-radius: 7px; background: var(--neutral-200); overflow: hidden;}
.ft-bar {height: 100%; border-radius: 7px; transition: width .6s ease;}
.ft-facts {margin-top: 8px; font-size: .95em;}
.ft-muted {color: var(--body-text-color-subdued); font-size: .9em; margin-top: 4px;}
.ft-error {margin-top: 8px; padding: 8px 10px; border-radius: 8px; background: #fef2f2; color: #991b1b;
           white-space: pre-wrap; font-family: var(--font-mono); font-size: .85em;}
.ft-step {font-size: .95em; color: var(--body-text-color-subdued); margin-bottom: 4px;}
/* charts (Vega-Lite, SVG, views.chart): as wide as their block, text in the theme's colour */
.ft-chart .vega-embed {width: 100%;}
.ft-chart g[class*="role-axis"] text, .ft-chart g[class*="role-legend"] text, .ft-chart g[class*="role-title"] text
  {fill: var(--body-text-color);}
/* the YAML editor's line numbers: CodeMirror sizes them from line heights it measures only on
   screen; filled off screen (a hidden tab, below the fold) they took a 14 px guess while lines are
   taller, and drifted from the text. Each number now takes the height of its line. */
#recipe-yaml .cm-lineNumbers .cm-gutterElement:not([style*="visibility"]) {height: auto !important;}
/* a chat lane's title above its messages, not floating over them as they scroll; nor its
   one-lane trash button (the Clear button below clears both lanes) */
.ft-lane-title {margin: 0 0 -4px 4px;}
#chat-tuned .top-panel, #chat-base .top-panel {display: none;}
"""

#: On page load: a chart whose block changes width (its tab shown, the window resized) is fitted
#: to it again. Vega measures a "container" width on window resize events only, and a chart drawn
#: in a hidden tab is drawn zero-wide.
JS = """() => {
  const fit = new ResizeObserver(() => window.dispatchEvent(new Event("resize")));
  const seen = new WeakSet();
  const watch = () => document.querySelectorAll(".ft-chart").forEach(el => { if (!seen.has(el)) { seen.add(el); fit.observe(el); } });
  watch();
  new MutationObserver(watch).observe(document.body, {childList: true, subtree: true});
}"""


# --------------------------------------------------------------------------- errors → messages
def error_md(e: Exception) -> str:
    """An error as a block of text on the page: what is wrong and what to do."""
    if isinstance(e, UserError):
        text = e.message + (f"\n{e.hint}" if e.hint else "")
    elif isinstance(e, gr.Error):
        text = str(e.message)
    else:
        text = f"Unexpected error: {type(e).__name__}: {e}"
    return f'<div class="ft-error" role="alert">✕ {html.escape(text, quote=False)}</div>'


def shows_errors(status: int, outputs: int) -> Callable[[Callable], Callable]:
    """A handler whose errors are shown as text in its output number ``status`` (of ``outputs``),
    the other outputs keeping what they showed: the reason is on the page (a raised error would
    turn every output into a bare "Error" badge, and its toast goes away). Engine errors become a
    message, never a traceback."""

    def failed(e: Exception):
        if outputs == 1:
            return error_md(e)
        out = [gr.skip()] * outputs
        out[status] = error_md(e)
        return tuple(out)

    def wrap(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen_wrapper(*args, **kwargs):
                try:
                    yield from fn(*args, **kwargs)
                except Exception as e:  # noqa: BLE001
                    yield failed(e)

            return gen_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                return failed(e)

        return wrapper

    return wrap


# --------------------------------------------------------------------------- engine helpers
def gpu_profile(card: str):
    from finetuner.config.hardware import get_gpu

    return get_gpu((card or CPU_CARD).strip())


def default_card() -> str:
    return "auto" if shutil.which("nvidia-smi") else CPU_CARD


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str):
    from finetuner.data.preview import load_preview_tokenizer

    return load_preview_tokenizer(model)


def recipe_from_text(text: str):
    """A validated :class:`~finetuner.config.recipe.Recipe` from the YAML in the Plan tab."""
    from finetuner.config.recipe import Recipe

    if not (text or "").strip():
        raise UserError("There is no recipe yet.", hint="Make a plan in the Plan tab, or load a shipped recipe.")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise UserError(f"The recipe is not valid YAML{where}: {getattr(e, 'problem', None) or e}.") from None
    except RecursionError:
        raise UserError("The recipe is not valid YAML: lists or mappings nested too deeply.") from None
    if not isinstance(raw, dict):
        raise UserError("The recipe must be a mapping of sections (model:, data:, training:, ...).")
    return Recipe.from_dict(raw, base_dir=paths.ROOT, source="recipe")


def compact_yaml(recipe, header: str = "") -> str:
    """The recipe's non-default values (plus the method) as YAML: short enough to read."""
    raw = recipe.model_dump(mode="json", exclude_defaults=True)
    raw["method"] = recipe.method
    order = ["name", "model", "method", "quantization", "lora", "data", "training", "checkpointing", "logging", "samples"]
    ordered = {k: raw[k] for k in order if k in raw} | {k: v for k, v in raw.items() if k not in order}
    return header + yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True)


def _fields_of(recipe) -> tuple:
    t = recipe.training
    return (
        recipe.method,
        t.micro_batch_size if t.micro_batch_size != "auto" else None,
        t.gradient_accumulation if t.gradient_accumulation != "auto" else None,
        recipe.data.max_seq_len,
        t.optimizer if t.optimizer != "auto" else None,
        bool(t.gradient_checkpointing) if t.gradient_checkpointing != "auto" else False,
        recipe.lora.r,
        t.max_steps or 0,
        recipe.logging.every,
        t.eval_every or 0,
    )


def apply_fields(text: str, method, micro, accum, seq_len, optimizer, checkpointing, lora_r, max_steps,
                 log_every=None, eval_every=None):
    """The recipe in ``text`` with the Plan tab's advanced fields applied."""
    r = recipe_from_text(text)
    raw = r.model_dump(mode="json", exclude_defaults=True)
    raw["method"] = method or r.method
    if raw["method"] != "qlora":
        raw.pop("quantization", None)
    tr = raw.setdefault("training", {})
    for key, val in (("micro_batch_size", micro), ("gradient_accumulation", accum), ("optimizer", optimizer)):
        if val:
            tr[key] = int(val) if key != "optimizer" else val
    tr["gradient_checkpointing"] = bool(checkpointing)
    if max_steps:
        tr["max_steps"] = int(max_steps)
    else:
        tr.pop("max_steps", None)
    if seq_len:
        raw.setdefault("data", {})["max_seq_len"] = int(seq_len)
    if lora_r:
        raw.setdefault("lora", {})["r"] = int(lora_r)
    if log_every:
        raw.setdefault("logging", {})["every"] = int(log_every)
    if eval_every:
        tr["eval_every"] = int(eval_every)
    else:
        tr.pop("eval_every", None)
    from finetuner.config.recipe import Recipe

    return Recipe.from_dict(raw, base_dir=paths.ROOT, source="recipe")


def _download_file(text: str, name: str) -> str:
    folder = Path(tempfile.gettempdir()) / "finetuner-ui"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{jobs.safe_name(name)}.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------- chat workers
class ChatPool:
    """One chat process per source (a run): it answers as the fine-tune, or as the base model with
    the adapter switched off, so the model is in memory once. Another source replaces it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._worker: Any = None

    @property
    def loaded(self) -> str | None:
        w = self._worker
        return w.source if w is not None and w.alive else None

    def get(self, source: str):
        from finetuner.infer.chat_worker import ChatWorker

        with self._lock:
            if self._worker is not None and self._worker.source != source:
                self._worker.close()
                self._worker = None
            if self._worker is None:
                self._worker = ChatWorker(source, adapter=True)
            return self._worker

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None


# --------------------------------------------------------------------------- the app
def build_app(runs_dir: str | Path | None = None, upload_dir: str | Path | None = None) -> gr.Blocks:
    """The app. ``runs_dir``: where runs and the job registry live (default ``runs/`` of the
    checkout); ``upload_dir``: where uploaded data files are stored (default ``data/uploads/``)."""
    runs = Path(runs_dir or paths.runs_dir_default()).expanduser().resolve()
    uploads = Path(upload_dir).expanduser().resolve() if upload_dir else paths.UPLOAD_DIR
    runs.mkdir(parents=True, exist_ok=True)
    chat_pool = ChatPool()

    def run_path(name: str | None) -> Path:
        if not name:
            raise UserError("Pick a run first.")
        p = runs / name
        if Path(name).name != name or name.startswith(".") or not p.is_dir():  # only folders directly in runs/
            names = run_names()
            raise UserError(f"No run named {name} in {runs}.",
                            hint=f"Pick a run from the list.{did_you_mean(name, names)}" if names else "Train one first (tab 4).")
        return p

    def run_names(pred: Callable[[Any], bool] = lambda s: True) -> list[str]:
        return [s.name for s in jobs.list_runs(runs) if pred(s)]

    def current_run() -> str | None:
        running = jobs.running_jobs(runs)
        if running:
            return Path(running[0].run_dir).name
        names = run_names()
        return names[0] if names else None

    # ------------------------------------------------------------------ handlers: model & data
    @shows_errors(0, 1)
    def on_model(model_text: str, card: str):
        from finetuner.model.shapes import resolve_shape

        shape = resolve_shape(paths.resolve_model(model_text))
        return views.model_card_md(shape, gpu_profile(card))

    @shows_errors(1, 2)
    def on_upload(file_path: str | None):
        """The uploaded file stored (or the stored file with the same content) and selected."""
        if not file_path:
            raise UserError("No file was uploaded.")
        dest, new = paths.save_upload(file_path, Path(file_path).name, uploads)
        shown = paths.display(dest)
        gr.Info(f"Saved as {shown}" if new else f"Already uploaded (same content): {shown}")
        return gr.update(choices=paths.data_files(uploads), value=shown), gr.skip()

    @shows_errors(0, 3)
    def on_data(model_text: str, data_file: str, seq_len: float | None):
        from finetuner.data.stats import profile_data

        if not data_file:
            raise UserError("Pick a data file, or upload one.")
        if seq_len is not None and seq_len < 0:
            raise UserError(f"Sequence length {seq_len:g}: give a number of tokens, or 0 to take it from the data.")
        local = paths.resolve_local(data_file)
        path = str(local) if local else data_file
        model = paths.resolve_model(model_text)
        seq = int(seq_len or 0) or 2048
        profile = profile_data(path, model, seq)
        preview, preview_note = None, ""
        try:
            preview = _preview(model, path, seq)
        except UserError as e:
            preview_note = f"\n\n**No token preview:** {e.message}"
        summary = views.data_summary_md(profile, preview, seq) + preview_note
        hist = views.histogram_df(profile, seq)
        hl = views.preview_highlights(preview) if preview else []
        return summary, hl, gr.update(value=hist, sort=list(hist["tokens"]),
                                      title=f"Token lengths against the sequence length ({seq})")

    def _preview(model: str, path: str, seq: int):
        from finetuner.data.preview import preview_data

        return preview_data(path, _tokenizer(model), n=3, max_seq_len=seq)

    # ------------------------------------------------------------------ handlers: plan
    def _estimate_outputs(recipe, card: str, header: str = ""):
        gpu = gpu_profile(card)
        est = recipe_estimate(recipe, gpu)  # computed as the planner computes it: one figure on the page
        text = compact_yaml(recipe, header)
        if not est.fits:
            gr.Warning(f"This recipe is predicted to need {views.gib(est.total_bytes, 1)}: more than {gpu.name} holds.")
        return (
            _memory_plot(est, gpu),
            views.estimate_md(est, gpu),
            text,
            _download_file(text, recipe.name),
        )

    @shows_errors(0, 18)
    def on_plan(model_text: str, card: str, data_file: str, seq_len: float | None, eff_batch: float | None, method: str):
        from finetuner.planning.planner import plan

        if not data_file:
            raise UserError("Pick a data file in the Data tab (or upload one) first: the plan is sized to the data.")
        local = paths.resolve_local(data_file)
        p = plan(
            paths.resolve_model(model_text),
            gpu_profile(card),
            seq_len=int(seq_len) if seq_len else None,
            data=str(local) if local else data_file,
            effective_batch=int(eff_batch) if eff_batch else None,  # empty: the planner sizes it to the data
            method=None if method in (None, "", "auto") else method,
        )
        if p.recipe is None:
            gr.Warning("Nothing fits this card; see the suggestions.")
            empty = _memory_plot(p.estimate, p.gpu) if p.estimate else None
            return (views.plan_md(p), empty, views.estimate_md(p.estimate, p.gpu) if p.estimate else "",
                    views.rejected_df(p), gr.skip(), gr.skip(), *[gr.skip()] * 10, gr.skip(), gr.skip())
        recipe = with_free_name(p.recipe)
        header = "".join(f"{line}\n" for line in p.to_yaml().splitlines() if line.startswith("# "))
        mem, est_md, text, dl = _estimate_outputs(recipe, card, header)
        return (views.plan_md(p), mem, est_md, views.rejected_df(p), text, dl, *_fields_of(recipe), "", views.planned(p))

    def on_recipe_text(text: str, planned: dict | None):
        """The Plan tab's headline follows the recipe in the editor, however it changed (a plan, an
        edited field, a loaded file, typing)."""
        if not (text or "").strip():
            return ""
        try:
            recipe = recipe_from_text(text)
        except UserError as e:
            return views.invalid_recipe_md(e.message)
        except Exception as e:  # noqa: BLE001 - shown, never raised: this runs on every keystroke
            return views.invalid_recipe_md(f"{type(e).__name__}: {e}")
        return views.recipe_md(recipe, planned)

    def with_free_name(recipe):
        """A planned or loaded recipe renamed ``name-2``... when a run already has its name: the
        name shown in the YAML is the run's folder, and Start never renames."""
        free = jobs.free_run_name(runs, recipe.name)
        return recipe if free == recipe.name else recipe.model_copy(update={"name": free})

    def _valid_md(recipe, card: str, note: str = "") -> str:
        gpu = gpu_profile(card)
        est = recipe_estimate(recipe, gpu)
        verdict = "fits" if est.fits else "does **not** fit"
        return (f"✓ The recipe is valid: run **{recipe.name}**, predicted peak {views.gib(est.total_bytes, 1)} "
                f"on {gpu.name}, which {verdict}.{note}")

    @shows_errors(4, 5)
    def on_edit(text: str, card: str, *fields):
        recipe = apply_fields(text, *fields)
        return *_estimate_outputs(recipe, card), ""

    @shows_errors(13, 14)
    def on_check_yaml(text: str, card: str):
        recipe = recipe_from_text(text)
        mem, est_md, _text, dl = _estimate_outputs(recipe, card)
        return mem, est_md, dl, *_fields_of(recipe), _valid_md(recipe, card)

    @shows_errors(14, 15)
    def on_load_recipe(name: str, card: str):
        from finetuner.config.recipe import Recipe

        local = paths.resolve_local(name)
        if local is None:
            raise UserError(f"No recipe file {name}.")
        loaded = Recipe.from_yaml(local)  # relative paths resolved against the recipe's folder
        recipe = with_free_name(loaded)
        note = "" if recipe.name == loaded.name else f" Renamed from {loaded.name}: a run already has that name."
        comments = []
        for line in local.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#"):
                break
            comments.append(line + "\n")
        mem, est_md, text, dl = _estimate_outputs(recipe, card, "".join(comments))
        return text, mem, est_md, dl, *_fields_of(recipe), _valid_md(recipe, card, note)

    # ------------------------------------------------------------------ handlers: train
    def _train_view(name: str | None, last: dict | None):
        """The Train tab's outputs; what has not changed since ``last`` is skipped (every open page
        polls this every TRAIN_POLL_S, and each value sent is re-rendered in each browser)."""
        last = last or {}
        last_sig, shown = last.get("sig"), last.get("shown") or ()
        st = None
        if name and (runs / name).is_dir():
            st = jobs.run_status(runs / name, runs)
        # while a run trains the chart redraws at most every PLOT_EVERY_S (each redraw re-renders the
        # whole chart in every open browser); at once when the run, its state or its eval points change
        progress = (int(time.time() // PLOT_EVERY_S) if st.running else len(st.losses)) if st else None
        sig = (name, progress, len(st.evals), st.state, bool(st.losses), bool(st.evals)) if st else None
        plot = _plot(views.loss_chart(st)) if sig != last_sig else gr.skip()
        # the past-runs table reads every run's events: only when the run shown or its state changes
        if sig is None or last_sig is None or sig[0] != last_sig[0] or sig[3] != last_sig[3]:
            table = views.runs_df(jobs.list_runs(runs))
        else:
            table = gr.skip()
        running = bool(st and st.running)
        values = (views.memory_md(st), views.samples_md(st), not running, running, bool(st and st.resumable))
        same = [len(shown) == len(values) and shown[i] == v for i, v in enumerate(values)]
        mem, smp, start_i, stop_i, resume_i = values
        return (
            views.status_html(st),
            plot,
            gr.skip() if same[0] else mem,
            gr.skip() if same[1] else smp,
            gr.skip() if same[2] else gr.update(interactive=start_i),
            gr.skip() if same[3] else gr.update(interactive=stop_i),
            gr.skip() if same[4] else gr.update(interactive=resume_i),
            {"sig": sig, "shown": values},
            table,
        )

    def train_view(name: str | None, last: dict | None):
        """The Train tab's outputs (see _train_view)."""
        try:
            return _train_view(name, last)
        except Exception:  # noqa: BLE001 - a half-written run folder must not break the page
            return (gr.skip(),) * 9

    def _runs_outputs(selected: str | None):
        names = run_names()
        return gr.update(choices=names, value=selected if selected in names else (names[0] if names else None)), views.runs_df(jobs.list_runs(runs))

    def check_same_data(recipe, data_file: str | None) -> None:
        """The recipe must train on the file chosen in the Data tab: a recipe planned before
        another file was chosen (or uploaded) would quietly train on the old one."""
        if not (data_file or "").strip():
            return
        local = paths.resolve_local(data_file)
        chosen = str(local) if local else data_file.strip()
        listed = recipe.data.path if isinstance(recipe.data.path, list) else [recipe.data.path]
        if chosen in [str(Path(p).resolve()) if Path(p).exists() else p for p in listed]:
            return
        raise UserError(
            f"Not started: the recipe trains on {', '.join(paths.display(p) for p in listed)}, but the Data tab has "
            f"{paths.display(chosen)} chosen.",
            hint="Make the plan again in the Plan tab to train on the chosen file, or choose the recipe's file in the Data tab.",
        )

    @shows_errors(2, 3)
    def on_start(text: str, card: str, data_file: str | None, anyway: bool):
        """Start the recipe in the editor as a run named as in its ``name:``. Refused, with the
        reason, when it does not train on the data chosen in the Data tab, or when the memory
        model says it does not fit the card (unless ``anyway``)."""
        recipe = recipe_from_text(text)
        check_same_data(recipe, data_file)
        gpu = gpu_profile(card)
        est = recipe_estimate(recipe, gpu)
        if not est.fits and not anyway:
            raise UserError(
                f"Not started: {recipe.name} is predicted to need {views.gib(est.total_bytes, 1)}, more than "
                f"{gpu.name} can give it ({views.gib(est.budget_bytes, 1)}).",
                hint="Make it fit in the Plan tab (a smaller micro-batch or sequence length, gradient checkpointing, "
                     f"qlora), or choose the card you train on in tab 1. To try it anyway, tick “{START_ANYWAY}”.",
            )
        job = jobs.start_job(recipe, runs_dir=runs, exact_name=True)
        note = "" if est.fits else (f" It is predicted not to fit {gpu.name}: if it runs out of memory, training "
                                    "halves the micro-batch and goes on.")
        return *_runs_outputs(job.name), f"✓ Training started: **{job.name}** (in `{paths.display(job.run_dir)}`).{note}"

    @shows_errors(0, 1)
    def on_stop(name: str):
        if not jobs.stop_job(run_path(name), runs):
            raise UserError(f"{name} is not running.")
        return f"Stopping **{name}** after this step: a checkpoint is saved, and ↻ Resume continues it."

    @shows_errors(2, 3)
    def on_resume(name: str):
        st = jobs.run_status(run_path(name), runs)
        if not st.resumable:
            raise UserError(f"{name} cannot be resumed: it is {views.STATE_LABELS.get(st.state, ('', st.state))[1]}.",
                            hint="Only stopped or interrupted runs with a checkpoint resume.")
        job = jobs.start_job(None, run_dir=run_path(name), runs_dir=runs)
        return *_runs_outputs(job.name), f"✓ Resuming **{job.name}** from its last checkpoint."

    def latest_choice() -> dict[str, str]:
        """The model and data of the newest run's recipe: what a browser with nothing remembered
        starts from (the server's state, not the shipped sample)."""
        for st in jobs.list_runs(runs):
            try:
                raw = yaml.safe_load((Path(st.run_dir) / "recipe.yaml").read_text(encoding="utf-8"))
                model_name, data_path = raw["model"]["name"], raw["data"]["path"]
            except (OSError, yaml.YAMLError, TypeError, KeyError):
                continue
            local_model = paths.resolve_local(str(model_name))
            local_data = paths.resolve_local(str(data_path))
            return {"model": paths.display(local_model) if local_model else str(model_name),
                    "data": paths.display(local_data) if local_data else ""}
        return {}

    def on_restore(saved: dict | None):
        """A page (re)load: the choices this browser made last time (model, card, data, run),
        else those of the newest run, else the defaults; uploads from any session are listed."""
        saved = saved if isinstance(saved, dict) else {}
        latest = latest_choice()
        data_choices = paths.data_files(uploads)
        data = next((d for d in (saved.get("data"), latest.get("data")) if d and paths.resolve_local(d)), default_data)
        model_v = saved.get("model") or latest.get("model") or demo_model or None
        card_v = saved.get("card") or default_card()
        names = run_names()
        chosen = saved.get("run") if saved.get("run") in names else current_run()
        finished = run_names(lambda s: s.has_adapter)
        done = chosen if chosen in finished else (finished[0] if finished else None)
        return (
            gr.update(value=model_v),
            gr.update(value=card_v),
            gr.update(choices=sorted({*data_choices, data} - {None}), value=data),
            *_runs_outputs(chosen),
            gr.update(choices=finished, value=done),
            gr.update(choices=finished, value=done),
        )

    def on_refresh_finished(current: str | None):
        finished = run_names(lambda s: s.has_adapter)
        return gr.update(choices=finished, value=current if current in finished else (finished[0] if finished else None))

    # ------------------------------------------------------------------ handlers: chat
    def on_chat(message: str, tuned_hist: list, base_hist: list, *settings):
        """One exchange in both lanes; an error puts the message and the conversations back as
        they were and says why in the status line."""
        try:
            yield from _chat(message, tuned_hist, base_hist, *settings)
        except Exception as e:  # noqa: BLE001
            yield message, tuned_hist, base_hist, error_md(e)

    def settings_text(gen: dict) -> str:
        """The settings an answer was generated with, so that a sampled answer can be repeated."""
        if gen["temperature"] == 0:
            return f"greedy, at most {gen['max_new_tokens']} tokens"
        seed = "no seed" if gen["seed"] is None else f"seed {gen['seed']}"
        return f"temperature {gen['temperature']:g}, top-p {gen['top_p']:g}, {seed}, at most {gen['max_new_tokens']} tokens"

    def _chat(message: str, tuned_hist: list, base_hist: list, run: str, compare: bool,
              max_new: float, temperature: float, top_p: float, seed: float | None):
        if not (message or "").strip():
            raise UserError("Type a message first.")
        source = str(run_path(run))
        gen = {"max_new_tokens": int(max_new), "temperature": float(temperature), "top_p": float(top_p),
               "seed": int(seed) if seed not in (None, "") else None}
        lanes = [("tuned", True, list(tuned_hist or []))] + ([("base", False, list(base_hist or []))] if compare else [])
        convo = {name: hist + [{"role": "user", "content": message}] for name, _a, hist in lanes}
        shown = {name: convo[name] + [{"role": "assistant", "content": "…"}] for name in convo}
        t0 = time.monotonic()
        fresh = chat_pool.loaded != source
        yield "", shown["tuned"], shown.get("base", base_hist), "Loading the model…" if fresh else "Answering…"
        worker = chat_pool.get(source)
        texts = {name: "" for name in convo}
        pieces = 0
        for name, adapter, _h in lanes:  # one model in one process: the lanes answer in turn
            msgs = [{"role": m["role"], "content": _message_text(m["content"])} for m in convo[name]]
            for piece in worker.stream(msgs, adapter=adapter, **gen):
                texts[name] += piece
                pieces += 1
                shown[name] = convo[name] + [{"role": "assistant", "content": texts[name]}]
                yield gr.skip(), shown["tuned"], shown.get("base", base_hist), "Answering…"
            shown[name] = convo[name] + [{"role": "assistant", "content": texts[name].strip() or "(no answer)"}]
        took = time.monotonic() - t0
        yield (gr.skip(), shown["tuned"], shown.get("base", base_hist),
               f"Answered in {took:.1f} s{' (including loading the model)' if fresh else ''} · {settings_text(gen)} · {worker.describe}")

    # ------------------------------------------------------------------ handlers: export
    @shows_errors(0, 1)
    def on_merge(run: str, out: str, dtype: str, overwrite: bool):
        rp = run_path(run)
        target = Path(out).expanduser() if out and out.strip() else rp / "merged"
        if not target.is_absolute():
            target = paths.ROOT / target
        if target.exists() and not target.is_dir():
            raise UserError(f"The output folder {paths.display(target)} is a file.",
                            hint=f"Type a folder under “{OUTPUT_LABEL}”.")
        if target.is_dir() and any(target.iterdir()) and not overwrite:
            raise UserError(f"The output folder {paths.display(target)} is not empty: nothing was written.",
                            hint=f"Tick “{OVERWRITE_LABEL}” to replace it (once the new model is complete), "
                                 f"or type another folder under “{OUTPUT_LABEL}”.")
        cmd = [sys.executable, "-m", "finetuner", "merge", str(rp), "-o", str(target)]
        if dtype:
            cmd += ["--dtype", dtype]
        if overwrite:
            cmd.append("--overwrite")
        yield f"Merging {run} into its base model → `{paths.display(target)}` …"
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(paths.ROOT))
        output = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            raise UserError(_cli_error(output, proc.returncode))
        files = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
        yield (f"✓ Merged model saved to `{paths.display(target)}` ({len(files)} files: {', '.join(files[:8])}"
               f"{'…' if len(files) > 8 else ''}).\n\nLoad it with `AutoModelForCausalLM.from_pretrained(\"{target}\")`.")

    def _cli_error(output: str, code: int) -> str:
        """The CLI's ``error:`` line and its hint, in the words of this tab (its options are fields here)."""
        lines = output.splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.startswith("error:")]
        if not starts:
            return lines[-1] if lines else f"exit status {code}"
        text = "\n".join(lines[starts[-1]: starts[-1] + 3]).removeprefix("error: ")
        for cli, label in (("pass --overwrite", f"tick “{OVERWRITE_LABEL}”"), ("--overwrite", f"“{OVERWRITE_LABEL}”"),
                           ("for -o", f"under “{OUTPUT_LABEL}”"), ("another -o", f"another “{OUTPUT_LABEL}”")):
            text = text.replace(cli, label)
        return text

    def adapter_zip(run: str) -> Path:
        """The run's adapter folder as ``<run>-adapter.zip`` (rebuilt when the adapter is newer)."""
        rp = run_path(run)
        adapter = rp / "adapter"
        if not adapter.is_dir():
            raise UserError(f"{run} has no adapter yet.", hint="Finish training first (a stopped run has checkpoints only).")
        folder = Path(tempfile.gettempdir()) / "finetuner-ui" / "adapters" / hashlib.sha1(str(rp).encode()).hexdigest()[:12]
        archive = folder / f"{run}-adapter.zip"
        newest = max((p.stat().st_mtime for p in adapter.rglob("*")), default=adapter.stat().st_mtime)
        if not archive.is_file() or archive.stat().st_mtime < newest:
            folder.mkdir(parents=True, exist_ok=True)
            building = Path(tempfile.mkdtemp(dir=folder))
            try:
                built = shutil.make_archive(str(building / archive.stem), "zip", root_dir=adapter)
                os.replace(built, archive)  # whole or not at all, if two pages ask at once
            finally:
                shutil.rmtree(building, ignore_errors=True)
        return archive

    def on_zip(run: str | None):
        """The download button holds the chosen run's adapter zip (one click downloads it); a run
        without an adapter empties it and says why."""
        try:
            if not run:
                return gr.update(value=None, interactive=False), ""
            return gr.update(value=str(adapter_zip(run)), interactive=True), ""
        except Exception as e:  # noqa: BLE001
            return gr.update(value=None, interactive=False), error_md(e)

    # ------------------------------------------------------------------ layout
    demo_model = paths.display(paths.DEMO_MODEL) if paths.DEMO_MODEL.is_dir() else ""
    model_choices = paths.local_models() + _preset_choices()
    data_choices = paths.data_files(uploads)
    default_data = "data/alpaca_sample.json" if "data/alpaca_sample.json" in data_choices else (data_choices[0] if data_choices else None)
    card_choices = [CPU_CARD, "auto"] + [p.name for p in _profiles()]

    with gr.Blocks(title="finetuner", analytics_enabled=False) as app:
        gr.Markdown(
            "# finetuner\nFine-tune a language model with LoRA or QLoRA — and know before you start whether it fits your card.",
            elem_id="ft-title",
        )
        saved = gr.BrowserState({}, storage_key="finetuner-ui", secret="finetuner-ui")  # this browser's choices
        with gr.Tabs() as tabs:
            # ---------------------------------------------------------- 1 model & card
            with gr.Tab("1 · Model & card", id="model"):
                gr.Markdown("Choose the model to fine-tune and the card it will train on.", elem_classes="ft-step")
                with gr.Row():
                    model = gr.Dropdown(model_choices, value=demo_model or None, allow_custom_value=True, label="Model",
                                        info="a preset, a hub id (org/name) or a local folder with config.json", scale=3)
                    card = gr.Dropdown(card_choices, value=default_card(), allow_custom_value=True, label="Card", elem_id="card",
                                       info="a known GPU, 'auto' (detected), 'cpu', or a size such as 24GB", scale=2)
                model_md = gr.Markdown(elem_id="model-card")
                with gr.Accordion("Known cards", open=True):
                    gr.Dataframe(_cards_df(), interactive=False, elem_id="cards-table")
                next1 = gr.Button("Next: the data →", size="sm")
            # ---------------------------------------------------------- 2 data
            with gr.Tab("2 · Data", id="data"):
                gr.Markdown("Pick a data file (JSONL, JSON, CSV or Parquet) or upload one. The preview shows each example "
                            "as the model sees it: **green** tokens are trained on, grey ones are context only.",
                            elem_classes="ft-step")
                with gr.Row():
                    data_file = gr.Dropdown(data_choices, value=default_data, allow_custom_value=True, label="Data file",
                                            info=f"files in data/ and your uploads ({paths.display(uploads)}/), or a path",
                                            scale=3, elem_id="data-file")
                    seq_len = gr.Number(value=256, precision=0, label="Sequence length",
                                        info="tokens per example (0 = from the data)", scale=1)
                    # no file_types filter: gradio would refuse another type with a bare "Error" badge;
                    # save_upload's refusal says which types it reads, under the data tab's summary
                    upload = gr.UploadButton("Upload a file…", type="filepath", scale=1, elem_id="upload-btn")
                data_md = gr.Markdown(elem_id="data-summary")
                with gr.Row():
                    with gr.Column(scale=3):
                        preview = gr.HighlightedText(label="Examples as the model sees them", color_map=COLORS,
                                                     combine_adjacent=False, show_legend=True, elem_id="data-preview")
                    with gr.Column(scale=2):
                        hist = gr.BarPlot(x="tokens", y="examples", color="fits", sort=None,
                                          color_map={"fits": "#10b981", "partly cut": "#f59e0b", "cut": "#ef4444"},
                                          title="Token lengths", x_title="tokens per example", y_title="examples",
                                          x_label_angle=-45, height=320, elem_id="length-hist")
                next2 = gr.Button("Next: the plan →", size="sm")
            # ---------------------------------------------------------- 3 plan
            with gr.Tab("3 · Plan", id="plan") as plan_tab:
                gr.Markdown("The planner picks the fastest recipe that fits the card and says why. Change any advanced "
                            "field and the memory estimate updates.", elem_classes="ft-step")
                with gr.Row():
                    eff_batch = gr.Number(value=0, precision=0, label="Effective batch",
                                          info="0 = sized to the data", scale=1)
                    plan_method = gr.Dropdown(METHODS, value="auto", label="Method", scale=1)
                    plan_btn = gr.Button("Make the plan", variant="primary", scale=1)
                with gr.Row():
                    with gr.Column(scale=3):
                        plan_md = gr.Markdown(elem_id="plan-summary")
                        est_md = gr.Markdown(elem_id="estimate")
                    with gr.Column(scale=2):
                        mem_plot = gr.Plot(show_label=False, elem_id="memory-chart", elem_classes="ft-chart")
                with gr.Accordion("Alternatives the planner rejected", open=False):
                    rejected = gr.Dataframe(interactive=False, wrap=True, column_widths=["42%", "14%", "44%"],
                                            elem_id="rejected-table")
                with gr.Accordion("Advanced settings", open=True):
                    # no gradio minimum on these numbers: its refusal is a bare "Error" on every output;
                    # the recipe's own checks name the key and the valid range under the YAML instead
                    with gr.Row():
                        f_method = gr.Dropdown(["lora", "qlora", "full"], value="lora", label="method")
                        f_micro = gr.Number(precision=0, label="micro-batch")
                        f_accum = gr.Number(precision=0, label="gradient accumulation")
                        f_seq = gr.Number(precision=0, label="sequence length")
                    with gr.Row():
                        f_opt = gr.Dropdown(OPTIMIZERS, label="optimizer")
                        f_gc = gr.Checkbox(label="gradient checkpointing")
                        f_r = gr.Number(precision=0, value=16, label="LoRA rank")
                        f_steps = gr.Number(precision=0, value=0, label="max steps (0 = epochs)")
                        f_log = gr.Number(precision=0, value=1, label="log every (steps)")
                        f_eval = gr.Number(precision=0, value=0, label="eval every (0 = at the end)")
                with gr.Row():
                    shipped = gr.Dropdown(paths.recipe_files(), value=None, label="…or start from a shipped recipe", scale=3, elem_id="shipped-recipe")
                    load_btn = gr.Button("Load recipe", scale=1)
                recipe_yaml = gr.Code(language="yaml", interactive=True, label="Recipe (YAML) — this is what Train runs",
                                      lines=14, max_lines=40, elem_id="recipe-yaml")
                with gr.Row():
                    check_btn = gr.Button("Check edited YAML", elem_id="check-yaml")
                    download = gr.DownloadButton("Download recipe.yaml", value=None)
                yaml_md = gr.Markdown(elem_id="yaml-status")
                next3 = gr.Button("Next: train →", size="sm")
            # ---------------------------------------------------------- 4 train
            with gr.Tab("4 · Train", id="train"):
                gr.Markdown("Training runs in its own process: close or reload the page at any time — the run goes on, "
                            "and this page shows it again. One run per device at a time.", elem_classes="ft-step")
                with gr.Row():
                    start_btn = gr.Button("▶ Start training", variant="primary", elem_id="start-btn")
                    stop_btn = gr.Button("■ Stop (save a checkpoint)", variant="stop", interactive=False, elem_id="stop-btn")
                    resume_btn = gr.Button("↻ Resume", interactive=False, elem_id="resume-btn")
                    start_anyway = gr.Checkbox(label=START_ANYWAY, value=False, elem_id="start-anyway",
                                               info="when the memory estimate says the recipe does not fit the card")
                train_msg = gr.Markdown(elem_id="train-message")
                run_pick = gr.Dropdown([], label="Run", allow_custom_value=True, info="the run shown below; pick a past run to reopen it",
                                       elem_id="run-pick")
                status = gr.HTML(views.status_html(None), elem_id="train-status")
                with gr.Row():
                    with gr.Column(scale=3):
                        loss_plot = gr.Plot(show_label=False, elem_id="loss-plot", elem_classes="ft-chart")
                    with gr.Column(scale=2):
                        mem_md = gr.Markdown(elem_id="train-memory")
                        samples = gr.Markdown(elem_id="train-samples")
                with gr.Accordion("Past runs", open=True):
                    runs_table = gr.Dataframe(views.runs_df([]), interactive=False, elem_id="runs-table")
                train_seen = gr.State(None)  # what the Train tab last showed (see _train_view)
                timer = gr.Timer(TRAIN_POLL_S)
            # ---------------------------------------------------------- 5 chat
            with gr.Tab("5 · Chat", id="chat") as chat_tab:
                gr.Markdown("Talk to the fine-tuned model; the base model answers the same prompt beside it. "
                            "The models load in a separate process (the first answer takes a moment).",
                            elem_classes="ft-step")
                with gr.Row():
                    chat_run = gr.Dropdown([], label="Fine-tuned run", allow_custom_value=True, scale=3, elem_id="chat-run")
                    compare = gr.Checkbox(value=True, label="Base model beside it", scale=1)
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("**Fine-tuned**", elem_classes="ft-lane-title")
                        tuned_bot = gr.Chatbot(label="Fine-tuned", show_label=False, buttons=[], height=340, elem_id="chat-tuned")
                    with gr.Column():
                        gr.Markdown("**Base model**", elem_classes="ft-lane-title")
                        base_bot = gr.Chatbot(label="Base model", show_label=False, buttons=[], height=340, elem_id="chat-base")
                with gr.Row():
                    msg = gr.Textbox(placeholder="Ask something…", show_label=False, scale=5, elem_id="chat-input")
                    send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
                    clear = gr.Button("Clear", scale=1)
                chat_status = gr.Markdown(elem_id="chat-status")
                with gr.Accordion("Generation settings", open=False):
                    with gr.Row():
                        max_new = gr.Slider(8, 1024, value=96, step=8, label="max new tokens", elem_id="gen-max-new")
                        temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="temperature (0 = greedy)", elem_id="gen-temperature")
                        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="top-p", elem_id="gen-top-p")
                        seed = gr.Number(value=0, precision=0, label="seed", elem_id="gen-seed")
            # ---------------------------------------------------------- 6 export
            with gr.Tab("6 · Export", id="export") as export_tab:
                gr.Markdown("Merge the adapter into the base model (a full-precision reload of the base, so outputs match), "
                            "or download the adapter alone.", elem_classes="ft-step")
                with gr.Row():
                    export_run = gr.Dropdown([], label="Run", allow_custom_value=True, scale=2, elem_id="export-run")
                    out_dir = gr.Textbox(label=OUTPUT_LABEL, placeholder="default: runs/<run>/merged", scale=3, elem_id="out-dir")
                    dtype = gr.Dropdown(["bf16", "fp16", "fp32"], value="bf16", label="dtype", scale=1)
                    overwrite = gr.Checkbox(label=OVERWRITE_LABEL, scale=1, elem_id="overwrite")
                with gr.Row():
                    merge_btn = gr.Button("Merge and save", variant="primary", elem_id="merge-btn")
                    zip_btn = gr.DownloadButton("Download the adapter (.zip)", value=None, interactive=False, elem_id="zip-btn")
                export_md = gr.Markdown(elem_id="export-status")

        # ------------------------------------------------------------------ wiring
        for button, target in ((next1, "data"), (next2, "plan"), (next3, "train")):
            button.click(functools.partial(gr.Tabs, selected=target), None, tabs, api_name=False)
        model_inputs = [model, card]
        for comp in model_inputs:
            comp.change(on_model, model_inputs, model_md, api_name=False)

        data_inputs = [model, data_file, seq_len]
        data_outputs = [data_md, preview, hist]
        data_file.change(_clear, None, hist, api_name=False).then(on_data, data_inputs, data_outputs, api_name="analyse_data")
        seq_len.submit(_clear, None, hist, api_name=False).then(on_data, data_inputs, data_outputs, api_name=False)
        seq_len.blur(_clear, None, hist, api_name=False).then(on_data, data_inputs, data_outputs, api_name=False)
        model.change(_clear, None, hist, api_name=False).then(on_data, data_inputs, data_outputs, api_name=False)
        upload.upload(on_upload, upload, [data_file, data_md], api_name="upload_data")

        fields = [f_method, f_micro, f_accum, f_seq, f_opt, f_gc, f_r, f_steps, f_log, f_eval]
        est_outputs = [mem_plot, est_md, recipe_yaml, download, yaml_md]
        planned = gr.State(None)  # what the planner chose and why (views.planned): edits are told apart from it
        plan_outputs = [plan_md, mem_plot, est_md, rejected, recipe_yaml, download, *fields, yaml_md, planned]
        plan_inputs = [model, card, data_file, seq_len, eff_batch, plan_method]
        plan_btn.click(_clear, None, mem_plot, api_name=False).then(on_plan, plan_inputs, plan_outputs, api_name="plan")
        def plan_if_empty(text, *args):
            return on_plan(*args) if not (text or "").strip() else (gr.skip(),) * len(plan_outputs)

        plan_tab.select(plan_if_empty, [recipe_yaml, *plan_inputs], plan_outputs, api_name=False)
        next2.click(plan_if_empty, [recipe_yaml, *plan_inputs], plan_outputs, api_name=False)
        for f in fields:
            f.input(_clear, None, mem_plot, api_name=False).then(on_edit, [recipe_yaml, card, *fields], est_outputs, api_name=False)
        recipe_yaml.change(on_recipe_text, [recipe_yaml, planned], plan_md, api_name=False, show_progress="hidden",
                           trigger_mode="always_last")
        check_btn.click(_clear, None, mem_plot, api_name=False).then(on_check_yaml, [recipe_yaml, card], [mem_plot, est_md, download, *fields, yaml_md],
                                                                   api_name="estimate")
        load_btn.click(_clear, None, mem_plot, api_name=False).then(on_load_recipe, [shipped, card], [recipe_yaml, mem_plot, est_md, download, *fields, yaml_md],
                       api_name="load_recipe")

        train_outputs = [status, loss_plot, mem_md, samples, start_btn, stop_btn, resume_btn, train_seen, runs_table]
        start_btn.click(on_start, [recipe_yaml, card, data_file, start_anyway], [run_pick, runs_table, train_msg], api_name="start_training")
        stop_btn.click(on_stop, run_pick, train_msg, api_name="stop_training")
        resume_btn.click(on_resume, run_pick, [run_pick, runs_table, train_msg], api_name="resume_training")
        run_pick.change(functools.partial(train_view, last=None), run_pick, train_outputs, api_name=False)
        timer.tick(train_view, [run_pick, train_seen], train_outputs, api_name=False, show_progress="hidden")
        # a (re)load restores this browser's choices, then shows the model and the data chosen
        app.load(on_restore, saved, [model, card, data_file, run_pick, runs_table, chat_run, export_run], api_name=False
                 ).then(on_model, model_inputs, model_md, api_name=False).then(on_data, data_inputs, data_outputs, api_name=False)
        remembered = [model, card, data_file, run_pick]
        for comp in remembered:  # in the browser only: stored at once, no round trip to the server
            comp.change(None, remembered, saved, js=REMEMBER_JS, api_name=False, queue=False)

        chat_inputs = [msg, tuned_bot, base_bot, chat_run, compare, max_new, temperature, top_p, seed]
        send.click(on_chat, chat_inputs, [msg, tuned_bot, base_bot, chat_status], api_name="chat")
        msg.submit(on_chat, chat_inputs, [msg, tuned_bot, base_bot, chat_status], api_name=False)
        clear.click(lambda: ([], []), None, [tuned_bot, base_bot], api_name=False)
        chat_tab.select(on_refresh_finished, chat_run, chat_run, api_name=False)
        export_tab.select(on_refresh_finished, export_run, export_run, api_name=False)

        merge_btn.click(on_merge, [export_run, out_dir, dtype, overwrite], export_md, api_name="merge")
        export_run.change(on_zip, export_run, [zip_btn, export_md], api_name="adapter_zip")

    app.chat_pool = chat_pool  # for tests and shutdown
    app.runs_dir = runs
    return app


def _clear() -> None:
    """Empties a chart while its new figures are computed: a gradio BarPlot keeps its first colour
    scale otherwise, and the last plan's chart must not stand beside a new plan."""
    return None


def _plot(spec: dict) -> PlotData:
    """A Vega-Lite chart (views.chart) for a ``gr.Plot``: drawn afresh from the spec each time, so its
    axes and series always match its data. (Not as gradio's own altair chart kinds: those restyle
    the spec, and stay zero-wide once their tab has been hidden and shown again.)"""
    return PlotData(type="altair", plot=json.dumps(spec))


def _memory_plot(est, gpu) -> PlotData:
    return _plot(views.memory_chart(est, gpu))


def _message_text(content: Any) -> str:
    """A chat message's text, whether gradio hands it over as a string or as content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(_message_text(c) for c in content)
    return "" if content is None else str(content)


def _cards_df():
    import pandas as pd

    rows = [(p.name, p.description, f"{p.memory_gib:.1f}", "yes" if p.bf16 else "no") for p in _profiles()]
    return pd.DataFrame(rows, columns=["card", "description", "GiB", "bf16"])


def _preset_choices() -> list[str]:
    try:
        from finetuner.model.shapes import preset_names

        return preset_names()
    except Exception:  # noqa: BLE001
        return []


def _profiles():
    from finetuner.config.hardware import list_profiles

    return list_profiles()


def launch(
    runs_dir: str | Path | None = None,
    upload_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 7860,
    auth: tuple[str, str] | None = None,
    block: bool = True,
    quiet: bool = False,
) -> gr.Blocks:
    """Build and serve the app (``finetuner ui``); with ``block=False`` return once it serves."""
    app = build_app(runs_dir, upload_dir)
    theme = gr.themes.Soft(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate")
    app.queue(default_concurrency_limit=8)
    app.launch(
        server_name=host, server_port=port, auth=auth, prevent_thread_lock=not block, quiet=quiet,
        theme=theme, css=CSS, js=JS, show_error=True, footer_links=[], ssr_mode=False,
        allowed_paths=[str(Path(tempfile.gettempdir()) / "finetuner-ui")],
    )
    return app

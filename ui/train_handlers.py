"""What the Train tab's controls do: start, stop and resume a run, and its live view (the loss chart,
progress and ETA redrawn while it trains). A mixin of :class:`ui.handlers.Handlers`; the code-consent
boxes it names are shared with the Chat and Export tabs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import gradio as gr
from gradio.components.plot import PlotData

from finetuner.data.scope import code_file
from finetuner.errors import UserError
from finetuner.infer.loading import read_recipe
from finetuner.runs import jobs
from finetuner.training import seal
from finetuner.tracking.report import tracked_at
from ui import paths, run_views, views
from ui.errors import shows_errors
from ui.estimate import recipe_estimate
from ui.recipe_text import recipe_from_text


#: the card menu's choice for no GPU
CPU_CARD = "cpu"
#: seconds between redraws of the loss chart while a run trains
PLOT_EVERY_S = 6

#: how many outputs the Train tab's view has (Handlers.train_view)
TRAIN_OUTPUTS = 14
#: the Train tab's box that starts a recipe the memory model says does not fit (a refusal names it)
START_ANYWAY = "Start even if it does not fit"
#: The confirmation that code from a run's folder (or a recipe's model) may run: unchecked by default.
ALLOW_CODE = "Allow code from this run's folder"
ALLOW_CODE_INFO = "needed when its recipe sets model.trust_remote_code or model.allow_pickle: only for runs you trust"
START_CODE = "Allow the model's own code to run"
START_CODE_INFO = ("needed when the recipe sets model.trust_remote_code or model.allow_pickle, and to start or resume a GRPO "
                   "run whose recipe names reward files: only for models and code you trust")


def gpu_profile(card: str):
    """The card chosen on the page as a profile (:func:`finetuner.config.hardware.get_gpu`)."""
    from finetuner.config.hardware import get_gpu

    return get_gpu((card or CPU_CARD).strip())



def plot(spec: dict) -> PlotData:
    """A Vega-Lite chart (views.chart) for a ``gr.Plot``: drawn afresh from the spec each time, so its
    axes and series always match its data. (Not as gradio's own altair chart kinds: those restyle
    the spec, and stay zero-wide once their tab has been hidden and shown again.)"""
    return PlotData(type="altair", plot=json.dumps(spec))



class TrainHandlers:
    """The Train tab's handlers (a part of :class:`ui.handlers.Handlers`)."""

    # ------------------------------------------------------------------ train
    def _train_view(self, name: str | None, last: dict | None, started: str | None = None):
        """The Train tab's outputs; what has not changed since ``last`` is skipped (every open page
        polls this every ui.layout.TRAIN_POLL_S, and each value sent is re-rendered in each browser).
        A preference run also shows its reward accuracy (and margin) beside the loss; for an SFT run
        that chart's column is hidden. The past-runs table's row of the run shown is made from the
        same status as the status line, on the same tick; the Train tab's message ("Training
        started ...") is cleared when the run shown stops running. ``started``: the run this page started (or
        resumed) last: once it has ended with an adapter, the Chat and Export tabs are set to it (once)."""
        last = last or {}
        last_sig, shown = last.get("sig"), last.get("shown") or ()
        st = None
        if name and (self.runs / name).is_dir():
            st = jobs.run_status(self.runs / name, self.runs)
        # while a run trains the chart redraws at most every PLOT_EVERY_S (each redraw re-renders the
        # whole chart in every open browser); at once when the run, its state or its eval points change
        progress = (int(time.time() // PLOT_EVERY_S) if st.running else len(st.losses)) if st else None
        preference = run_views.is_preference(st)
        sig = (name, progress, len(st.evals), st.state, bool(st.losses), bool(st.evals), preference) if st else None
        chart = plot(run_views.loss_chart(st)) if sig != last_sig else gr.skip()
        rewards = plot(run_views.reward_chart(st)) if preference and sig != last_sig else gr.skip()
        # the past-runs table reads every run's events: only when the run shown or its state changes;
        # otherwise only the shown run's row is made again, from st (the status line's own figures)
        rows = last.get("rows")
        if rows is None or sig is None or last_sig is None or sig[0] != last_sig[0] or sig[3] != last_sig[3]:
            rows = [run_views.run_row(st if st is not None and r.name == st.name else r) for r in jobs.list_runs(self.runs)]
        elif st is not None:
            rows = [run_views.run_row(st) if row[0] == st.name else row for row in rows]
        rows = [tuple(r) for r in rows]
        table = gr.skip() if rows == last.get("rows") else run_views.runs_table(rows)
        running = bool(st and st.running)
        ended = len(shown) > 6 and shown[6] and not running  # the run shown was running at the last look
        # Start is always pressable: a run training on the device (this page's, another's, a terminal's) makes it a
        # refusal naming that run (jobs.start_job); Stop only for a job, never a terminal's `finetuner run`
        stoppable = running and not st.terminal
        values = (run_views.memory_md(st), run_views.samples_md(st), True, stoppable, bool(st and st.resumable), preference,
                  running)
        same = [len(shown) == len(values) and shown[i] == v for i, v in enumerate(values)]
        mem, smp, start_i, stop_i, resume_i, _pref, _running = values
        # the run this page started has just ended with an adapter: Chat and Export show it (not the newest run)
        # (once: the user may pick another run there afterwards; also when it ended between two looks)
        finished, offered = None, last.get("offered")
        if started and st is not None and st.name == started and not running and st.has_adapter and offered != started:
            finished, offered = self.run_names(lambda s: s.has_adapter), started
        return (
            run_views.status_html(st, tracked_at(self.runs / name) if st is not None else None),
            chart,
            gr.skip() if same[0] else mem,
            gr.skip() if same[1] else smp,
            gr.skip() if same[2] else gr.update(interactive=start_i),
            gr.skip() if same[3] else gr.update(interactive=stop_i),
            gr.skip() if same[4] else gr.update(interactive=resume_i),
            {"sig": sig, "shown": values, "rows": rows, "offered": offered},
            table,
            gr.skip() if same[5] else gr.update(visible=preference),
            rewards,
            "" if ended else gr.skip(),
            *(gr.skip() if finished is None else gr.update(choices=finished, value=started) for _tab in ("chat", "export")),
        )

    def train_view(self, name: str | None, last: dict | None = None, started: str | None = None):
        """The Train tab's outputs (see _train_view)."""
        try:
            return self._train_view(name, last, started)
        except Exception:  # noqa: BLE001 - a half-written run folder must not break the page
            return (gr.skip(),) * TRAIN_OUTPUTS

    def runs_outputs(self, selected: str | None):
        names = self.run_names()
        return (gr.update(choices=names, value=selected if selected in names else (names[0] if names else None)),
                run_views.runs_df(jobs.list_runs(self.runs)))

    def check_same_data(self, recipe, data_file: str | None) -> None:
        """The recipe must train on the file chosen in the Data tab: a recipe planned before
        another file was chosen (or uploaded) would quietly train on the old one."""
        if not (data_file or "").strip():
            return
        if self.scope is not None:  # inside this UI's folders, else its one refusal: nothing outside is looked up
            chosen = self.data_path(data_file)
        else:
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

    def confirm_code(self, run: str, allow_code: bool, box: str = ALLOW_CODE, rewards: bool = True) -> None:
        """Refuse a run whose recipe.yaml lets code run (``model.trust_remote_code``,
        ``model.allow_pickle``) unless the checkbox ``box`` is ticked: a run folder may come from
        someone else, so its own recipe is never taken as consent. ``rewards``: whether what follows runs
        GRPO's reward functions (training does; chat, merge and export never call them, so they do not ask)."""
        path = self.run_path(run) / "recipe.yaml"
        if allow_code or not path.is_file():
            return
        recipe = read_recipe(path)
        asks = [k for k in ("trust_remote_code", "allow_pickle") if getattr(recipe.model, k)]
        if asks:
            raise UserError(f"{run}: its recipe.yaml sets {' and '.join(f'model.{k}: true' for k in asks)}, so loading it can "
                            "run code from the run's folder.", hint=f"Tick “{box}” to confirm, only for a run you trust.")
        files = [r.file for r in (recipe.grpo.rewards if recipe.grpo and rewards else []) if r.file]
        if files:  # GRPO's reward functions run in the training process
            raise UserError(f"{run}: its recipe.yaml names reward functions in {', '.join(files)}, which run on this machine "
                            "while it trains.", hint=f"Tick “{box}” to confirm, only for a run and reward files you trust.")

    def check_reward_code(self, recipe, allow_code: bool, head: str = "Not started") -> None:
        """The reward files of a recipe started or resumed from the page run only from where the page may run code
        (:attr:`code_scope`: a .py file inside the UI's folders, or anywhere of this machine without them; never an
        upload: :func:`finetuner.data.scope.code_file`), and only with “Allow the model's own code to run” ticked,
        on every host. Decided before the training process is started, so it never imports a file refused here."""
        files = [(i, r) for i, r in enumerate(recipe.grpo.rewards if recipe.grpo else []) if r.file]
        for i, r in files:
            code_file(r.file, f"{head}: grpo.rewards[{i}] ({r.function})", self.code_scope)
        if files and not allow_code:
            raise UserError(f"{head}: the recipe's rewards run Python code on this machine while it trains "
                            f"({', '.join(paths.display(r.file) for _, r in files)}).",
                            hint=f"Tick “{START_CODE}” to confirm, only for reward files you trust.")

    @shows_errors(2, 4)
    def on_start(self, text: str, card: str, data_file: str | None, anyway: bool, allow_code: bool = False):
        """Start the recipe in the editor as a run named as in its ``name:``. Refused, with the
        reason, when it does not train on the data chosen in the Data tab, when it cannot finish
        (:func:`finetuner.planning.bounds.check_run`, as ``finetuner run`` refuses it: whatever ``anyway``
        says), when the memory model says it does not fit the card (unless ``anyway``), or when it lets
        the model's code run (``model.trust_remote_code``, ``model.allow_pickle``) and ``allow_code`` is not
        ticked. The bounds' warnings (a run of many passes over its data) are shown with the start."""
        from finetuner.planning.bounds import check_run

        recipe = recipe_from_text(text)
        asks = [k for k in ("trust_remote_code", "allow_pickle") if getattr(recipe.model, k)]
        if asks and not allow_code:
            raise UserError(f"Not started: the recipe sets {' and '.join(f'model.{k}: true' for k in asks)}, so code "
                            f"from {recipe.model.name} may run on this machine.",
                            hint=f"Tick “{START_CODE}” to confirm, only for a model you trust.")
        self.check_reward_code(recipe, bool(allow_code))
        self.check_data_scope(recipe)  # first: what follows looks at the recipe's files
        self.check_same_data(recipe, data_file)
        gpu = gpu_profile(card)
        try:
            warnings = check_run(recipe, gpu)
        except UserError as e:
            raise UserError(f"Not started: {e.message}", hint=e.plain_hint, settings=e.settings) from None
        est = recipe_estimate(recipe, gpu)
        if not est.fits and not anyway:
            raise UserError(
                f"Not started: {recipe.name} is predicted to need {views.gib(est.total_bytes, 1)}, more than "
                f"{gpu.name} can give it ({views.gib(est.budget_bytes, 1)}).",
                hint="Make it fit in the Plan tab (a smaller micro-batch or sequence length, gradient checkpointing, "
                     f"qlora), or choose the card you train on in tab 1. To try it anyway, tick “{START_ANYWAY}”.",
            )
        job = jobs.start_job(recipe, runs_dir=self.runs, exact_name=True)
        note = "" if est.fits else (f" It is predicted not to fit {gpu.name}: if it runs out of memory, training "
                                    "halves the micro-batch and goes on.")
        for warning in warnings:
            gr.Warning(warning)
            note += f" ⚠ {warning}"
        return (*self.runs_outputs(job.name), f"✓ Training started: **{job.name}** (in `{paths.display(job.run_dir)}`).{note}",
                job.name)

    @shows_errors(0, 1)
    def on_stop(self, name: str):
        st = jobs.run_status(self.run_path(name), self.runs)
        if st.terminal:
            raise UserError(f"Not stopped: {run_views.terminal_note(st)}")
        if not jobs.stop_job(self.run_path(name), self.runs):
            raise UserError(f"{name} is not running.")
        return f"Stopping **{name}** after this step: a checkpoint is saved, and ↻ Resume continues it."

    @shows_errors(2, 4)
    def on_resume(self, name: str, allow_code: bool = False):
        self.confirm_code(name, bool(allow_code), START_CODE)
        st = jobs.run_status(self.run_path(name), self.runs)
        if not st.resumable:
            raise UserError(f"{name} cannot be resumed: it is {views.STATE_LABELS.get(st.state, ('', st.state))[1]}.",
                            hint="Only stopped or interrupted runs with a checkpoint resume.")
        saved = read_recipe(self.run_path(name) / "recipe.yaml")
        self.check_reward_code(saved, bool(allow_code), f"{name} not resumed")
        self.check_data_scope(saved)
        foreign = seal.unsealed(self.run_path(name))
        if foreign and not allow_code:
            raise UserError(f"{name}: its checkpoint {foreign[-1].name} holds FSDP/ZeRO shards that finetuner did not write "
                            "for you on this machine; resuming unpickles them, which can run code.",
                            hint=f"Tick “{START_CODE}” to confirm, only for a run you trust.")
        job = jobs.start_job(None, run_dir=self.run_path(name), runs_dir=self.runs, trust_checkpoints=bool(allow_code))
        return *self.runs_outputs(job.name), f"✓ Resuming **{job.name}** from its last checkpoint.", job.name


"""What each control of the web UI does: the methods of :class:`Handlers`.

A handler takes the values of its inputs and returns (or yields) those of its outputs;
:mod:`ui.layout` wires it to the page. Each calls finetuner's Python API
(:mod:`finetuner.planning.planner`, :mod:`finetuner.data.preview`, :mod:`finetuner.runs.jobs`,
:mod:`finetuner.infer.chat_worker`, :mod:`finetuner.export.worker`) and shows its
:class:`~finetuner.errors.UserError` as text in one output (:func:`ui.errors.shows_errors`).
Training, chat and merging run in processes of their own. None needs a browser:
``Handlers(runs_dir).on_check_yaml(text, "cpu")`` returns what the page would show.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import gradio as gr
from gradio import utils as gradio_utils
from gradio.components.plot import PlotData

from finetuner.config.sections import Objective
from finetuner.objectives.specs.grpo import GRPOSection
from finetuner.config.columns import ROLES
from finetuner.data.formats import SUPERVISED, refused_picture
from finetuner.data.picture_files import PictureTooLarge
from finetuner.data import scope as read_scope
from finetuner.data.scope import ReadScope, code_file, data_file, within
from finetuner.errors import UserError, did_you_mean
from finetuner.fileio import private_temp_dir
from finetuner.objectives.specs import names_where
from finetuner.rewards.specs import SPEC_FORM, parse_reward_specs
from finetuner.infer.loading import read_recipe
from finetuner.runs import jobs
from ui import paths, views
from ui.chat_handlers import ChatHandlers
from ui.chat_pool import ChatPool
from ui.errors import on_page, shows_errors
from ui.estimate import recipe_estimate
from ui.export_handlers import ExportHandlers
from ui.recipe_text import FIELD_COUNT, apply_fields, download_file, fields_of, recipe_from_text, recipe_text
from ui.train_handlers import CPU_CARD, START_ANYWAY, TrainHandlers, gpu_profile, plot

#: the Plan tab's objective choices: auto takes it from the data (finetuner.data.formats.AUTO_OBJECTIVE)
OBJECTIVES = ["auto", *get_args(Objective)]
#: the objectives the Plan tab's GRPO settings are shown for: those that generate their completions (objective grpo)
GENERATING = names_where(generates=True)
#: the Plan tab's GRPO settings (shown for objective grpo), with the recipe's defaults (GRPOSection)
GRPO_GENERATIONS = GRPOSection.model_fields["num_generations"].default
GRPO_NEW_TOKENS = GRPOSection.model_fields["max_new_tokens"].default
REWARDS_LABEL = "Rewards"
REWARDS_INFO = (f"one or more, separated by commas or new lines: {SPEC_FORM}. A relative FILE.py is looked for in "
                f"{paths.ROOT}, then in the folder the UI was started in (as the Data file is)")
#: the roles of ``data.columns`` the Data tab has a column menu for, in its order
COLUMN_ROLES = tuple(ROLES)
#: a column menu's choice that names no column: the role is read as the file's format has it
AS_DETECTED = ("— as detected —", "")


@functools.cache
def default_card() -> str:
    """``auto`` where finetuner finds a CUDA device (:func:`finetuner.config.hardware.detect`),
    else ``cpu``; looked for once per process."""
    from finetuner.config.hardware import detect

    return "auto" if detect() is not None else CPU_CARD


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str):
    from finetuner.data.preview import load_preview_tokenizer

    return load_preview_tokenizer(model)



def memory_plot(est, gpu) -> PlotData:
    return plot(views.memory_chart(est, gpu))


def empty_chart() -> None:
    """Empties a chart while its new figures are computed: a gradio BarPlot keeps its first colour
    scale otherwise, and the last plan's chart must not stand beside a new plan."""
    return None


def grpo_settings_shown(objective: str | None):
    """The Plan tab's GRPO settings (rewards, generations, new tokens) are shown for objective grpo only."""
    return gr.update(visible=objective in GENERATING)


def grpo_request(rewards: str | None, num_generations: float | None, max_new_tokens: float | None,
                 code_scope: ReadScope | None = None) -> dict[str, Any]:
    """The Plan tab's GRPO settings as :func:`finetuner.plan`'s ``grpo``: the Rewards box read by
    :func:`finetuner.rewards.specs.parse_reward_specs`, each reward file found as the Data file is
    (:func:`ui.paths.resolve_reward_file`) and one the page may run (``code_scope``:
    :func:`finetuner.data.scope.code_file`: a .py file, never an upload); an empty number is the recipe's default."""
    specs = parse_reward_specs(rewards or "")
    for spec in specs:
        if "file" in spec:
            spec["file"] = paths.resolve_reward_file(spec["file"], spec["function"])
            spec["file"] = str(code_file(spec["file"], f"reward '{spec['function']}'", code_scope))
    numbers = (("num_generations", num_generations), ("max_new_tokens", max_new_tokens))
    return {"rewards": specs, **{k: int(v) for k, v in numbers if v not in (None, "")}}


def picked_columns(picked: tuple | list) -> dict[str, str] | None:
    """``data.columns`` from the Data tab's column menus (in :data:`COLUMN_ROLES`' order): the roles
    given a column; ``None`` when none is (the format and columns are detected)."""
    columns = {role: str(col) for role, col in zip(COLUMN_ROLES, picked) if col}
    return columns or None





def uploaded_path(payload: Any) -> str | None:
    """Where gradio stored an upload (in its cache: it takes no other path), from the upload's value as the page
    sends it (a FileData, unprocessed: nothing of it decoded here)."""
    if isinstance(payload, dict):
        return payload.get("path") or None
    return payload or None



class Handlers(TrainHandlers, ChatHandlers, ExportHandlers):
    """The handlers of one app. ``runs_dir``: where runs and the job registry live (default
    ``runs/`` of the checkout); ``upload_dir``: where uploaded data files are stored (default
    ``data/uploads/``)."""

    def __init__(self, runs_dir: str | Path | None = None, upload_dir: str | Path | None = None,
                 max_upload_bytes: int | None = None, data_dirs: list[str | Path] | None = None):
        self.runs = Path(runs_dir or paths.runs_dir_default()).expanduser().resolve()
        self.uploads = Path(upload_dir).expanduser().resolve() if upload_dir else paths.UPLOAD_DIR
        #: where data files may be read from (``finetuner ui --data-dir``, and always when the UI serves
        #: other machines): ``data/``, the uploads, the runs and these; None: any file of this machine
        self.data_dirs = None if data_dirs is None else [
            paths.DATA_DIR, self.uploads, self.runs, *(Path(d).expanduser().resolve() for d in data_dirs)]
        #: the same folders as the library reads within them (finetuner.data.scope): every handler runs in it
        #: (ui.errors.on_page), so the data files and pictures it reads, and the jobs it starts, stay inside
        #: this app's own temp folder (0700, a fresh name): the recipe and adapter-zip downloads are
        #: written there, and it is the only folder the app serves files from (ui.app.launch)
        self.temp_dir = private_temp_dir("finetuner-ui-", owner=self)
        #: where what the page sends is stored (the uploads, gradio's upload cache, this app's temp folder): data,
        #: never code (finetuner.data.scope.code_file)
        self.sent_dirs = [self.uploads, Path(gradio_utils.get_upload_folder()), self.temp_dir]
        self.scope = None if self.data_dirs is None else ReadScope.of(self.data_dirs, map(paths.display, self.data_dirs),
                                                                       data_only=self.sent_dirs)
        #: where the page may run reward code from: inside the scope (any file of this machine without one), never
        #: what the page sent; the Start and Resume of a recipe naming a reward file also need “Allow the model's own
        #: code to run” (TrainHandlers.check_reward_code)
        self.code_scope = self.scope or ReadScope.of(["/"], [], data_only=self.sent_dirs)
        #: where the Export tab writes a served UI's outputs (None: anywhere): the runs folder
        self.write_scope = None if self.scope is None else ReadScope.of([self.runs], [paths.display(self.runs)])
        #: where the Plan tab's recipe box reads a served UI's recipes: its folders and the shipped recipes
        self.recipe_scope = None if self.scope is None else ReadScope.of(
            [*self.data_dirs, paths.RECIPES_DIR], [*self.scope.shown, paths.display(paths.RECIPES_DIR)])
        #: the largest upload taken (the launch gives gradio the same limit)
        self.max_upload_bytes = int(max_upload_bytes or paths.MAX_UPLOAD_BYTES)
        self.runs.mkdir(parents=True, exist_ok=True)
        self.chat_pool = ChatPool()
        #: what a browser with nothing remembered, and no run yet, starts from
        self.demo_model = paths.display(paths.DEMO_MODEL) if paths.DEMO_MODEL.is_dir() else ""
        data_choices = paths.data_files(self.uploads)
        self.default_data = ("data/alpaca_sample.json" if "data/alpaca_sample.json" in data_choices
                             else (data_choices[0] if data_choices else None))

    # ------------------------------------------------------------------ runs
    def run_path(self, name: str | None) -> Path:
        """The folder of the run ``name``: only folders directly in the runs folder."""
        if not name:
            raise UserError("Pick a run first.")
        p = self.runs / name
        if Path(name).name != name or name.startswith(".") or not p.is_dir():
            names = self.run_names()
            raise UserError(f"No run named {name} in {self.runs}.",
                            hint=f"Pick a run from the list.{did_you_mean(name, names)}" if names else "Train one first (tab 4).")
        return p

    def run_names(self, pred: Callable[[Any], bool] = lambda s: True) -> list[str]:
        return [s.name for s in jobs.list_runs(self.runs) if pred(s)]

    def current_run(self) -> str | None:
        running = jobs.running_jobs(self.runs)
        if running:
            return Path(running[0].run_dir).name
        names = self.run_names()
        return names[0] if names else None

    def with_free_name(self, recipe):
        """A planned or loaded recipe renamed ``name-2``... when a run already has its name: the
        name shown in the YAML is the run's folder, and Start never renames."""
        free = jobs.free_run_name(self.runs, recipe.name)
        return recipe if free == recipe.name else recipe.model_copy(update={"name": free})

    # ------------------------------------------------------------------ model & data
    def data_path(self, text: str) -> str:
        """A data file named in the UI, as an absolute path (or a hub data set id); outside :attr:`scope`,
        one refusal whatever is there (:func:`finetuner.data.scope.data_file`)."""
        text = (text or "").strip()
        if not text:
            return text
        with within(self.scope):
            return paths.resolve_data(data_file(text, [paths.ROOT]))

    def check_data_scope(self, recipe) -> None:
        """A recipe started or resumed from the UI loads a model, trains on files and starts from a run only inside
        :attr:`scope`, and on the pictures inside it that their rows name
        (:func:`finetuner.data.formats.refused_picture`); its reward files: :meth:`check_reward_code`."""
        if self.scope is None:
            return
        with within(self.scope):
            read_scope.recipe_paths(recipe, paths.ROOT, "Not started: recipe")
            refused = refused_picture(recipe.data)
        if refused is not None:
            raise UserError(f"Not started: {refused}", hint="Put the pictures in data/ (or in a folder the UI was started "
                                                            "with --data-dir), and name them relative to the data file.")

    @shows_errors(0, 1)
    def on_model(self, model_text: str, card: str):
        from finetuner.model.gguf_base import info_for
        from finetuner.model.shapes import preset_model, resolve_shape

        model = paths.resolve_model(model_text)
        shape = resolve_shape(model)
        gguf = info_for(preset_model(model) or model)  # a GGUF file, or a named model that loads one
        return views.model_card_md(shape, gpu_profile(card), gguf.note() if gguf is not None else None)

    @shows_errors(1, 2)
    def on_upload(self, file_path: str | None):
        """The uploaded file stored (or the stored file with the same content) and selected."""
        if not file_path:
            raise UserError("No file was uploaded.")
        dest, new = paths.save_upload(file_path, Path(file_path).name, self.uploads, self.max_upload_bytes)
        shown = paths.display(dest)
        gr.Info(f"Saved as {shown}" if new else f"Already uploaded (same content): {shown}")
        return gr.update(choices=paths.data_files(self.uploads), value=shown), gr.skip()

    def on_columns(self, data_file: str | None):
        """A data file chosen: the Data tab's column menus offer its columns (each left as detected),
        shown for a local file of supervised examples (preference data is read by its column names);
        the previous file's preview is cleared at once."""
        from finetuner.data.formats import file_columns, file_kind

        columns: list[str] = []
        with on_page(self):
            try:
                local = Path(self.data_path(data_file or ""))
                if local.is_absolute() and local.is_file():
                    columns = file_columns(str(local)) if file_kind(str(local)) == SUPERVISED else []
            except UserError:
                columns = []  # on_data says what is wrong with the file, or that this UI does not read it
        menus = [gr.update(choices=[AS_DETECTED, *((c, c) for c in columns)], value="") for _ in COLUMN_ROLES]
        return (gr.update(visible=bool(columns)), *menus, gr.update(value=[]), gr.update(value="", visible=False))

    @shows_errors(0, 4)
    def on_data(self, model_text: str, data_file: str, seq_len: float | None, *picked: str):
        """The Data tab: what the file holds, its token lengths against the sequence length, and its
        first examples: as the model sees them (SFT), or side by side for preference pairs and rated
        responses (:func:`finetuner.data.preview.preview_preferences`). ``picked``: the column menus'
        choices (:data:`COLUMN_ROLES`' order; blank: as detected), as ``data.columns``."""
        from finetuner.data.preview import preview_data, preview_preferences
        from finetuner.data.stats import profile_data
        from finetuner.planning.plan_inputs import data_seq_len

        if not data_file:
            raise UserError("Pick a data file, or upload one.")
        if seq_len is not None and seq_len < 0:
            raise UserError(f"Sequence length {seq_len:g}: give a number of tokens, or 0 to take it from the data.")
        path = self.data_path(data_file)
        model = paths.resolve_model(model_text)
        columns = picked_columns(picked)
        try:
            profile = profile_data(path, model, int(seq_len or 0) or None, columns=columns)
        except PictureTooLarge:
            raise  # what the file holds is not in question: one of its pictures is refused
        except UserError as not_sft:
            return self.prompts_view(path, model, int(seq_len or 0), columns, not_sft)
        seq = int(seq_len or 0) or data_seq_len(model, profile)  # 0: what the plan takes from the data
        hist = views.histogram_df(profile, seq)
        hist_update = gr.update(value=hist, sort=list(hist["tokens"]), title=f"Token lengths against the sequence length ({seq})")
        if profile.kind != SUPERVISED:
            pairs, note = None, ""
            try:
                pairs = preview_preferences(path, n=3)
            except UserError as e:
                note = f"\n\n**No preview:** {e.message}"
            shown = views.pairs_html(pairs) if pairs else ""
            return (views.preference_summary_md(profile, seq) + note, gr.update(value=[], visible=False), hist_update,
                    gr.update(value=shown, visible=bool(shown)))
        preview, preview_note = None, ""
        try:
            preview = preview_data(path, _tokenizer(model), n=3, max_seq_len=seq, columns=columns)
        except UserError as e:
            preview_note = f"\n\n**No token preview:** {e.message}"
        summary = views.data_summary_md(profile, preview, seq) + preview_note
        hl = views.preview_highlights(preview) if preview else []
        pictures = views.pictures_html(preview) if preview else ""  # a file with pictures: their thumbnails
        return summary, gr.update(value=hl, visible=True), hist_update, gr.update(value=pictures, visible=bool(pictures))

    def prompts_view(self, path: str, model: str, seq_len: int, columns: dict[str, str] | None, not_sft: UserError):
        """The Data tab for a file that is not supervised or preference data but holds prompts (objective
        grpo): their lengths against the sequence length (0: the longest prompt and the default completion,
        as a GRPO plan sizes it) and the first prompts as GRPO reads them. Raises ``not_sft`` when the file
        holds no prompts either."""
        from finetuner.data.preview import preview_prompts
        from finetuner.data.stats import profile_prompts
        from finetuner.planning.plan_inputs import data_seq_len

        try:
            profile = profile_prompts(path, model, columns=columns)
        except UserError:
            raise not_sft from None
        seq = seq_len or data_seq_len(model, profile, GRPO_NEW_TOKENS)
        hist = views.histogram_df(profile, seq)
        hist_update = gr.update(value=hist, sort=list(hist["tokens"]), title=f"Prompt lengths against the sequence length ({seq})")
        summary, shown = views.prompts_summary_md(profile, seq, not_sft.message), ""
        try:
            shown = views.prompts_html(preview_prompts(path, n=3, columns=columns))
        except UserError as e:
            summary += f"\n\n**No preview:** {e.message}"
        return summary, gr.update(value=[], visible=False), hist_update, gr.update(value=shown, visible=bool(shown))

    # ------------------------------------------------------------------ plan
    def _estimate_outputs(self, recipe, card: str, header: str = ""):
        gpu = gpu_profile(card)
        est = recipe_estimate(recipe, gpu)  # computed as the planner computes it: one figure on the page
        text = recipe_text(recipe, header)
        if not est.fits:
            gr.Warning(f"This recipe is predicted to need {views.gib(est.total_bytes, 1)}: more than {gpu.name} holds.")
        return memory_plot(est, gpu), views.estimate_md(est, gpu), text, download_file(text, recipe.name, self.temp_dir)

    def _valid_md(self, recipe, card: str, note: str = "") -> str:
        """The line under the editor, after every edit: valid, the predicted peak, and the time of this
        recipe as it now stands (``finetuner estimate``'s :func:`~finetuner.planning.predict.estimate_time`)."""
        from finetuner.planning.predict import estimate_time

        gpu = gpu_profile(card)
        est = recipe_estimate(recipe, gpu)
        verdict = "fits" if est.fits else "does **not** fit"
        try:
            timing = estimate_time(recipe, gpu)
        except UserError:
            timing = None
        took = f" Time: {views.time_text(timing)}." if timing else ""
        return (f"✓ The recipe is valid: run **{recipe.name}**, predicted peak {views.gib(est.total_bytes, 1)} "
                f"on {gpu.name}, which {verdict}.{took}{note}")

    @shows_errors(0, 8 + FIELD_COUNT)
    def on_plan(self, model_text: str, card: str, data_file: str, seq_len: float | None, eff_batch: float | None, method: str,
                objective: str | None = "auto", rewards: str | None = "", num_generations: float | None = None,
                max_new_tokens: float | None = None, *picked: str):
        """The planner's recipe for the model, card and data file; ``objective`` ``auto`` takes it
        from the data (sft, dpo for pairs, kto for rated responses), another must fit the file.
        For ``grpo``: ``rewards`` (the Rewards box), ``num_generations`` and ``max_new_tokens`` as the
        plan's ``grpo`` (:func:`grpo_request`); for another objective they are not shown, and not read.
        ``picked``: the Data tab's column menus (see :meth:`on_data`), written as ``data.columns``."""
        from finetuner.planning.planner import plan

        if not data_file:
            raise UserError("Pick a data file in the Data tab (or upload one) first: the plan is sized to the data.")
        grpo = grpo_request(rewards, num_generations, max_new_tokens, self.code_scope) if objective in GENERATING else None
        p = plan(
            paths.resolve_model(model_text),
            gpu_profile(card),
            seq_len=int(seq_len) if seq_len else None,
            data=self.data_path(data_file),
            effective_batch=int(eff_batch) if eff_batch else None,  # empty: the planner sizes it to the data
            method=method,  # "auto" as --method auto: the planner reads every front's the same (asked_method)
            objective=objective,
            runs_dir=self.runs,
            columns=picked_columns(picked),
            grpo=grpo,
        )
        if p.recipe is None:
            gr.Warning("Nothing fits this card; see the suggestions.")
            chart = memory_plot(p.estimate, p.gpu) if p.estimate else None
            est_md = views.estimate_md(p.estimate, p.gpu) if p.estimate else ""
            if p.closest is None:
                return (views.plan_md(p), chart, est_md, views.rejected_df(p), gr.skip(), gr.skip(), *[gr.skip()] * FIELD_COUNT,
                        gr.skip(), gr.skip())
            # the editor holds the option that needs the least memory: what "Start even if it does not fit" starts
            closest = self.with_free_name(p.closest)
            header = (f"# Nothing fits {p.gpu.name}: this is the option that needs the least memory "
                      f"({views.gib(p.peak_bytes, 1)}). To try it anyway, tick “{START_ANYWAY}” on the Train tab.\n")
            text = recipe_text(closest, header)
            return (views.plan_md(p), chart, est_md, views.rejected_df(p), text,
                    download_file(text, closest.name, self.temp_dir), *fields_of(closest), "", views.planned(p))
        recipe = self.with_free_name(p.recipe)
        header = "".join(f"{line}\n" for line in p.to_yaml().splitlines() if line.startswith("# "))
        mem, est_md, text, dl = self._estimate_outputs(recipe, card, header)
        return (views.plan_md(p), mem, est_md, views.rejected_df(p), text, dl, *fields_of(recipe), "", views.planned(p))

    def plan_if_empty(self, text: str, *args):
        """The plan, made when the editor is still empty (the Plan tab opened, Next pressed)."""
        return self.on_plan(*args) if not (text or "").strip() else (gr.skip(),) * (8 + FIELD_COUNT)

    def on_recipe_text(self, text: str, planned: dict | None, card: str | None = None):
        """The Plan tab's headline follows the recipe in the editor, however it changed (a plan, an
        edited field, a loaded file, typing), and so does its time on ``card`` (``finetuner estimate``'s
        :func:`~finetuner.planning.predict.estimate_time` of the recipe as it now stands)."""
        if not (text or "").strip():
            return ""
        try:
            with on_page(self):  # the recipe's paths are read within this UI's scope
                recipe = recipe_from_text(text)
        except UserError as e:
            return views.invalid_recipe_md(e.message)
        except Exception as e:  # noqa: BLE001 - shown, never raised: this runs on every keystroke
            return views.invalid_recipe_md(f"{type(e).__name__}: {e}")
        time = None
        if card:
            from finetuner.planning.predict import estimate_time

            try:
                with on_page(self):  # the recipe's data is read within this UI's scope
                    time = views.time_text(estimate_time(recipe, gpu_profile(card)))
            except Exception:  # noqa: BLE001 - the headline still shows; the time needs a recipe the planner reads
                time = None
        return views.recipe_md(recipe, planned, time)

    @shows_errors(4, 5)
    def on_edit(self, text: str, card: str, *fields):
        recipe = apply_fields(text, *fields)
        return *self._estimate_outputs(recipe, card), ""

    @shows_errors(3 + FIELD_COUNT, 4 + FIELD_COUNT)  # memory, estimate, download, the fields, the message
    def on_check_yaml(self, text: str, card: str):
        recipe = recipe_from_text(text)
        mem, est_md, _text, dl = self._estimate_outputs(recipe, card)
        return mem, est_md, dl, *fields_of(recipe), self._valid_md(recipe, card)

    @shows_errors(4 + FIELD_COUNT, 5 + FIELD_COUNT)  # the editor, memory, estimate, download, the fields, the message
    def on_load_recipe(self, name: str, card: str):
        from finetuner.config.recipe import Recipe

        if self.recipe_scope is not None:  # a served UI: its folders and the shipped recipes, one refusal elsewhere
            name = read_scope.local(name or "", "Recipe", [paths.ROOT], kind="recipes", scope=self.recipe_scope)
        local = paths.resolve_local(name)
        if local is None or not local.is_file():
            raise UserError(f"No recipe file {name}.")
        if self.scope is None:
            loaded = Recipe.from_yaml(local)  # relative paths resolved against the recipe's folder
        else:  # its paths checked against the scope before anything looks at them
            loaded = recipe_from_text(local.read_text(encoding="utf-8"), local.parent, str(local))
        recipe = self.with_free_name(loaded)
        note = "" if recipe.name == loaded.name else f" Renamed from {loaded.name}: a run already has that name."
        comments = []
        for line in local.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#"):
                break
            comments.append(line + "\n")
        mem, est_md, text, dl = self._estimate_outputs(recipe, card, "".join(comments))
        return text, mem, est_md, dl, *fields_of(recipe), self._valid_md(recipe, card, note)

    # ------------------------------------------------------------------ page load
    def latest_choice(self) -> dict[str, str]:
        """The model and data of the newest run's recipe: what a browser with nothing remembered
        starts from (the server's state, not the shipped sample)."""
        for st in jobs.list_runs(self.runs):
            try:
                recipe = read_recipe(Path(st.run_dir) / "recipe.yaml")  # as saved: its files need not exist any more
            except UserError:
                continue
            local_model = paths.resolve_local(str(recipe.model.name))
            local_data = paths.resolve_local(str(recipe.data.path))
            return {"model": paths.display(local_model) if local_model else str(recipe.model.name),
                    "data": paths.display(local_data) if local_data else ""}
        return {}

    def restored_recipe(self, text: str | None):
        """The recipe this browser had in the Plan tab's editor, for the editor and its advanced
        fields after a reload: as it was, renamed as a plan is (``name-2``...) when a run has taken
        its name meanwhile; a text that is not a valid recipe is given back as it was (the headline
        says what is wrong)."""
        if not (text or "").strip():
            return (gr.skip(),) * (1 + FIELD_COUNT)
        try:
            with on_page(self):
                recipe = recipe_from_text(text)
        except Exception:  # noqa: BLE001 - the user's own half-edited text: kept, the editor's checks explain it
            return (text, *[gr.skip()] * FIELD_COUNT)
        free = self.with_free_name(recipe)
        if free.name != recipe.name:
            header = "".join(f"{line}\n" for line in text.splitlines() if line.startswith("#"))
            text = recipe_text(free, header)
        return (text, *fields_of(free))

    def restorable(self, data: str) -> bool:
        """Whether a remembered data file is there to choose again: inside :attr:`scope` when there is one (nothing
        outside is looked at)."""
        if self.scope is None:
            return paths.resolve_local(data) is not None
        try:
            return Path(self.data_path(data)).is_file()
        except UserError:
            return False

    def on_restore(self, saved: dict | None):
        """A page (re)load: the choices this browser made last time (model, card, data, run, the
        recipe in the editor), else those of the newest run, else the defaults; uploads from any
        session are listed."""
        saved = saved if isinstance(saved, dict) else {}
        latest = self.latest_choice()
        data_choices = paths.data_files(self.uploads)
        data = next((d for d in (saved.get("data"), latest.get("data")) if d and self.restorable(d)), self.default_data)
        model_v = saved.get("model") or latest.get("model") or self.demo_model or None
        card_v = saved.get("card") or default_card()
        names = self.run_names()
        chosen = saved.get("run") if saved.get("run") in names else self.current_run()
        finished = self.run_names(lambda s: s.has_adapter)
        done = chosen if chosen in finished else (finished[0] if finished else None)
        return (
            gr.update(value=model_v),
            gr.update(value=card_v),
            gr.update(choices=sorted({*data_choices, data} - {None}), value=data),
            *self.runs_outputs(chosen),
            gr.update(choices=finished, value=done),
            gr.update(choices=finished, value=done),
            *self.restored_recipe(saved.get("recipe")),
        )

    def on_refresh_finished(self, current: str | None):
        finished = self.run_names(lambda s: s.has_adapter)
        return gr.update(choices=finished, value=current if current in finished else (finished[0] if finished else None))

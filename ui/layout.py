"""The web UI's page: six tabs in the order a first fine-tune takes (model → data → plan → train
→ chat → export), and the wiring of each control to its handler (:class:`ui.handlers.Handlers`).
Every ``elem_id``, label and ``api_name`` here is what the browser and API tests find."""

from __future__ import annotations

import functools
from typing import get_args

import gradio as gr

from finetuner.config.hardware import list_profiles
from finetuner.config.sections import TRACKERS, Optimizer
from finetuner.export.gguf import FORMATS, QUANTS
from finetuner.export.merge import DTYPE_CHOICES
from ui import paths, run_views
from finetuner.config.columns import ROLES
from ui.handlers import (AS_DETECTED, COLUMN_ROLES, GRPO_GENERATIONS, GRPO_NEW_TOKENS, OBJECTIVES, REWARDS_INFO, REWARDS_LABEL,
                         Handlers, default_card, empty_chart, grpo_settings_shown, uploaded_path)
from ui.train_handlers import ALLOW_CODE, ALLOW_CODE_INFO, CPU_CARD, START_ANYWAY, START_CODE, START_CODE_INFO

#: seconds between two looks at the run shown on the Train tab (status, progress, ETA)
TRAIN_POLL_S = 2.0

OVERWRITE_LABEL = "overwrite"
OUTPUT_LABEL = "Output folder"
METHODS = ["auto", "lora", "qlora", "full"]
OPTIMIZERS = list(get_args(Optimizer))
COLORS = {"trained": "#10b981", "masked": "#cbd5e1"}

#: what a browser remembers of its choices (gr.BrowserState, in localStorage): the inputs of on_restore
REMEMBER_JS = "(model, card, data, run, recipe) => ({model: model, card: card, data: data, run: run, recipe: recipe})"


def build_blocks(h: Handlers) -> gr.Blocks:
    """The page, each control wired to its handler in ``h``."""
    model_choices = paths.local_models() + _preset_choices()
    data_choices = paths.data_files(h.uploads)
    card_choices = [CPU_CARD, "auto"] + [p.name for p in list_profiles()]

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
                    model = gr.Dropdown(model_choices, value=h.demo_model or None, allow_custom_value=True, label="Model",
                                        info="a preset, a hub id (org/name) or a local folder with config.json", scale=3,
                                        elem_id="model-name")
                    card = gr.Dropdown(card_choices, value=default_card(), allow_custom_value=True, label="Card", elem_id="card",
                                       info="a known GPU, 'auto' (detected), 'cpu', or a size such as 24GB", scale=2)
                model_md = gr.Markdown(elem_id="model-card")
                with gr.Accordion("Known cards", open=True):
                    gr.Dataframe(_cards_df(), interactive=False, elem_id="cards-table")
                next1 = gr.Button("Next: the data →", size="sm")
            # ---------------------------------------------------------- 2 data
            with gr.Tab("2 · Data", id="data"):
                gr.Markdown("Pick a data file (JSONL, JSON, CSV or Parquet) or upload one. The preview shows each example "
                            "as the model sees it: **green** tokens are trained on, grey ones are context only. For "
                            "preference data (pairs of a chosen and a rejected response, or rated responses) it shows "
                            "the first examples side by side; for a file of prompts alone (objective grpo), the first "
                            "prompts.", elem_classes="ft-step")
                with gr.Row():
                    data_file = gr.Dropdown(data_choices, value=h.default_data, allow_custom_value=True, label="Data file",
                                            info=f"files in data/ and your uploads ({paths.display(h.uploads)}/, up to "
                                                 f"{h.max_upload_bytes / 2**20:g} MiB each), or a path",
                                            scale=3, elem_id="data-file")
                    seq_len = gr.Number(value=0, precision=0, label="Sequence length",
                                        info="tokens per example (0 = from the data)", scale=1)
                    # no file_types filter: gradio would refuse another type with a bare "Error" badge;
                    # save_upload's refusal says which types it reads, under the data tab's summary
                    upload = gr.UploadButton("Upload a file…", type="filepath", scale=1, elem_id="upload-btn")
                with gr.Accordion("Columns: which column holds what", open=True, visible=False,
                                  elem_id="column-menus") as column_box:
                    gr.Markdown("Leave a role *as detected* to read it as the file's format has it; choose a column to "
                                "map it (written into the recipe as `data.columns`).", elem_classes="ft-step")
                    with gr.Row():
                        pickers = [gr.Dropdown([AS_DETECTED], value="", label=role, info=ROLES[role], min_width=140,
                                               elem_id=f"column-{role}") for role in COLUMN_ROLES]
                data_md = gr.Markdown(elem_id="data-summary")
                with gr.Row():
                    with gr.Column(scale=3):
                        preview = gr.HighlightedText(label="Examples as the model sees them", color_map=COLORS,
                                                     combine_adjacent=False, show_legend=True, elem_id="data-preview")
                        pairs = gr.HTML(visible=False, elem_id="pair-preview")
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
                    plan_objective = gr.Dropdown(OBJECTIVES, value="auto", label="Objective", scale=1, elem_id="plan-objective",
                                                 info="auto: from the data (sft; dpo for pairs; kto for rated responses); "
                                                      "grpo: rewards of your own")
                    plan_btn = gr.Button("Make the plan", variant="primary", scale=1)
                with gr.Row(visible=False, elem_id="grpo-settings") as grpo_box:  # objective grpo only
                    plan_rewards = gr.Textbox(value="", label=REWARDS_LABEL, info=REWARDS_INFO, lines=2, scale=3, elem_id="plan-rewards",
                                              placeholder="rewards.py:my_reward, length_bounds(max_length=80)")
                    plan_gens = gr.Number(value=GRPO_GENERATIONS, precision=0, label="Generations per prompt", scale=1,
                                          info="completions per prompt, compared with each other", elem_id="plan-num-generations")
                    plan_new = gr.Number(value=GRPO_NEW_TOKENS, precision=0, label="Max new tokens", scale=1,
                                         info="the longest completion", elem_id="plan-max-new-tokens")
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
                    start_code = gr.Checkbox(label=START_CODE, value=False, elem_id="start-allow-code", info=START_CODE_INFO)
                f_report = gr.CheckboxGroup(list(TRACKERS), label="Report to", elem_id="report-to",
                                            info="where the run also appears (the recipe's logging.report_to); MLflow follows "
                                                 "MLFLOW_TRACKING_URI, W&B WANDB_MODE and WANDB_PROJECT, Trackio TRACKIO_DIR; "
                                                 "each but TensorBoard is an extra: pip install 'finetuner[mlflow]'")
                train_msg = gr.Markdown(elem_id="train-message")
                run_pick = gr.Dropdown([], label="Run", allow_custom_value=True, info="the run shown below; pick a past run to reopen it",
                                       elem_id="run-pick")
                status = gr.HTML(run_views.status_html(None), elem_id="train-status")
                with gr.Row():
                    with gr.Column(scale=3):
                        loss_plot = gr.Plot(show_label=False, elem_id="loss-plot", elem_classes="ft-chart")
                    with gr.Column(scale=3, visible=False, elem_id="reward-column") as reward_col:  # preference runs only
                        reward_plot = gr.Plot(show_label=False, elem_id="reward-plot", elem_classes="ft-chart")
                    with gr.Column(scale=2):
                        mem_md = gr.Markdown(elem_id="train-memory")
                        samples = gr.Markdown(elem_id="train-samples")
                with gr.Accordion("Past runs", open=True):
                    runs_table = gr.Dataframe(run_views.runs_df([]), interactive=False, elem_id="runs-table")
                train_seen = gr.State(None)  # what the Train tab last showed (see _train_view)
                started = gr.State(None)  # the run this page started or resumed last: Chat and Export show it once it ends
                timer = gr.Timer(TRAIN_POLL_S)
            # ---------------------------------------------------------- 5 chat
            with gr.Tab("5 · Chat", id="chat") as chat_tab:
                gr.Markdown("Talk to the fine-tuned model; the base model answers the same prompt beside it. "
                            "The models load in a separate process (the first answer takes a moment).",
                            elem_classes="ft-step")
                with gr.Row():
                    chat_run = gr.Dropdown([], label="Fine-tuned run", allow_custom_value=True, scale=3, elem_id="chat-run")
                    compare = gr.Checkbox(value=True, label="Base model beside it", scale=1)
                    chat_code = gr.Checkbox(value=False, label=ALLOW_CODE, info=ALLOW_CODE_INFO, scale=1, elem_id="chat-allow-code")
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("**Fine-tuned**", elem_classes="ft-lane-title")
                        tuned_bot = gr.Chatbot(label="Fine-tuned", show_label=False, buttons=[], height=340, elem_id="chat-tuned")
                    with gr.Column():
                        gr.Markdown("**Base model**", elem_classes="ft-lane-title")
                        base_bot = gr.Chatbot(label="Base model", show_label=False, buttons=[], height=340, elem_id="chat-base")
                with gr.Row():
                    # shown for a run whose model reads pictures only (Handlers.on_chat_run)
                    picture = gr.Image(type="filepath", sources=["upload"], label="Picture (a model that reads pictures)",
                                       height=120, scale=1, elem_id="chat-picture", visible=False)
                    chat_tools = gr.File(label="Tools (JSON schemas; a call shows as JSON)", file_types=[".json"], type="filepath",
                                         height=120, scale=1, elem_id="chat-tools")
                    msg = gr.Textbox(placeholder="Ask something…", show_label=False, scale=5, elem_id="chat-input")
                    send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
                    clear_btn = gr.Button("Clear", scale=1)
                chat_status = gr.Markdown(elem_id="chat-status")
                with gr.Accordion("Generation settings", open=False):
                    with gr.Row():
                        max_new = gr.Slider(8, 1024, value=96, step=8, label="max new tokens", elem_id="gen-max-new")
                        temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="temperature (0 = greedy)", elem_id="gen-temperature")
                        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="top-p", elem_id="gen-top-p")
                        seed = gr.Number(value=0, precision=0, label="seed", elem_id="gen-seed")
            # ---------------------------------------------------------- 6 export
            with gr.Tab("6 · Export", id="export") as export_tab:
                gr.Markdown("Merge the adapter into the base model (reloaded unquantized, in the dtype it was saved in unless "
                            "you choose another, so outputs match), or download the adapter alone.", elem_classes="ft-step")
                # the run on a row of its own: a long run name is shown whole
                export_run = gr.Dropdown([], label="Run", allow_custom_value=True, elem_id="export-run")
                with gr.Row():
                    out_dir = gr.Textbox(label=OUTPUT_LABEL, placeholder="default: runs/<run>/merged", scale=3, elem_id="out-dir")
                    dtype = gr.Dropdown(list(DTYPE_CHOICES), value="auto", label="dtype", scale=1, elem_id="merge-dtype",
                                        info="auto: as the base model was saved")
                    overwrite = gr.Checkbox(label=OVERWRITE_LABEL, scale=1, elem_id="overwrite")
                    export_code = gr.Checkbox(value=False, label=ALLOW_CODE, info=ALLOW_CODE_INFO, scale=1, elem_id="export-allow-code")
                with gr.Row():
                    merge_btn = gr.Button("Merge and save", variant="primary", elem_id="merge-btn")
                    zip_btn = gr.DownloadButton("Download the adapter (.zip)", value=None, interactive=False, elem_id="zip-btn")
                export_md = gr.Markdown(elem_id="export-status")
                gr.Markdown("Or export for llama.cpp, Ollama and LM Studio: the merged model as one GGUF file (or a GGUF "
                            "and an Ollama Modelfile), read back and checked against the merged model before it is "
                            "put in place.", elem_classes="ft-step")
                with gr.Row():
                    gguf_format = gr.Dropdown(list(FORMATS), value="gguf", label="format", scale=1, elem_id="gguf-format",
                                              info="ollama: a folder with the GGUF and a Modelfile")
                    gguf_quant = gr.Dropdown(list(QUANTS), value="f16", label="quantization", scale=1, elem_id="gguf-quant",
                                             info="q4_k_m needs llama-cpp-python")
                    gguf_out = gr.Textbox(label="Output file or folder", scale=3, elem_id="gguf-out",
                                          placeholder="default: runs/<run>/<run>-<quant>.gguf, or runs/<run>/ollama")
                    gguf_btn = gr.Button("Export to GGUF", variant="primary", scale=1, elem_id="gguf-btn")
                gguf_md = gr.Markdown(elem_id="gguf-status")

        # ------------------------------------------------------------------ wiring
        for button, target in ((next1, "data"), (next2, "plan"), (next3, "train")):
            button.click(functools.partial(gr.Tabs, selected=target), None, tabs, api_name=False)
        model_inputs = [model, card]
        for comp in model_inputs:
            comp.change(h.on_model, model_inputs, model_md, api_name=False)

        data_inputs = [model, data_file, seq_len, *pickers]
        data_outputs = [data_md, preview, hist, pairs]
        column_outputs = [column_box, *pickers, preview, pairs]
        data_file.change(empty_chart, None, hist, api_name=False).then(h.on_columns, data_file, column_outputs, api_name=False
                                                                        ).then(h.on_data, data_inputs, data_outputs, api_name="analyse_data")
        for picker in pickers:  # the user's choice only: the menus filled for a new file do not analyse it twice
            picker.input(empty_chart, None, hist, api_name=False).then(h.on_data, data_inputs, data_outputs, api_name=False)
        seq_len.submit(empty_chart, None, hist, api_name=False).then(h.on_data, data_inputs, data_outputs, api_name=False)
        seq_len.blur(empty_chart, None, hist, api_name=False).then(h.on_data, data_inputs, data_outputs, api_name=False)
        model.change(empty_chart, None, hist, api_name=False).then(h.on_data, data_inputs, data_outputs, api_name=False)
        upload.upload(h.on_upload, upload, [data_file, data_md], api_name="upload_data")

        fields = [f_method, f_micro, f_accum, f_seq, f_opt, f_gc, f_r, f_steps, f_log, f_eval, f_report]
        est_outputs = [mem_plot, est_md, recipe_yaml, download, yaml_md]
        planned = gr.State(None)  # what the planner chose and why (views.planned): edits are told apart from it
        plan_outputs = [plan_md, mem_plot, est_md, rejected, recipe_yaml, download, *fields, yaml_md, planned]
        plan_inputs = [model, card, data_file, seq_len, eff_batch, plan_method, plan_objective, plan_rewards, plan_gens, plan_new,
                       *pickers]
        plan_objective.change(grpo_settings_shown, plan_objective, grpo_box, api_name=False, queue=False)
        plan_btn.click(empty_chart, None, mem_plot, api_name=False).then(h.on_plan, plan_inputs, plan_outputs, api_name="plan")
        # opening the Plan tab plans an empty editor; "Next: the plan" opens it (a tab chosen by a button
        # fires select too: planning on the button as well made two plans, and two "Nothing fits" toasts)
        plan_tab.select(h.plan_if_empty, [recipe_yaml, *plan_inputs], plan_outputs, api_name=False)
        for f in fields:
            f.input(empty_chart, None, mem_plot, api_name=False).then(h.on_edit, [recipe_yaml, card, *fields], est_outputs, api_name=False)
        recipe_yaml.change(h.on_recipe_text, [recipe_yaml, planned, card], plan_md, api_name=False, show_progress="hidden",
                           trigger_mode="always_last")
        check_btn.click(empty_chart, None, mem_plot, api_name=False).then(h.on_check_yaml, [recipe_yaml, card], [mem_plot, est_md, download, *fields, yaml_md],
                                                                   api_name="estimate")
        load_btn.click(empty_chart, None, mem_plot, api_name=False).then(h.on_load_recipe, [shipped, card], [recipe_yaml, mem_plot, est_md, download, *fields, yaml_md],
                       api_name="load_recipe")

        train_outputs = [status, loss_plot, mem_md, samples, start_btn, stop_btn, resume_btn, train_seen, runs_table,
                         reward_col, reward_plot, train_msg, chat_run, export_run]
        start_btn.click(h.on_start, [recipe_yaml, card, data_file, start_anyway, start_code], [run_pick, runs_table, train_msg, started],
                        api_name="start_training")
        stop_btn.click(h.on_stop, run_pick, train_msg, api_name="stop_training")
        resume_btn.click(h.on_resume, [run_pick, start_code], [run_pick, runs_table, train_msg, started], api_name="resume_training")
        run_pick.change(lambda name, mine: h.train_view(name, None, mine), [run_pick, started], train_outputs, api_name=False)
        timer.tick(h.train_view, [run_pick, train_seen, started], train_outputs, api_name=False, show_progress="hidden")
        # a (re)load restores this browser's choices, then shows the model and the data chosen
        app.load(h.on_restore, saved, [model, card, data_file, run_pick, runs_table, chat_run, export_run, recipe_yaml, *fields],
                 api_name=False
                 ).then(h.on_model, model_inputs, model_md, api_name=False).then(h.on_columns, data_file, column_outputs, api_name=False
                 ).then(h.on_data, data_inputs, data_outputs, api_name=False)
        remembered = [model, card, data_file, run_pick, recipe_yaml]
        for comp in remembered:  # in the browser only: stored at once, no round trip to the server
            comp.change(None, remembered, saved, js=REMEMBER_JS, api_name=False, queue=False)

        # the picture reaches the handler through a State, which is not part of the /chat API's parameters; as the
        # path of the upload gradio stored, not preprocessed: gradio would decode it (to RGB) whatever its size, where
        # the chat opens it within the model's pixel limit (finetuner.data.picture_files)
        picture_held = gr.State(None)
        picture.change(uploaded_path, picture, picture_held, api_name=False, queue=False, preprocess=False)
        chat_inputs = [msg, tuned_bot, base_bot, chat_run, compare, max_new, temperature, top_p, seed, chat_code, picture_held, chat_tools]
        send.click(h.on_chat, chat_inputs, [msg, tuned_bot, base_bot, chat_status], api_name="chat")
        msg.submit(h.on_chat, chat_inputs, [msg, tuned_bot, base_bot, chat_status], api_name=False)
        clear_btn.click(lambda: ([], []), None, [tuned_bot, base_bot], api_name=False)
        chat_tab.select(h.on_refresh_finished, chat_run, chat_run, api_name=False)
        chat_run.change(h.on_chat_run, chat_run, picture, api_name=False)
        export_tab.select(h.on_refresh_finished, export_run, export_run, api_name=False)

        merge_btn.click(h.on_merge, [export_run, out_dir, dtype, overwrite, export_code], export_md, api_name="merge")
        gguf_btn.click(h.on_gguf, [export_run, gguf_format, gguf_quant, gguf_out, overwrite, export_code], gguf_md, api_name="export_gguf")
        export_run.change(h.on_zip, export_run, [zip_btn, export_md], api_name="adapter_zip")

    return app


def _cards_df():
    import pandas as pd

    rows = [(p.name, p.description, f"{p.memory_gib:.1f}", "yes" if p.bf16 else "no") for p in list_profiles()]
    return pd.DataFrame(rows, columns=["card", "description", "GiB", "bf16"])


def _preset_choices() -> list[str]:
    try:
        from finetuner.model.shapes import preset_names

        return preset_names()
    except Exception:  # noqa: BLE001
        return []

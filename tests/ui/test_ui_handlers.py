"""The web UI's handlers without a browser, and what the UI leaves to the library: it merges in
another process through the Python API and shows the merge's ``UserError`` as raised; it reads
and writes recipes with ``finetuner.config.recipe``; it finds the GPU with
``finetuner.config.hardware``; it runs no command to scrape its output."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from finetuner.config.recipe import Recipe, readable_yaml
from finetuner.errors import UserError
from finetuner.export.merge import merge_adapter
from finetuner.rewards.builtin import BUILTINS
from tests.conftest import demo_run_folder, wait_until_done
from ui import handlers as ui_handlers
from ui import views
from ui.errors import error_md
from ui.handlers import Handlers
from ui.train_handlers import START_CODE, TRAIN_OUTPUTS

REPO = Path(__file__).resolve().parents[2]
DEMO = {"model": {"name": str(REPO / "data" / "demo_model")}, "data": {"path": str(REPO / "data" / "alpaca_sample.json")}}


def test_the_export_handler_shows_the_merges_own_refusal(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    run = demo_run_folder(h.runs)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine", encoding="utf-8")
    shown = list(h.on_merge(run.name, str(full), "auto", False))
    with pytest.raises(UserError) as e:
        merge_adapter(run, full)
    assert shown[0].startswith(f"Merging {run.name} into its base model")
    assert shown[-1] == error_md(e.value)  # the merge's message and hint, nothing of the UI's own
    assert "is not empty" in shown[-1] and "keep.txt" in shown[-1] and "empty that folder yourself" in shown[-1]
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    missing = list(h.on_merge("no-such-run", "", "auto", False))
    assert len(missing) == 1 and "No run named no-such-run" in missing[0]  # refused before anything starts


def test_the_export_tab_writes_a_checked_gguf_and_an_ollama_folder(tmp_path):
    """GGUF and Ollama from the Export tab: the library's export in another process, its checks
    reported on the page, and its refusals shown as raised."""
    import gguf

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    run = demo_run_folder(h.runs, adapter=True)
    shown = list(h.on_gguf(run.name, "gguf", "q8_0", "", False))
    file = run / f"{run.name}-q8_0.gguf"
    assert shown[0].startswith(f"Exporting {run.name} to GGUF (q8_0)")
    assert shown[-1].startswith(f"✓ q8_0 GGUF saved to `{file}`"), shown[-1]
    assert "top-1 agreement 100%" in shown[-1] and "same ids" in shown[-1]
    tensors = re.search(r"MiB, (\d+) tensors", shown[-1]).group(1)
    waiting = shown[1:-1]  # while the worker works: the head and its latest phase's line (finetuner.phases.line)
    assert waiting and all(w.startswith(shown[0] + "\n\n") for w in waiting)
    assert any("loading the model: done, in " in w for w in waiting)
    assert any(f"writing the GGUF file: done, {tensors} tensors in " in w for w in waiting), waiting
    assert any(f"reading the GGUF file back: done, {tensors} tensors in " in w for w in waiting)
    assert gguf.GGUFReader(file).fields["general.architecture"].contents() == "llama"
    again = list(h.on_gguf(run.name, "gguf", "q8_0", "", False))[-1]
    assert "exists" in again and "overwrite" in again and not again.startswith("✓")  # the export's own refusal
    assert "tick “overwrite”" in again and not re.search(r"(?<![\w-])(-o|--overwrite)\b", again)  # worded for the page
    folder = tmp_path / "ollama"
    done = list(h.on_gguf(run.name, "ollama", "f16", str(folder), False))[-1]
    assert "ollama create" in done and (folder / "Modelfile").is_file() and (folder / "model.gguf").is_file()
    assert f"ollama create {run.name} -f" in done  # named after the run, not the folder


def test_the_editor_reads_and_writes_recipes_with_the_library(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    recipe = Recipe.from_dict(dict(DEMO, name="edited", distributed={"num_processes": 2}))
    text = readable_yaml(recipe)
    *_, checked = h.on_check_yaml(text, "cpu")
    assert checked.startswith("✓ The recipe is valid: run **edited**")
    file = tmp_path / "mine.yaml"
    file.write_text("# my recipe\n" + text, encoding="utf-8")
    shown, *_ = h.on_load_recipe(str(file), "cpu")
    assert shown == "# my recipe\n" + text  # the library's writer: the same keys in the same order
    assert "distributed:\n  num_processes: 2" in shown  # kept (the UI's own copy of the writer lost it)
    *_, bad = h.on_check_yaml("model: [", "cpu")
    with pytest.raises(UserError) as e:
        Recipe.from_yaml_text("model: [", source="recipe")
    assert bad == error_md(e.value)  # the recipe's own message, not a second formatter's


def test_the_default_card_is_what_hardware_detect_finds(monkeypatch):
    from finetuner.config import hardware

    ui_handlers.default_card.cache_clear()
    try:
        monkeypatch.setattr(hardware, "detect", lambda: None)
        assert ui_handlers.default_card() == "cpu"
        ui_handlers.default_card.cache_clear()
        monkeypatch.setattr(hardware, "detect", lambda: hardware.PROFILES["rtx4090"])
        assert ui_handlers.default_card() == "auto"
    finally:
        ui_handlers.default_card.cache_clear()


def test_ui_runs_no_command_to_scrape_and_keeps_no_copy_of_library_logic():
    for path in sorted((REPO / "ui").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"subprocess", "yaml"}, f"ui/{path.name} imports {imported & {'subprocess', 'yaml'}}"
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not [s for s in strings if s.startswith("error:")], f"ui/{path.name} looks for error: lines"
        assert "nvidia-smi" not in text, f"ui/{path.name} runs nvidia-smi (use finetuner.config.hardware.detect)"
        assert "exclude_defaults" not in text, f"ui/{path.name} dumps a recipe itself (use finetuner.config.recipe.readable_yaml)"


# --------------------------------------------------------------------------- preference tuning
PAIRS = REPO / "data" / "preference_sample.jsonl"
MODEL = str(REPO / "data" / "demo_model")


def test_the_data_tab_shows_pairs_side_by_side_and_sft_as_before(tmp_path):
    import json

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    summary, highlights, hist, pairs = h.on_data(MODEL, str(PAIRS), 256)
    assert "preference pairs" in summary and "**400** pairs" in summary and "Fits objective dpo, orpo or simpo" in summary
    assert highlights["visible"] is False and pairs["visible"] is True  # the token view gives way to the pairs
    first = json.loads(PAIRS.read_text(encoding="utf-8").splitlines()[0])
    assert first["chosen"]["value"] in pairs["value"] and first["rejected"]["value"] in pairs["value"]
    assert sum(hist["value"]["examples"]) == 400  # lengths of the pairs, against the sequence length
    summary, highlights, _hist, pairs = h.on_data(MODEL, str(REPO / "data" / "alpaca_sample.json"), 256)
    assert summary.startswith("**Format:** `alpaca (instruction/output)`") and "No token preview" not in summary  # the SFT view, unchanged
    assert highlights["visible"] is True and {label for _t, label in highlights["value"]} >= {"trained", "masked"}
    assert pairs == {"__type__": "update", "value": "", "visible": False}
    rated = tmp_path / "rated.jsonl"
    rated.write_text("".join(json.dumps({"prompt": f"Where is hide {i}?", "completion": "North.", "label": i % 2 == 0}) + "\n"
                             for i in range(6)), encoding="utf-8")
    summary, highlights, _hist, shown = h.on_data(MODEL, str(rated), 256)
    assert "**6** rated responses" in summary and "Fits objective kto" in summary and highlights["visible"] is False
    assert "<th>prompt</th><th>response</th><th>label</th>" in shown["value"] and (shown["value"].count("✓ desirable"), shown["value"].count("✕ undesirable")) == (2, 1)


def test_the_data_tab_names_a_bad_pair_among_the_first(tmp_path):
    import json

    bad = tmp_path / "pairs.jsonl"
    rows = [{"question": f"Q{i}", "chosen": "Tern here!", "rejected": "No."} for i in range(5)]
    rows[1]["rejected"] = "Tern here!"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    summary, _hl, _hist, pairs = h.on_data(MODEL, str(bad), 256)
    assert "**4** pairs" in summary and "**1 row(s) cannot be used**" in summary
    assert f"**No preview:** {bad}, line 2: 'chosen' and 'rejected' are the same response" in summary
    assert pairs["visible"] is False


def test_the_plan_tab_plans_the_objective_chosen_or_the_datas(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")

    def planned(data, objective):
        out = h.on_plan(MODEL, "cpu", str(data), 128, 0, "auto", objective)
        return out[0], Recipe.from_yaml_text(out[4], source="recipe") if out[4] and isinstance(out[4], str) else None

    head, recipe = planned(PAIRS, "auto")
    assert recipe.objective == "dpo" and head.startswith("### DPO · LORA") and "objective dpo:" in head
    head, recipe = planned(PAIRS, "simpo")
    assert recipe.objective == "simpo" and head.startswith("### SIMPO · LORA")
    head, recipe = planned(REPO / "data" / "alpaca_sample.json", "auto")
    assert recipe.objective == "sft" and head.startswith("### LORA")
    head, recipe = planned(PAIRS, "kto")
    assert recipe is None and head.startswith('<div class="ft-error"') and f"{PAIRS}: this file holds preference pairs" in head
    assert "fits objective dpo, orpo or simpo, not 'kto'" in head


def _events(run, events) -> None:
    import json

    run.mkdir(parents=True)
    (run / "events.jsonl").write_text("".join(json.dumps(dict(e, time=1.0)) + "\n" for e in events), encoding="utf-8")


def test_the_train_tab_draws_rewards_for_preference_runs_only(tmp_path):
    import json

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    start = {"event": "start", "max_steps": 4, "device": "cpu", "method": "lora"}
    steps = [{"event": "step", "step": s, "max_steps": 4, "loss": 0.7 - 0.05 * s} for s in (1, 2, 3)]
    rewards = [{"reward_chosen": 0.1 * s, "reward_rejected": -0.1 * s, "reward_margin": 0.2 * s, "reward_accuracy": a}
               for s, a in ((1, 0.5), (2, 0.625), (3, 0.875))]
    _events(h.runs / "dpo", [dict(start, objective="dpo"), *[s | r for s, r in zip(steps, rewards)],
                             {"event": "eval", "step": 2, "eval_loss": 0.66, "eval_reward_accuracy": 0.7, "eval_reward_margin": 0.3}])
    _events(h.runs / "sft", [start, *steps])
    out = h.train_view("dpo")
    assert len(out) == TRAIN_OUTPUTS
    status, _loss, *_, seen, _table, column, rewards_plot, _message, _chat, _export = out
    assert "reward accuracy <b>88%</b>" in status and "eval reward accuracy <b>70%</b>" in status
    assert column == {"__type__": "update", "visible": True}
    spec = json.loads(rewards_plot.plot)
    assert [(r["step"], r["value"]) for r in spec["data"]["values"] if r["series"] == "accuracy"] == [(1, 0.5), (2, 0.625), (3, 0.875)]
    assert [(r["step"], r["value"]) for r in spec["data"]["values"] if r["series"] == "eval accuracy"] == [(2, 0.7)]
    again = h.train_view("dpo", seen)  # nothing new: neither chart nor the column is sent again
    assert again[1] == again[9] == again[10] == gr_skip()
    status, *_, column, rewards_plot, _message, _chat, _export = h.train_view("sft", seen)
    assert "reward" not in status and column == {"__type__": "update", "visible": False} and rewards_plot == gr_skip()


def gr_skip():
    import gradio as gr

    return gr.skip()


# --------------------------------------------------------------------------- GRPO
REWARDS = REPO / "recipes" / "rewards_demo.py"
SAMPLE = str(REPO / "data" / "alpaca_sample.json")


def test_the_plan_tab_plans_grpo_on_the_rewards_named_and_train_starts_it(tmp_path):
    """Objective grpo with the Rewards box (a file relative to the checkout, as a data file is, and a
    built-in), the generations and new tokens: the planner's GRPO recipe, its reasons on the page; Start
    runs it as a GRPO run, whose completions and rewards the Train tab shows."""
    from finetuner.planning.planner import plan
    from ui.recipe_text import fields_of

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    out = h.on_plan(MODEL, "cpu", SAMPLE, 0, 0, "auto", "grpo", "recipes/rewards_demo.py:mentions_whistle,\nlength_bounds(min_length=2, max_length=6)", 2, 8)
    head, text = out[0], out[4]
    assert head.startswith("### GRPO · LORA") and "ft-error" not in head, head
    recipe = Recipe.from_yaml_text(text, source="recipe")
    assert recipe.objective == "grpo" and (recipe.grpo.num_generations, recipe.grpo.max_new_tokens) == (2, 8)
    assert [(r.function, r.file) for r in recipe.grpo.rewards] == [("mentions_whistle", str(REWARDS)), ("length_bounds", None)]
    assert recipe.grpo.rewards[1].args == {"min_length": 2, "max_length": 6}
    want = plan(MODEL, "cpu", data=SAMPLE, runs_dir=h.runs, grpo={"rewards": [{"function": "mentions_whistle", "file": str(REWARDS)},
                                                                               {"function": "length_bounds", "args": {"min_length": 2, "max_length": 6}}],
                                                                      "num_generations": 2, "max_new_tokens": 8})
    assert recipe == want.recipe  # the library's plan, nothing of the UI's own
    room = next(r for r in want.reasons if r.startswith("GRPO room on this choice: 2 generations of up to 8 new tokens"))
    assert f"- {room}" in head and all(f"- {r}".replace("'", "&#x27;") in head for r in want.reasons)
    # another objective does not read the (hidden) GRPO settings
    assert Recipe.from_yaml_text(h.on_plan(MODEL, "cpu", SAMPLE, 0, 0, "auto", "auto", "no_such_reward", 2, 8)[4],
                                 source="recipe").objective == "sft"
    # Start: a GRPO run of two steps, followed as any run is
    fields = list(fields_of(recipe))
    fields[1], fields[2], fields[7] = 2, 1, 2  # micro-batch, accumulation, max steps
    *_, edited, _dl, error = h.on_edit(text, "cpu", *fields)
    assert error == "" and "objective: grpo" in edited and "max_steps: 2" in edited
    assert Recipe.from_yaml_text(edited, source="recipe").grpo.rewards[1].args == {"min_length": 2, "max_length": 6}
    _run, _table, refused, _mine = h.on_start(edited, "cpu", SAMPLE, False)  # its reward file runs code: the box is asked
    assert "Tick “Allow the model's own code to run” to confirm" in refused and h.run_names() == [], refused
    _run, _table, started, _mine = h.on_start(edited, "cpu", SAMPLE, False, True)
    assert started.startswith(f"✓ Training started: **{recipe.name}**"), started
    st = wait_until_done(h.runs, recipe.name)
    status, _loss, _mem, samples, *_, column, rewards_plot, _message, _chat, _export = h.train_view(recipe.name)
    assert st.objective == "grpo" and "finished" in status and "step <b>2</b> / 2" in status
    assert "| mentions_whistle | length_bounds |" in samples and column == {"__type__": "update", "visible": True}
    assert rewards_plot != gr_skip()


@pytest.mark.parametrize("rewards, shown", [
    ("", "objective grpo: GRPO trains on rewards, and none is named.\nName one in Rewards: FILE.py:FUNCTION"),
    (" , \n", "objective grpo: GRPO trains on rewards, and none is named.\nName one in Rewards: FILE.py:FUNCTION"),
    ("exact_match, no_such_reward", f"reward 'no_such_reward': not a built-in reward ({', '.join(BUILTINS)}) "
                                      "and no file given."),
    ("recipes/rewards_dem.py:mentions_whistle", f"reward 'mentions_whistle': 'recipes/rewards_dem.py' does not exist (looked in {REPO}"),
    ("recipes/rewards_demo.py:whistle", f"reward 'whistle': {REWARDS} defines no top-level 'whistle'.\nFunctions it defines: "
                                        "mentions_whistle."),
    ("rewards.py:", "reward 'rewards.py:': write FILE.py:FUNCTION"),
])
def test_a_grpo_plan_without_a_usable_reward_says_which_and_what_to_do(tmp_path, rewards, shown):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    out = h.on_plan(MODEL, "cpu", SAMPLE, 0, 0, "auto", "grpo", rewards, 4, 64)
    assert out[0].startswith(f'<div class="ft-error" role="alert">✕ {shown}'), out[0]  # the message, where errors are shown
    assert "rewards_dem.py" not in rewards or "Near matches: recipes/rewards_demo.py." in out[0]
    assert "Traceback" not in out[0] and "--reward" not in out[0]  # the page's wording, not the CLI's
    assert all(o == gr_skip() for i, o in enumerate(out) if i != 0)  # the editor keeps what it had


def test_the_grpo_settings_are_shown_for_objective_grpo_only():
    from ui.handlers import OBJECTIVES, grpo_settings_shown

    assert {o: grpo_settings_shown(o)["visible"] for o in OBJECTIVES} == {o: o == "grpo" for o in OBJECTIVES}


def test_the_data_tab_shows_a_file_of_prompts_as_grpo_reads_it(tmp_path):
    """A file of prompts alone (no responses: not supervised data) is shown as prompts for objective grpo:
    their lengths, the first prompts and the columns the rewards get; the Plan tab plans GRPO on it."""
    import json

    from finetuner.data.stats import profile_prompts

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "What should I pack?", "answer": "a whistle"}, {"prompt": "Where is the hut?", "answer": "north"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which way?"}], "answer": "left"},
            {"answer": "no prompt"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    summary, highlights, hist, table = h.on_data(MODEL, str(prompts), 256)
    assert "ft-error" not in summary, summary
    assert "**Holds** prompts (objective grpo: the prompt side of each row) · **3** prompts" in summary
    assert "**Fits objective grpo**" in summary and "every prompt fits in 256 tokens" in summary
    assert f"**1 row(s) cannot be used**, the first: {prompts}, line 4: no prompt" in summary
    assert f"Not supervised examples: {prompts}, line 1: cannot tell the data format from the columns (prompt, answer)." in summary
    assert highlights["visible"] is False and table["visible"] is True  # no trained tokens to show: the prompts instead
    assert "<th>prompt</th><th>other columns (for the rewards)</th>" in table["value"]
    assert [table["value"].count(t) for t in ("What should I pack?", "a whistle", "<b>system</b> Be brief.", "<b>user</b> Which way?",
                                               "<b>answer</b>")] == [1, 1, 1, 1, 3]
    assert hist["value"]["examples"].sum() == 3  # the three prompts read
    assert profile_prompts(str(prompts), MODEL).rows == 3
    assert h.on_data(MODEL, str(prompts), 0)[2]["title"].startswith("Prompt lengths against the sequence length (")
    out = h.on_plan(MODEL, "cpu", str(prompts), 0, 0, "auto", "grpo", "exact_match", 2, 16)
    assert out[0].startswith("### GRPO · LORA") and Recipe.from_yaml_text(out[4], source="recipe").data.path == str(prompts)
    # a file with neither responses nor prompts keeps the reader's message
    (tmp_path / "neither.jsonl").write_text(json.dumps({"colour": "red"}) + "\n", encoding="utf-8")
    summary, *_ = h.on_data(MODEL, str(tmp_path / "neither.jsonl"), 256)
    assert summary.startswith('<div class="ft-error"') and "cannot tell the data format from the columns (colour)" in summary


def test_resuming_a_run_whose_recipe_names_reward_files_needs_the_tick(tmp_path):
    """A run folder may come from someone else: its recipe's reward files are code that runs while it trains."""
    import yaml

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    raw = yaml.safe_load((REPO / "recipes" / "demo_grpo_cpu.yaml").read_text())
    raw["model"]["name"], raw["data"]["path"] = MODEL, SAMPLE
    raw["grpo"]["rewards"][0]["file"] = str(REWARDS)
    run = h.runs / "someone-elses"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(UserError, match=f"names reward functions in {REWARDS}, which run on this machine") as e:
        h.confirm_code("someone-elses", False, START_CODE)
    assert START_CODE in e.value.hint
    h.confirm_code("someone-elses", True, START_CODE)  # ticked: allowed
    # chat, merge and export never call the reward functions: they do not ask for the tick (it taught ticking it)
    merged = " ".join(str(x) for x in h.on_merge("someone-elses", str(tmp_path / "merged"), "fp32", False))
    assert "reward functions" not in merged and "Tick" not in merged, merged
    h.confirm_code("someone-elses", False, rewards=False)
    raw["grpo"]["rewards"] = [{"function": "length_bounds", "args": {"max_length": 8}}]  # built-ins run no user code
    (run / "recipe.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    h.confirm_code("someone-elses", False, START_CODE)


def test_resuming_sharded_checkpoints_that_are_not_ours_needs_the_tick(tmp_path, monkeypatch):
    """An FSDP/ZeRO checkpoint is unpickled when it resumes: one this user's finetuner did not seal
    (finetuner.training.seal) is code from the run's folder, so Resume asks for the tick and then
    passes it on (``finetuner run --trust-checkpoints``)."""
    import yaml

    from finetuner.runs.jobs import RunStatus
    from finetuner.training import seal

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    raw = yaml.safe_load((REPO / "recipes" / "demo_cpu.yaml").read_text())
    raw["model"]["name"], raw["data"]["path"] = MODEL, SAMPLE
    run = h.runs / "received"
    ckpt = run / "checkpoints" / "step-00000004"
    (ckpt / "fsdp").mkdir(parents=True)
    (ckpt / "fsdp" / ".metadata").write_bytes(b"a pickle")
    (ckpt / "trainer_state.json").write_text('{"step": 4}', encoding="utf-8")
    (run / "recipe.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    monkeypatch.setattr(ui_handlers.jobs, "run_status", lambda *a, **k: RunStatus(str(run), "received", "stopped", step=4, max_steps=10))
    started = []
    monkeypatch.setattr(ui_handlers.jobs, "start_job", lambda *a, **k: started.append(k) or (_ for _ in ()).throw(UserError("stop here")))
    refused = " ".join(map(str, h.on_resume("received", False)))
    assert "step-00000004 holds FSDP/ZeRO shards that finetuner did not write for you on this machine" in refused
    assert START_CODE in refused and started == []
    h.on_resume("received", True)
    assert started[-1]["trust_checkpoints"] is True
    seal.write(ckpt)  # sealed by this user: no tick needed, nothing trusted beyond the seal
    h.on_resume("received", False)
    assert started[-1]["trust_checkpoints"] is False


def test_a_ui_that_serves_other_machines_reads_data_files_only_from_its_folders(tmp_path, monkeypatch):
    """``finetuner ui --host 0.0.0.0`` (or ``--data-dir``): whoever reaches the page cannot preview, plan
    on, or train on a file of the server outside ``data/``, the uploads, the runs and ``--data-dir``."""
    import json
    import shutil

    from ui import app as ui_app

    secret = tmp_path / "home" / "notes.jsonl"  # any file of the server with a data extension
    secret.parent.mkdir()
    secret.write_text(json.dumps({"instruction": "the server's secret", "output": "s3cret"}) + "\n", encoding="utf-8")
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(SAMPLE, mine / "own.json")
    h = Handlers(tmp_path / "runs", tmp_path / "uploads", data_dirs=[mine])
    shown = " ".join(map(str, h.on_data(MODEL, str(secret), 64)))
    assert f"Data file {secret}: this UI reads data files only from data, " in shown and "s3cret" not in shown
    assert "--data-dir FOLDER" in shown
    assert "s3cret" not in " ".join(map(str, h.on_plan(MODEL, "cpu", str(secret), 0, 0, "auto", "sft", "", 2, 16)))
    assert h.on_columns(str(secret))[0]["visible"] is False
    link = mine / "link.jsonl"  # a link inside an allowed folder to a file outside it
    link.symlink_to(secret)
    assert "this UI reads data files only from" in " ".join(map(str, h.on_data(MODEL, str(link), 64)))
    # inside the folders: read as ever
    assert "No data" not in " ".join(map(str, h.on_data(MODEL, str(mine / "own.json"), 64)))
    assert h.data_path(SAMPLE) == str(Path(SAMPLE).resolve())
    raw = Recipe.from_yaml(REPO / "recipes" / "demo_cpu.yaml").to_dict()
    raw["data"]["path"], raw["model"]["name"] = str(secret), MODEL
    with pytest.raises(UserError, match="this UI reads data files only from"):
        h.check_data_scope(Recipe.from_dict(raw))
    # a UI on this machine only reads any file of yours; any other host limits it
    assert Handlers(tmp_path / "runs", tmp_path / "uploads").data_path(str(secret)) == str(secret)
    built = []
    monkeypatch.setattr(ui_app, "build_app", lambda *a: built.append(a[3]) or (_ for _ in ()).throw(RuntimeError("built")))
    for host, want in (("127.0.0.1", None), ("0.0.0.0", [])):
        with pytest.raises(RuntimeError, match="built"):
            ui_app.launch(runs_dir=tmp_path / "runs", host=host, block=False)
        assert built[-1] == want


def test_the_plan_tabs_time_follows_every_edit_of_the_recipe(tmp_path):
    """Planned, then max steps set to 6 (the field, or typed): the headline's time is the edited recipe's
    (`finetuner estimate`'s estimate_time), never the plan's 100-odd steps; right after planning it is the plan's."""
    from finetuner.planning.planner import plan
    from finetuner.units import duration_text
    from finetuner.planning.predict import estimate_time

    from ui.recipe_text import fields_of

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    out = h.on_plan(MODEL, "cpu", SAMPLE, 0, 0, "auto", "sft", "", 2, 16)
    text, planned = out[4], out[-1]
    p = plan(MODEL, "cpu", data=SAMPLE, runs_dir=h.runs)
    shown = h.on_recipe_text(text, planned, "cpu")
    assert f"**Time:** ~{p.tokens_per_s:,.0f} tokens/s, {duration_text(p.step_s)} per optimizer step, " \
           f"{p.optimizer_steps:,} optimizer steps" in shown, shown
    recipe = Recipe.from_yaml_text(text, source="recipe")
    fields = list(fields_of(recipe))
    fields[7] = 6  # max steps
    *_, edited, _dl, _error = h.on_edit(text, "cpu", *fields)
    six = estimate_time(Recipe.from_yaml_text(edited, source="recipe"), "cpu")
    assert six["optimizer_steps"] == 6
    (line,) = [x for x in h.on_recipe_text(edited, planned, "cpu").splitlines() if x.startswith("**Time:**")]
    assert f"6 optimizer steps: ~{duration_text(six['steps_s'])}; the whole run ~{duration_text(six['wall_s'])}" in line
    assert f"{p.optimizer_steps:,}" not in line
    assert "6 optimizer steps" in h.on_check_yaml(edited, "cpu")[-1]
    # without a card (an older page) the plan's time is shown only while the recipe is timed as planned
    assert "**Time:**" not in views.recipe_md(Recipe.from_yaml_text(edited, source="recipe"), planned)


def test_the_train_tab_reports_to_the_trackers_ticked_and_says_where_the_run_is(tmp_path, monkeypatch):
    """W&B ticked in the Train tab (offline): the recipe in the editor reports to it, the run started from it
    writes its W&B run files, and the Train tab names the folder ``wandb sync`` uploads (tracking.json's)."""
    pytest.importorskip("wandb")
    from finetuner.tracking.report import tracked_at
    from ui.recipe_text import fields_of

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    text = h.on_plan(MODEL, "cpu", SAMPLE, 0, 0, "auto", "sft", "", 2, 16)[4]
    recipe = Recipe.from_yaml_text(text, source="recipe")
    fields = list(fields_of(recipe))
    assert fields[-1] == ["tensorboard"]  # the recipe's default
    fields[1], fields[2], fields[7], fields[-1] = 1, 1, 2, ["wandb"]  # micro-batch, accumulation, max steps, trackers
    *_, edited, _dl, error = h.on_edit(text, "cpu", *fields)
    assert error == "" and Recipe.from_yaml_text(edited, source="recipe").logging.trackers == ["wandb"]
    h.on_start(edited, "cpu", SAMPLE, False)
    wait_until_done(h.runs, recipe.name)
    where = tracked_at(h.runs / recipe.name)
    (folder,) = (h.runs / recipe.name / "wandb").glob("offline-run-*")
    assert where == {"wandb": str(folder)} and not (h.runs / recipe.name / "tensorboard").exists()
    status = h.train_view(recipe.name)[0]
    assert "finished" in status and f"wandb: <code>{folder}</code>" in status, status

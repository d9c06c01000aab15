"""Every path box of the web UI obeys one scope, through the app served over HTTP (``gradio_client``), as whoever
reaches the page meets it (issue 66): served to other machines, the Model, Rewards and recipe boxes, the recipe editor
and Resume read only inside the UI's folders, and the Export tab writes only in its runs folder, each with one refusal
whatever is at the path; and on every host, reward code runs only from a ``.py`` file the page did not send, inside
those folders, with "Allow the model's own code to run" ticked. A reward file that would run writes a marker file at
import: the marker says whether anything ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetuner.config.recipe import Recipe
from tests.conftest import ui_client, wait_until_done

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "data" / "demo_model")
SAMPLE = "data/alpaca_sample.json"
#: what every page says of a reward file it does not run (but for the file's name)
NOT_RUN = "is not a Python file this UI runs: it runs reward code only from a .py file of this machine"
TICK = "Tick “Allow the model's own code to run” to confirm"


def reward_code(marker: Path) -> str:
    """A reward file that writes ``marker`` when it is imported (what any code in it could do instead)."""
    return (f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\n"
            "def reward(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``finetuner ui --data-dir MINE`` (the folders of ``--host 0.0.0.0`` and ``mine``) served over HTTP; outside
    every folder of the UI: ``evil.py`` (a reward that writes ``ran-outside`` on import), a model folder, a plain
    folder; in ``mine``: ``good.py`` (the same reward, writing ``ran-inside``) and a link to ``evil.py``."""
    base = tmp_path_factory.mktemp("ui_scope")
    mine, outside = base / "mine", base / "outside"
    mine.mkdir()
    (outside / "model").mkdir(parents=True)
    (outside / "folder").mkdir()
    (outside / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    (outside / "evil.py").write_text(reward_code(base / "ran-outside"), encoding="utf-8")
    (mine / "good.py").write_text(reward_code(base / "ran-inside"), encoding="utf-8")
    (mine / "link.py").symlink_to(outside / "evil.py")
    with ui_client(base, data_dirs=[mine]) as c:
        c.mine, c.outside = mine, outside
        yield c


def plan_grpo(client, rewards: str, model: str = MODEL) -> tuple[str, str]:
    """The Plan tab's plan for objective grpo with the Rewards box ``rewards``: its headline and the recipe."""
    out = client.predict(model, "cpu", SAMPLE, 0, 0, "auto", "grpo", rewards, 2, 8, api_name="/plan")
    return out[0], out[4]


def short_grpo(text: str, reward_file: str) -> str:
    """The planned GRPO recipe ``text``, one step long, its reward read from ``reward_file``."""
    raw = yaml.safe_load(text)
    raw["grpo"]["rewards"] = [{"function": "reward", "file": reward_file}]
    raw.setdefault("training", {}).update(max_steps=1, micro_batch_size=2, gradient_accumulation=1)
    return yaml.safe_dump(raw, sort_keys=False)


def started_runs(client) -> list[str]:
    return [p.name for p in (client.base / "runs").iterdir() if not p.name.startswith(".")]


def upload(client, folder: Path, name: str, text: str) -> str:
    """``text`` uploaded as ``name`` through the Data tab's upload; the path the UI stored it at."""
    from gradio_client import handle_file

    src = folder / name
    src.write_text(text, encoding="utf-8")
    update, _ = client.predict(handle_file(str(src)), api_name="/upload_data")
    return update["value"]


def test_a_reward_file_outside_a_served_uis_folders_is_refused_and_never_run(served):
    """The Rewards box, the recipe editor and Start, for a ``.py`` outside the UI's folders (there, missing, a folder,
    a link in a folder of the UI to it): one refusal whatever is there, and Start, code box ticked, starts nothing and
    runs nothing."""
    outside = served.outside
    typed = [str(outside / "evil.py"), str(outside / "missing.py"), str(outside / "folder"), str(served.mine / "link.py"),
             "../" * 12 + str(outside / "evil.py").lstrip("/")]
    shown = {plan_grpo(served, f"{name}:reward")[0].replace(name, "NAME") for name in typed}
    assert len(shown) == 1, shown
    (text,) = shown
    assert "✕ reward 'reward' NAME: this UI reads reward files only from data, " in text and str(served.mine) in text, text
    _head, good = plan_grpo(served, f"{served.mine / 'good.py'}:reward")
    before = started_runs(served)
    for name in typed:
        edited = short_grpo(good, name)
        checked = served.predict(edited, "cpu", api_name="/estimate")[-1]
        assert f"recipe: grpo.rewards[0].file {name}: this UI reads reward files only from" in checked, checked
        _pick, _table, msg = served.predict(edited, "cpu", SAMPLE, True, True, api_name="/start_training")
        assert msg.startswith('<div class="ft-error"') and "this UI reads reward files only from" in msg, msg
    assert started_runs(served) == before and not (served.base / "ran-outside").exists()


def test_an_uploaded_file_is_never_run_as_a_reward_code_box_ticked_or_not(served, tmp_path):
    """A ``.jsonl`` of Python uploaded through the Data tab, named as the reward: refused in the Rewards box and at
    Start with "Allow the model's own code to run" ticked; nothing starts, nothing runs."""
    stored = upload(served, tmp_path, "rewards.jsonl", reward_code(served.base / "ran-upload"))
    head, _text = plan_grpo(served, f"{stored}:reward")
    assert f"✕ reward 'reward': {stored} {NOT_RUN} in data, " in head and "never from an upload" in head, head
    _head, good = plan_grpo(served, f"{served.mine / 'good.py'}:reward")
    before = started_runs(served)
    _pick, _table, msg = served.predict(short_grpo(good, stored), "cpu", SAMPLE, True, True, api_name="/start_training")
    assert f"Not started: grpo.rewards[0] (reward): {stored} {NOT_RUN}" in msg, msg
    assert started_runs(served) == before and not (served.base / "ran-upload").exists()


def test_an_upload_is_never_run_as_a_reward_on_the_loopback_ui_either(tmp_path):
    """The UI on 127.0.0.1 (no --data-dir: it reads any file of yours), as another local user reaches it: a
    ``.jsonl`` of Python uploaded through the Data tab, and a ``.py`` sent to gradio's own upload route (its path is
    in the reply), named as the reward, are refused with the code box ticked; a ``.py`` of this machine still needs it
    ticked. Nothing starts, nothing runs."""
    import httpx

    with ui_client(tmp_path) as c:
        stored = upload(c, tmp_path, "rewards.jsonl", reward_code(tmp_path / "ran-upload"))
        sent = tmp_path / "sent.py"
        sent.write_text(reward_code(tmp_path / "ran-sent"), encoding="utf-8")
        with sent.open("rb") as f:
            cached = httpx.post(f"{c.src}gradio_api/upload", files={"files": ("sent.py", f)}).json()[0]
        _head, good = plan_grpo(c, "recipes/rewards_demo.py:mentions_whistle")
        for name in (stored, cached):
            head, _text = plan_grpo(c, f"{name}:reward")
            assert f"✕ reward 'reward': {name} {NOT_RUN}, never from an upload." in head, head
            _pick, _table, msg = c.predict(short_grpo(good, name), "cpu", SAMPLE, True, True, api_name="/start_training")
            assert f"Not started: grpo.rewards[0] (reward): {name} {NOT_RUN}" in msg, msg
        mine = tmp_path / "own.py"
        mine.write_text(reward_code(tmp_path / "ran-own"), encoding="utf-8")
        _pick, _table, msg = c.predict(short_grpo(good, str(mine)), "cpu", SAMPLE, True, False, api_name="/start_training")
        assert "Not started: the recipe's rewards run Python code on this machine while it trains" in msg and TICK in msg
        assert started_runs(c) == [] and not any((tmp_path / f"ran-{w}").exists() for w in ("upload", "sent", "own"))


def test_a_reward_file_inside_the_uis_folders_runs_only_with_the_code_box_ticked(served):
    """A ``.py`` in a folder of the served UI: planned on; Start with the code box unticked is refused, naming the box,
    and runs nothing; ticked, the run trains with it (the marker is written by the training process)."""
    head, text = plan_grpo(served, f"{served.mine / 'good.py'}:reward")
    assert head.startswith("### GRPO · LORA"), head
    edited = short_grpo(text, str(served.mine / "good.py"))
    before = started_runs(served)
    _pick, _table, msg = served.predict(edited, "cpu", SAMPLE, True, False, api_name="/start_training")
    assert "Not started: the recipe's rewards run Python code on this machine while it trains" in msg and TICK in msg, msg
    assert started_runs(served) == before and not (served.base / "ran-inside").exists()
    _pick, _table, msg = served.predict(edited, "cpu", SAMPLE, True, True, api_name="/start_training")
    name = yaml.safe_load(edited)["name"]
    assert msg.startswith(f"✓ Training started: **{name}**"), msg
    st = wait_until_done(served.base / "runs", name)
    assert st.state == "done" and st.objective == "grpo" and (served.base / "ran-inside").read_text() == "ran"


def test_resume_refuses_a_runs_reward_file_outside_the_folders_or_unconfirmed(served, monkeypatch):
    """Resume reads the run's own recipe.yaml: a reward file outside the UI's folders is refused with the code box
    ticked; one inside them needs it ticked. Nothing is started, nothing runs."""
    from finetuner.runs.jobs import RunStatus
    from ui import handlers as ui_handlers

    runs = served.base / "runs"
    for name, reward in (("far", served.outside / "evil.py"), ("near", served.mine / "good.py")):
        recipe = Recipe.from_dict({"name": name, "model": {"name": MODEL}, "objective": "grpo",
                                   "data": {"path": str(REPO / SAMPLE), "max_seq_len": 64}, "training": {"max_steps": 2},
                                   "grpo": {"rewards": [{"function": "reward", "file": str(reward)}], "num_generations": 2,
                                            "max_new_tokens": 8}})
        (runs / name / "checkpoints" / "step-00000001").mkdir(parents=True)  # a run stopped after its first step
        recipe.save(runs / name / "recipe.yaml")
    monkeypatch.setattr(ui_handlers.jobs, "run_status", lambda d, *a, **k: RunStatus(str(d), Path(d).name, "stopped",
                                                                                        step=1, max_steps=2))
    started = []
    monkeypatch.setattr(ui_handlers.jobs, "start_job", lambda *a, **k: started.append(k))
    _pick, _table, far = served.predict("far", True, api_name="/resume_training")
    assert f"far not resumed: grpo.rewards[0] (reward): {served.outside / 'evil.py'} {NOT_RUN}" in far, far
    _pick, _table, near = served.predict("near", False, api_name="/resume_training")
    assert "near: its recipe.yaml names reward functions in" in near and "Allow the model's own code to run" in near
    assert started == [] and not (served.base / "ran-outside").exists()


def test_the_model_box_is_one_refusal_outside_a_served_uis_folders(served):
    """The Model box (the Data tab and the plan read it): a model folder outside the UI's folders, a missing one, a
    plain folder, a file: one text but for the name typed (where the command line lists near matches); a model of the
    UI's folders and a preset still work."""
    outside = served.outside
    typed = [str(outside / "model"), str(outside / "no-model"), str(outside / "folder"), str(outside / "evil.py"),
             str(outside / "model" / "config.json"), "../" * 12 + str(outside / "model").lstrip("/"), "data/../../model"]
    pages = {served.predict(name, SAMPLE, 64, api_name="/analyse_data")[0].replace(name, "NAME") for name in typed}
    assert pages == {'<div class="ft-error" role="alert">✕ Model NAME: this UI reads models only from data, '
                     f'{served.base / "uploads"}, {served.base / "runs"}, {served.mine}.\nPut it in data/, or start the UI '
                     'with --data-dir FOLDER for a folder of yours (finetuner ui --help).</div>'}, pages
    plans = {served.predict(name, "cpu", SAMPLE, 64, 0, "auto", "auto", api_name="/plan")[0].replace(name, "NAME")
             for name in typed}
    assert plans == pages
    assert "this UI reads" not in served.predict(MODEL, SAMPLE, 64, api_name="/analyse_data")[0]
    edited = yaml.safe_load(served.predict(MODEL, "cpu", SAMPLE, 64, 0, "auto", "auto", api_name="/plan")[4])
    for name in typed[:2]:  # the recipe editor names the model the same way
        edited["model"]["name"] = name
        checked = served.predict(yaml.safe_dump(edited), "cpu", api_name="/estimate")[-1]
        assert f"recipe: model.name {name}: this UI reads models only from" in checked, checked
    edited["model"]["name"] = "llama-2-7b"  # a preset: planned on as ever
    assert "✓ The recipe is valid" in served.predict(yaml.safe_dump(edited), "cpu", api_name="/estimate")[-1]


def test_export_outputs_of_a_served_ui_are_written_only_in_its_runs_folder(served):
    """Merge and GGUF export to a folder outside the served UI's runs folder (new, existing, relative with ``..``):
    one refusal whatever is there, and nothing is created."""
    run = served.base / "runs" / "finished"
    run.mkdir(parents=True)
    Recipe.from_dict({"name": "finished", "model": {"name": MODEL}, "data": {"path": str(REPO / SAMPLE)}}).save(
        run / "recipe.yaml")
    targets = [str(served.outside / "merged"), str(served.outside / "folder"), str(served.mine / "merged"),
               "../" * 12 + str(served.outside / "up").lstrip("/")]
    merged = {served.predict("finished", name, "auto", False, False, api_name="/merge").replace(name, "NAME")
              for name in targets}
    runs = served.base / "runs"
    assert merged == {f'<div class="ft-error" role="alert">✕ Output folder NAME: this UI writes exports only in {runs}.\n'
                      f'Leave the box empty to write into the run\'s folder, or name a folder in {runs}.</div>'}, merged
    ggufs = {served.predict("finished", "gguf", "f16", name, False, False, api_name="/export_gguf").replace(name, "NAME")
             for name in [*targets, str(served.outside / "model.gguf")]}
    assert ggufs == {m.replace("Output folder", "Output file or folder") for m in merged}, ggufs
    assert sorted(p.name for p in served.outside.iterdir()) == ["evil.py", "folder", "model"]
    assert not (served.mine / "merged").exists() and list((served.outside / "folder").iterdir()) == []


def test_the_jobs_a_served_ui_starts_never_import_a_reward_file_it_refuses(served, tmp_path, monkeypatch):
    """What the check before starting does not see (a recipe.yaml changed since), the training process refuses itself:
    within the scope the UI hands its jobs (finetuner.data.scope.ENV) the reward loader takes only a ``.py`` file
    inside the UI's folders that the page did not send, before anything in the file runs."""
    from finetuner.data import scope
    from finetuner.errors import UserError
    from finetuner.objectives.grpo import reward_functions
    from finetuner.objectives.specs.grpo import RewardSection

    from ui.handlers import Handlers

    stored = upload(served, tmp_path, "job_rewards.jsonl", reward_code(served.base / "ran-job"))
    h = Handlers(served.base / "runs", served.base / "uploads", data_dirs=[served.mine])  # the served UI's folders
    monkeypatch.setenv(scope.ENV, h.scope.to_env())  # what a job the served UI starts finds in its environment
    for name in (stored, str(served.outside / "evil.py"), str(served.mine / "link.py")):
        with pytest.raises(UserError, match=f"grpo.rewards\\[0\\]: the reward file: {name} is not a Python file this UI runs"):
            reward_functions([RewardSection(function="reward", file=name)])
    assert not (served.base / "ran-job").exists() and not (served.base / "ran-outside").exists()


def test_the_recipe_box_reads_a_served_uis_folders_and_the_shipped_recipes_only(served):
    """The Plan tab's recipe box (gradio takes only its listed choices over HTTP; the handler checks what it gets too):
    a recipe outside the UI's folders, there or missing, is one refusal; one inside them that names a model outside is
    refused as the editor refuses it, before anything looks at the model; a shipped recipe loads as ever."""
    from ui.handlers import Handlers

    h = Handlers(served.base / "runs", served.base / "uploads", data_dirs=[served.mine])
    (served.outside / "r.yaml").write_text((REPO / "recipes" / "demo_cpu.yaml").read_text(), encoding="utf-8")
    shown = {h.on_load_recipe(name, "cpu")[-1].replace(name, "NAME")
             for name in (str(served.outside / "r.yaml"), str(served.outside / "none.yaml"), str(served.outside))}
    assert len(shown) == 1 and "✕ Recipe NAME: this UI reads recipes only from data, " in shown.pop()
    raw = yaml.safe_load((REPO / "recipes" / "demo_cpu.yaml").read_text())
    raw["model"]["name"] = str(served.outside / "no-model")
    (served.mine / "far.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    far = h.on_load_recipe(str(served.mine / "far.yaml"), "cpu")[-1]
    assert f"model.name {served.outside / 'no-model'}: this UI reads models only from" in far, far
    assert "✓ The recipe is valid" in h.on_load_recipe("recipes/demo_cpu.yaml", "cpu")[-1]

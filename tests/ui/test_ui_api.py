"""The web UI's glue without a browser: training jobs (finetuner.runs.jobs), paths and uploads, the
views, ``finetuner ui`` itself, and the app's API endpoints through ``gradio_client``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import demo_run_folder, free_port, ui_client, HANG_GUARD_S
from finetuner.runs import jobs
from finetuner.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def _wait(cond, timeout: float = HANG_GUARD_S, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


@pytest.fixture
def long_recipe(recipe_dict, tmp_path):
    """The tiny recipe with enough steps to stop it in the middle."""
    from finetuner.config.recipe import Recipe

    r = dict(recipe_dict)
    r["training"] = dict(r["training"], max_steps=40)
    r["checkpointing"] = {"save_every": 1000, "keep_last": 2}
    r["logging"] = {"tensorboard": False, "every": 1}
    r.pop("output_dir")
    return Recipe.from_dict(r)


# --------------------------------------------------------------------------- jobs
def test_job_start_refuse_second_stop_checkpoint_resume_list(long_recipe, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    gate = tmp_path / "hold-gate"  # the run holds after step 2 until stopped: mid-run on any machine
    gate.touch()
    monkeypatch.setenv("FINETUNER_FAULT", "HOLD@2")
    monkeypatch.setenv("FINETUNER_HOLD_FILE", str(gate))
    job = jobs.start_job(long_recipe, runs_dir=runs)
    assert Path(job.run_dir).parent == runs.resolve() and (Path(job.run_dir) / "recipe.yaml").is_file()
    with pytest.raises(UserError, match=rf"already running.*{job.name}.*pid {job.pid}"):
        jobs.start_job(long_recipe, runs_dir=runs)
    assert [j.pid for j in jobs.running_jobs(runs)] == [job.pid]
    _wait(lambda: jobs.run_status(job.run_dir, runs).step >= 2)
    st = jobs.run_status(job.run_dir, runs)
    assert st.running and st.state == "running" and st.max_steps == 40 and st.losses

    assert jobs.stop_job(job, runs, wait=120)
    assert jobs.exit_code(job.pid) == 130  # the CLI's status for "stopped with a checkpoint"
    st = jobs.run_status(job.run_dir, runs)
    assert st.state == "stopped" and not st.running and st.has_checkpoint and st.resumable
    stopped_at = st.step
    assert stopped_at == 2  # the stop ended the hold; the run saved its checkpoint at once
    assert jobs.running_jobs(runs) == []
    assert jobs.stop_job(job, runs) is False  # nothing to stop any more
    gate.unlink()

    again = jobs.start_job(None, run_dir=job.run_dir, runs_dir=runs)  # resume the same folder
    assert jobs.wait_job(again, 300)
    assert jobs.exit_code(again.pid) == 0
    st = jobs.run_status(job.run_dir, runs)
    assert st.state == "done" and st.step == 40 and st.has_adapter and not st.resumable
    assert f"resumed from step {stopped_at}" in st.notes
    assert [s for s, _ in st.losses] == sorted({s for s, _ in st.losses})  # one point per step
    assert st.losses[-1][0] == 40 and st.metrics["steps"] == 40
    listed = jobs.list_runs(runs)
    assert [(r.name, r.state) for r in listed] == [(job.name, "done")]
    assert (Path(job.run_dir) / "train.log").is_file()


def test_failed_run_reports_the_engine_error(recipe_dict, tmp_path):
    from finetuner.config.recipe import Recipe

    r = dict(recipe_dict)
    r.pop("output_dir")
    data = tmp_path / "gone.jsonl"
    data.write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    r["data"] = dict(r["data"], path=str(data))
    recipe = Recipe.from_dict(r)
    data.write_text('{"no format": 1}\n')  # broken after the UI checked the recipe
    job = jobs.start_job(recipe, runs_dir=tmp_path / "runs")
    assert jobs.wait_job(job, 180)
    assert jobs.exit_code(job.pid) == 2
    st = jobs.run_status(job.run_dir, tmp_path / "runs")
    assert st.state == "error" and "cannot tell the data format" in st.error and "Traceback" not in st.error


@pytest.mark.parametrize("case", ["model folder without config.json", "the same under the multi-process launcher"])
def test_a_run_that_fails_before_training_ends_with_an_error_event(recipe_dict, tiny_model_dir, tmp_path, case):
    """A job that fails before its trainer exists (the planner, resolving an ``auto`` value, finds no
    config.json, in one process or in the launcher of several) records the error in its
    events.jsonl, and the job's status reads it from there (train.log is for people)."""
    import shutil

    from finetuner.config.recipe import Recipe
    from finetuner.runs.events import read_events
    from finetuner.runs.schema import validate_event

    r = dict(recipe_dict)
    r.pop("output_dir")
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    r["model"] = {"name": str(model)}
    r["training"] = dict(r["training"], micro_batch_size="auto")  # the planner reads the model's shape
    if case == "the same under the multi-process launcher":
        r["distributed"] = {"num_processes": 2, "strategy": "ddp"}
    recipe = Recipe.from_dict(r)
    (model / "config.json").unlink()  # gone after the UI checked the recipe
    expected = "no config.json"
    job = jobs.start_job(recipe, runs_dir=tmp_path / "runs")
    assert jobs.wait_job(job, 180)
    assert jobs.exit_code(job.pid) == 2
    events = read_events(Path(job.run_dir) / "events.jsonl")
    assert [e["event"] for e in events] == ["error"], events
    error = events[-1]
    assert validate_event(error) == [] and error["user_error"] is True and expected in error["message"]
    (Path(job.run_dir) / "train.log").write_text("error: not what the status shows\n")  # the log is not read
    st = jobs.run_status(job.run_dir, tmp_path / "runs")
    assert st.state == "error" and st.error == error["message"]


def test_a_job_refused_its_folder_reports_the_error_without_writing_into_the_run(recipe_dict, tmp_path):
    """Another process holds the run folder when the job resumes it: nothing is written into the
    run's events (they are that process's), and the job's status still shows why it ended, from the
    job's report (the worker protocol), not from its log."""
    from finetuner.config.recipe import Recipe
    from finetuner.runs.folder import RunLock
    from finetuner.run_marker import mark_run_folder

    run = tmp_path / "runs" / "held"
    run.mkdir(parents=True)
    mark_run_folder(run)
    r = dict(recipe_dict)
    r.pop("output_dir")
    Recipe.from_dict(r).save(run / "recipe.yaml")
    lock = RunLock(run).acquire()  # e.g. `finetuner run` in a terminal, still loading
    try:
        job = jobs.start_job(None, run_dir=run, runs_dir=tmp_path / "runs")
        assert jobs.wait_job(job, 180)
        assert jobs.exit_code(job.pid) == 2
    finally:
        lock.release()
    assert not (run / "events.jsonl").exists()
    (run / "train.log").write_text("error: not what the status shows\n")
    st = jobs.run_status(run, tmp_path / "runs")
    assert st.state == "error" and st.error.startswith("Another finetuner process") and "is using the run folder" in st.error


def test_run_status_from_events(tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    events = [
        {"event": "start", "max_steps": 6, "device": "cpu", "method": "lora", "predicted": {"allocated_bytes": 100}},
        {"event": "step", "step": 1, "max_steps": 6, "loss": 3.0, "eta_s": 5, "tokens_per_s": 10, "mem_peak": 50},
        {"event": "step", "step": 2, "max_steps": 6, "loss": 2.5, "eta_s": 4, "tokens_per_s": 12, "mem_peak": 70},
        {"event": "eval", "step": 2, "eval_loss": 2.7},
        # killed after step 3; resumed from the checkpoint at 2: step 3 again
        {"event": "step", "step": 3, "max_steps": 6, "loss": 2.4, "mem_peak": 60},
        {"event": "start", "max_steps": 6, "resumed_from_step": 2, "device": "cpu"},
        {"event": "step", "step": 3, "max_steps": 6, "loss": 2.3, "eta_s": 3, "mem_peak": 60},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "st')
    st = jobs.run_status(run)
    assert st.state == "interrupted" and st.step == 3 and st.max_steps == 6 and st.progress == 0.5
    assert st.losses == [(1, 3.0), (2, 2.5), (3, 2.3)] and st.evals == [(2, 2.7)]
    assert st.measured_peak_bytes == 70 and st.notes == ["resumed from step 2"]
    with open(run / "events.jsonl", "a") as f:
        f.write('ep"}\n' + json.dumps({"event": "error", "message": "CUDA out of memory", "type": "OutOfMemory"}) + "\n")
    st = jobs.run_status(run)
    assert st.state == "error" and st.error == "CUDA out of memory"


def test_run_status_reads_a_preference_runs_rewards(tmp_path):
    run = tmp_path / "runs" / "dpo"
    run.mkdir(parents=True)
    events = [
        {"event": "start", "max_steps": 4, "device": "cpu", "method": "lora", "objective": "dpo"},
        {"event": "step", "step": 1, "loss": 0.69, "reward_accuracy": 0.5, "reward_margin": 0.0, "reward_chosen": 0.0},
        {"event": "step", "step": 2, "loss": 0.6, "reward_accuracy": 0.75, "reward_margin": None, "reward_chosen": "inf"},
        {"event": "eval", "step": 2, "eval_loss": 0.65, "eval_reward_accuracy": 0.6, "eval_reward_margin": 0.1},
        # resumed from step 1: step 2 again
        {"event": "start", "max_steps": 4, "resumed_from_step": 1, "device": "cpu", "objective": "dpo"},
        {"event": "step", "step": 2, "loss": 0.55, "reward_accuracy": 0.875, "reward_margin": 0.2},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    st = jobs.run_status(run)
    assert st.objective == "dpo" and st.losses == [(1, 0.69), (2, 0.55)]
    assert st.rewards == {"reward_accuracy": [(1, 0.5), (2, 0.875)], "reward_margin": [(1, 0.0), (2, 0.2)],
                          "reward_chosen": [(1, 0.0)],  # not finite (null, "inf"): left out
                          "eval_reward_accuracy": [(2, 0.6)], "eval_reward_margin": [(2, 0.1)]}
    old = tmp_path / "runs" / "old"
    old.mkdir()
    (old / "events.jsonl").write_text(json.dumps({"event": "start", "max_steps": 4}) + "\n")  # from before objective was written
    assert (jobs.run_status(old).objective, jobs.run_status(old).rewards) == ("sft", {})


def test_registry_drops_dead_jobs_and_devices(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (runs / jobs.REGISTRY).write_text(json.dumps([{"pid": dead.pid, "run_dir": "x", "name": "x", "device": "cpu",
                                                    "started": 0, "log": "x"}]))
    assert jobs.running_jobs(runs) == []
    assert json.loads((runs / jobs.REGISTRY).read_text()) == []
    assert jobs._devices_clash("cpu", "cpu") and jobs._devices_clash("auto", "cuda:0")
    assert not jobs._devices_clash("cuda:0", "cuda:1") and not jobs._devices_clash("cpu", "cuda:0")


def test_new_run_dir_never_reuses(tmp_path):
    a = jobs.new_run_dir(tmp_path, "my run/../x")
    assert a.parent == tmp_path and "/" not in a.name and ".." not in a.name
    a.mkdir()
    assert jobs.new_run_dir(tmp_path, "my run/../x") != a


def test_run_names_are_kept_as_typed_and_never_reused(tmp_path):
    assert jobs.named_run_dir(tmp_path, "my-run") == tmp_path / "my-run"
    assert jobs.free_run_name(tmp_path, "my-run") == "my-run"
    (tmp_path / "my-run").mkdir()
    with pytest.raises(UserError, match="A run named 'my-run' already exists") as e:
        jobs.named_run_dir(tmp_path, "my-run")
    assert "my-run-2" in e.value.hint  # the hint proposes a free name; nothing is renamed
    assert jobs.free_run_name(tmp_path, "my-run") == "my-run-2"
    (tmp_path / "my-run-2").mkdir()
    assert jobs.free_run_name(tmp_path, "my-run") == "my-run-3"


# --------------------------------------------------------------------------- paths, views, CLI
def test_upload_names_are_sanitised_and_stay_in_the_folder(tmp_path):
    from ui.paths import sanitize_filename, save_upload

    assert sanitize_filename("../../etc/passwd.jsonl") == "passwd.jsonl"
    assert sanitize_filename("..\\..\\evil name!.JSON") == "evil_name.json"
    assert sanitize_filename(".hidden.csv") == "hidden.csv"
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hi"}\n')
    dest_dir = tmp_path / "uploads"
    a, new = save_upload(src, "../../a b.jsonl", dest_dir)
    assert new and a.parent == dest_dir and a.name == "a_b.jsonl" and a.read_bytes() == src.read_bytes()
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "ho"}\n')  # the same size, another content, the same name
    b, new = save_upload(other, "../../a b.jsonl", dest_dir)
    assert new and b.name == "a_b-2.jsonl" and a.read_text() == '{"text": "hi"}\n'  # nothing overwritten
    with pytest.raises(UserError, match="not a data file"):
        save_upload(src, "run.sh", dest_dir)


def test_the_same_upload_is_one_file(tmp_path):
    from ui.paths import data_files, save_upload

    src = tmp_path / "mine.jsonl"
    src.write_text('{"text": "Tern here."}\n')
    dest_dir = tmp_path / "uploads"
    first, new = save_upload(src, "mine.jsonl", dest_dir)
    assert new
    for name in ("mine.jsonl", "renamed copy.jsonl"):  # the same bytes again, under any name
        again, new = save_upload(src, name, dest_dir)
        assert again == first and not new
    assert sorted(p.name for p in dest_dir.iterdir()) == ["mine.jsonl"]
    # uploads are listed with the shipped data, wherever the upload folder is
    listed = data_files(dest_dir)
    assert str(first) in listed and "data/alpaca_sample.json" in listed


def test_paths_do_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    from ui import paths

    monkeypatch.chdir(tmp_path)
    assert "data/alpaca_sample.json" in paths.data_files()
    assert "data/demo_model" in paths.local_models()
    assert paths.resolve_model("data/demo_model") == str(REPO / "data" / "demo_model")
    assert paths.resolve_model("llama-2-7b") == "llama-2-7b"
    assert "recipes/demo_cpu.yaml" in paths.recipe_files()


def test_views_histogram_against_seq_len_and_memory():
    from finetuner.data.stats import DataProfile
    from finetuner.planning.predict import estimate_recipe
    from ui import views

    prof = DataProfile("x", "alpaca", 4, [10, 50, 90, 300], 100, 450, "test")
    df = views.histogram_df(prof, seq_len=100, bins=10)
    assert df["examples"].sum() == 4
    assert set(df["fits"]) == {"fits", "partly cut", "cut"}  # bins are 30 wide: 90-120 straddles 100
    assert df.iloc[-1]["fits"] == "cut" and df.iloc[0]["fits"] == "fits"
    est = estimate_recipe(str(REPO / "recipes" / "7b_4090.yaml"), "rtx4090")
    mem = views.memory_df(est)
    assert abs(mem[mem.kind == "component"]["GiB"].sum() - est.total_bytes / 2**30) < 0.01
    assert list(mem.kind[-2:]) == ["predicted peak", "card budget (95 %)"]
    assert "Fits" in views.estimate_md(est, __import__("finetuner.config.hardware").config.hardware.get_gpu("rtx4090"))


def test_cli_ui_auth_and_exposure_warning(tmp_path):
    from finetuner.cli.ui import exposed_without_auth, parse_auth

    assert parse_auth("alice:s3:cret", "--auth-file f") == ("alice", "s3:cret")
    with pytest.raises(UserError):
        parse_auth("alice", "--auth-file f")
    assert exposed_without_auth("0.0.0.0", None) and not exposed_without_auth("0.0.0.0", ("a", "b"))
    assert not exposed_without_auth("127.0.0.1", None)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetuner", "ui", "--host", "0.0.0.0", "--port", str(port), "--runs-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=dict(os.environ, GRADIO_ANALYTICS_ENABLED="False"),
    )
    try:
        line = proc.stderr.readline()
        assert line.startswith("warning: listening on 0.0.0.0 without --auth-file: a browser on another machine "
                               "needs the token in the address below")
        address = proc.stdout.readline()  # served to other machines: the address holds the token they need
        assert address.startswith(f"finetuner UI on http://127.0.0.1:{port}/?token=")
        assert "other users of this machine are refused" in address
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_GUARD_S)


# --------------------------------------------------------------------------- the app's endpoints
@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with ui_client(tmp_path_factory.mktemp("ui_api")) as c:
        yield c


def test_api_analyse_data_shows_format_preview_and_lengths(client):
    summary, shown, hist, pairs = client.predict("data/demo_model", "data/chat_sample.jsonl", 256, api_name="/analyse_data")
    assert (shown["visible"], pairs["visible"], pairs["value"]) == (True, False, "")  # tokens shown, no pairs
    preview = shown["value"]
    assert "chat" in summary and "every example fits in 256 tokens" in summary
    labels = {item["class_or_confidence"] for item in preview if item.get("class_or_confidence")}
    assert labels == {"trained", "masked"}
    trained = "".join(i["token"] for i in preview if i.get("class_or_confidence") == "trained")
    assert "Tern" in trained and "<|im_start|>user" not in trained  # replies trained, prompts masked
    assert sum(row[1] for row in hist["value"]["data"]) > 0 and hist["sort"][0].startswith("0–")


def test_api_preference_pairs_side_by_side_and_a_dpo_plan(client):
    summary, shown, hist, pairs = client.predict("data/demo_model", "data/preference_sample.jsonl", 256, api_name="/analyse_data")
    assert "**400** pairs" in summary and "Fits objective dpo, orpo or simpo" in summary
    assert shown["visible"] is False and pairs["visible"] is True and "<th>chosen ✓</th><th>rejected ✕</th>" in pairs["value"]
    out = client.predict("data/demo_model", "cpu", "data/preference_sample.jsonl", 128, 0, "auto", "orpo", api_name="/plan")
    assert out[0].startswith("### ORPO · LORA") and yaml.safe_load(out[4])["objective"] == "orpo"


def test_api_plan_for_the_tiny_model_on_cpu(client):
    out = client.predict("data/demo_model", "cpu", "data/alpaca_sample.json", 256, 16, "auto", "auto", api_name="/plan")
    plan_md, _plot, est_md, _rejected, recipe_text = out[:5]
    assert "LORA" in plan_md and "Why" in plan_md and "Fits" in est_md
    recipe = yaml.safe_load(recipe_text)
    assert recipe["model"]["name"] == str(REPO / "data" / "demo_model") and recipe["data"]["max_seq_len"] == 256


def test_api_plan_for_grpo_with_a_reward_file_of_the_checkout(client):
    out = client.predict("data/demo_model", "cpu", "data/alpaca_sample.json", 0, 0, "auto", "grpo",
                         "recipes/rewards_demo.py:mentions_whistle", 2, 16, api_name="/plan")
    assert out[0].startswith("### GRPO · LORA") and "GRPO room on this choice: 2 generations of up to 16 new tokens" in out[0]
    grpo = yaml.safe_load(out[4])["grpo"]
    assert grpo["rewards"] == [{"function": "mentions_whistle", "file": str(REPO / "recipes" / "rewards_demo.py")}]
    assert (grpo["num_generations"], grpo["max_new_tokens"]) == (2, 16)


def test_api_estimate_warns_before_a_recipe_that_does_not_fit(client):
    text = yaml.safe_dump({"model": {"name": "llama-2-13b"}, "method": "lora",
                           "data": {"path": "data/alpaca_sample.json", "max_seq_len": 4096},
                           "training": {"micro_batch_size": 8}})
    _plot, est_md, _dl, *fields, checked = client.predict(text, "rtx3060", api_name="/estimate")
    assert "Does not fit" in est_md and fields[1] == 8
    assert "✓ The recipe is valid" in checked and "does **not** fit" in checked  # "Check" says what it found


def test_api_a_bad_yaml_key_is_one_message_and_the_fields_stay(client):
    text = "model: {name: data/demo_model}\nbogus_key: 1\ndata: {path: data/alpaca_sample.json}\n"
    *outputs, checked = client.predict(text, "cpu", api_name="/estimate")
    assert "bogus_key: unknown key" in checked and "Valid choices" in checked and "Traceback" not in checked
    assert all(o == {"__type__": "update"} for o in outputs)  # the chart, estimate and ten fields keep what they showed
    *_, checked = client.predict(text.replace("bogus_key: 1\n", ""), "cpu", api_name="/estimate")
    assert checked.startswith("✓ The recipe is valid") and "bogus" not in checked  # the stale error is replaced


def test_api_errors_are_messages_not_tracebacks(client):
    *_, checked = client.predict("model: {name: data/demo_model}\ndata: {path: data/alpaca_sample.json}\ntraining: {lr: -1}",
                                 "cpu", api_name="/estimate")
    assert "training.lr" in checked and "Traceback" not in checked
    button, export_md = client.predict("../etc", api_name="/adapter_zip")
    assert "No run named ../etc" in export_md and button["value"] is None
    *_, checked = client.predict("model: [", "cpu", api_name="/estimate")
    assert "recipe: line 1, column 9: invalid YAML" in checked  # the recipe's own message (Recipe.from_yaml_text)


def test_api_upload_is_stored_under_a_safe_name(client, tmp_path):
    from gradio_client import handle_file

    src = tmp_path / "my data (v2)!.jsonl"
    src.write_text('{"text": "Tern here."}\n')
    update, _data_md = client.predict(handle_file(str(src)), api_name="/upload_data")
    stored = Path(update["value"])  # the data dropdown now shows it, among its choices
    assert stored.parent == client.base / "uploads" and stored.name == "my_data_v2.jsonl" and stored.is_file()
    assert str(stored) in [c[0] if isinstance(c, (list, tuple)) else c for c in update["choices"]]
    again, _ = client.predict(handle_file(str(src)), api_name="/upload_data")
    assert again["value"] == update["value"]  # the same content again: the same file, no copy
    assert [p.name for p in (client.base / "uploads").iterdir()] == ["my_data_v2.jsonl"]
    _, error = client.predict(handle_file(str(REPO / "pyproject.toml")), api_name="/upload_data")
    assert "is not a data file" in error


def test_api_training_start_refuse_stop_and_adapter_zip(client, recipe_dict):
    import zipfile

    # more steps than the test lasts, on a machine however fast: the test stops it
    r = dict(recipe_dict, name="my-first-run", training=dict(recipe_dict["training"], max_steps=100_000))
    r.pop("output_dir")
    r["checkpointing"] = {"save_every": 1000}
    r["logging"] = {"tensorboard": False}
    text = yaml.safe_dump(r)
    data = r["data"]["path"]
    runs = client.base / "runs"
    # not the data chosen in the Data tab: refused, whatever the card
    run_update, _table, msg = client.predict(text, "cpu", "data/alpaca_sample.json", True, api_name="/start_training")
    assert "Not started: the recipe trains on" in msg and "data/alpaca_sample.json chosen" in msg
    # the memory model says it does not fit a 1 GB card: refused, with the reason and the way out
    run_update, _table, msg = client.predict(text, "1GB", data, False, api_name="/start_training")
    assert "Not started" in msg and "Start even if it does not fit" in msg and run_update == {"__type__": "update"}
    assert not (runs / "my-first-run").exists()
    # confirmed: it starts, in a folder named as typed
    run_update, _table, msg = client.predict(text, "1GB", data, True, api_name="/start_training")
    pick = run_update["value"]  # the Run dropdown now shows the new run
    assert pick == "my-first-run" and (runs / pick / "recipe.yaml").is_file() and "predicted not to fit" in msg
    _, _, msg = client.predict(text, "cpu", data, False, api_name="/start_training")
    assert "already running" in msg, (runs / pick / jobs.LOG_NAME).read_text()[-3000:]  # why the job ended, if it did
    _wait(lambda: jobs.run_status(runs / pick, runs).step >= 1)
    client.predict(pick, api_name="/stop_training")
    _wait(lambda: not jobs.running_jobs(runs), timeout=HANG_GUARD_S)
    st = jobs.run_status(runs / pick, runs)
    assert st.state == "stopped" and st.has_checkpoint
    # the same name again: refused, nothing renamed (the run is resumed with Resume, not Start)
    _, _, msg = client.predict(text, "cpu", data, False, api_name="/start_training")
    assert "A run named 'my-first-run' already exists" in msg and "my-first-run-2" in msg
    assert sorted(p.name for p in runs.iterdir() if not p.name.startswith(".")) == ["my-first-run"]
    button, export_md = client.predict(pick, api_name="/adapter_zip")
    assert "has no adapter yet" in export_md and button["value"] is None
    # a finished run's adapter folder comes back as a zip, ready in the download button
    (runs / pick / "adapter").mkdir()
    (runs / pick / "adapter" / "adapter_config.json").write_text("{}")
    button, export_md = client.predict(pick, api_name="/adapter_zip")
    assert export_md == "" and button["interactive"] is True
    archive = button["value"]["path"] if isinstance(button["value"], dict) else button["value"]
    assert Path(archive).name == "my-first-run-adapter.zip"
    assert zipfile.ZipFile(archive).namelist() == ["adapter_config.json"]
    # a plan or a shipped recipe is given a free name when a run has its name
    (runs / "demo_cpu").mkdir(exist_ok=True)
    loaded = client.predict("recipes/demo_cpu.yaml", "cpu", api_name="/load_recipe")
    assert yaml.safe_load(loaded[0])["name"] == "demo_cpu-2" and "Renamed from demo_cpu" in loaded[-1]


def test_api_start_refuses_a_run_that_cannot_finish_even_when_told_to_start_anyway(client):
    """The bounds `finetuner run` checks (finetuner/planning/bounds.py), on the served page: no run folder is made."""
    text = yaml.safe_dump({"name": "forever", "model": {"name": "data/demo_model"},
                           "data": {"path": "data/alpaca_sample.json", "val_size": 20}, "training": {"max_steps": 10**15}})
    run_update, _table, msg = client.predict(text, "cpu", "data/alpaca_sample.json", True, api_name="/start_training")
    assert "Not started: training.max_steps 1,000,000,000,000,000: " in msg and "more than a year" in msg, msg
    assert run_update == {"__type__": "update"} and not (client.base / "runs" / "forever").exists()
    step = text.replace(str(10**15), "150").replace("data:\n", "data:\n  max_examples: 100\n")  # 80 training rows
    _run, _table, msg = client.predict(step.replace("max_steps: 150", "max_steps: 150\n  micro_batch_size: 81"), "cpu",
                                       "data/alpaca_sample.json", True, api_name="/start_training")
    assert "Not started: training.micro_batch_size 81 is more than the 80 training rows of " in msg, msg
    assert "micro_batch_size: 80" in msg and not (client.base / "runs" / "forever").exists()  # the editor's fix


def test_api_merge_into_a_non_empty_folder_is_refused_in_the_merges_words(client, tmp_path):
    demo_run_folder(client.base / "runs", "merge-me")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    msg = client.predict("merge-me", str(full), "bf16", False, api_name="/merge")
    assert "is not empty; finetuner will not write into it" in msg and "keep.txt" in msg and "Merging" not in msg
    assert (full / "keep.txt").read_text() == "mine"


def test_loss_chart_is_thinned_for_long_runs():
    from types import SimpleNamespace

    from ui import run_views

    long = SimpleNamespace(losses=[(i, 1.0 / i) for i in range(1, 5001)], evals=[(2500, 0.4), (5000, 0.3)])
    df = run_views.loss_df(long)
    train = df[df.series == "train"]
    assert len(train) <= run_views.MAX_PLOT_POINTS + 1
    assert train.step.iloc[0] == 1 and train.step.iloc[-1] == 5000 and train.step.is_monotonic_increasing
    assert list(df[df.series == "eval"].step) == [2500, 5000]  # eval points are never thinned
    short = SimpleNamespace(losses=[(i, 1.0) for i in range(1, 51)], evals=[])
    assert len(run_views.loss_df(short)) == 50


def test_the_same_content_uploaded_again_is_the_stored_file(tmp_path, monkeypatch):
    """The Data tab's upload: a new file is saved and said once; the same content again (any name, any
    folder) selects the stored file and says so, and nothing more is stored."""
    from ui import handlers as ui_handlers
    from ui.handlers import Handlers

    said = []
    monkeypatch.setattr(ui_handlers.gr, "Info", lambda message, *a, **k: said.append(message))
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    mine = tmp_path / "my hikes.jsonl"
    mine.write_text('{"instruction": "Hi", "output": "Hello"}\n', encoding="utf-8")
    again = tmp_path / "elsewhere" / "copy.jsonl"
    again.parent.mkdir()
    again.write_bytes(mine.read_bytes())
    first = h.on_upload(str(mine))[0]["value"]
    second = h.on_upload(str(again))[0]["value"]
    assert first == second and sorted(p.name for p in (tmp_path / "uploads").iterdir()) == ["my_hikes.jsonl"]
    assert said == [f"Saved as {first}", f"Already uploaded (same content): {first}"]

"""A run folder from someone else steers none of the user's trackers (issue 66), replayed with the real mechanisms:
the W&B library with a received ``wandb/settings`` naming "the sender's server" (a real HTTP server on loopback that
records every request it gets), resumed by ``finetuner run`` typed inside the folder and by the web UI's Resume; a
received ``tracking.json`` naming a finished run of the user's own ``mlflow server``; and an MLflow server that is
not there (refusing, or taking connections and never answering)."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
import yaml

import finetuner
from finetuner.config.recipe import Recipe
from tests.conftest import cli_in_process, free_port, run_cli, ui_client, wait_until_done
from tests.tracking.support import mlflow_server

SENDER_ID = "sendersrun01"


class Recorder(http.server.ThreadingHTTPServer):
    """An HTTP server on loopback standing for the sender's W&B server: it keeps every request it receives (method,
    path, the Authorization header) and answers each with an empty JSON object."""

    daemon_threads = True

    def __init__(self):
        self.seen: list[tuple[str, str, str]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(handler):
                n = int(handler.headers.get("Content-Length") or 0)
                handler.rfile.read(n)
                self.seen.append((handler.command, handler.path, handler.headers.get("Authorization", "")))
                handler.send_response(200)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", "2")
                handler.end_headers()
                handler.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = do_HEAD = _any

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def received_run(recipe_dict, folder: Path, tracker: str, tracking: dict) -> Path:
    """A run folder as someone else sends it: stopped after 2 of its 4 steps with a checkpoint (resumable), its
    recipe reporting to ``tracker``, and its ``tracking.json`` (``tracking``: the sender's ids and marks)."""
    stop = threading.Event()

    def stop_at_2(ev):
        if ev["event"] == "step" and ev["step"] == 2:
            stop.set()

    short = dict(recipe_dict, output_dir=str(folder), training=dict(recipe_dict["training"], max_steps=4),
                 checkpointing={"save_every": 2, "keep_last": 1})
    assert finetuner.train(Recipe.from_dict(short), callbacks=[stop_at_2], stop_event=stop).stopped
    saved = yaml.safe_load((folder / "recipe.yaml").read_text(encoding="utf-8"))
    saved["logging"] = {"report_to": [tracker]}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(saved), encoding="utf-8")
    (folder / "tracking.json").write_text(json.dumps(tracking), encoding="utf-8")
    return folder


def plant_wandb_settings(folder: Path, sender: str) -> None:
    """What a sender puts in the run folder for W&B: its workspace settings (online, to the sender's server) and
    config defaults."""
    (folder / "wandb").mkdir(exist_ok=True)
    (folder / "wandb" / "settings").write_text(f"[default]\nbase_url = {sender}\nmode = online\n", encoding="utf-8")
    (folder / "config-defaults.yaml").write_text("planted:\n  value: by-the-sender\n", encoding="utf-8")


@pytest.fixture
def victim(tmp_path, monkeypatch):
    """The user's own setup: a W&B API key in the environment, W&B's own settings (offline) in their config folder,
    finetuner's private folder; nothing of W&B's in the environment that would outrank a settings file."""
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "victim-wandb"
    config.mkdir()
    (config / "settings").write_text("[default]\nmode = offline\n", encoding="utf-8")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(config))
    monkeypatch.setenv("WANDB_API_KEY", "victims-secret-key-" + "0" * 21)
    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(tmp_path / "victim-finetuner"))
    return tmp_path


def said_new_run(output: str, tracker: str) -> list[str]:
    return [line for line in output.splitlines() if f"reporting to a new {tracker} run instead" in line]


def test_a_received_folders_wandb_settings_reach_no_server_when_finetuner_run_resumes_it_inside_the_folder(
        recipe_dict, victim):
    """``finetuner run recipe.yaml -o .`` typed inside a received run folder whose ``wandb/settings`` says online
    to the sender's server: the sender's server receives nothing (before: 13 requests, the user's API key among
    them); the run resumes, reports offline as the user's own W&B settings say, to a new W&B run, in one line."""
    wandb = pytest.importorskip("wandb")
    del wandb
    sender = Recorder()
    try:
        run = received_run(recipe_dict, victim / "received", "wandb", {"wandb": SENDER_ID, "marks": {"wandb": "0" * 64}})
        plant_wandb_settings(run, sender.url)
        p = run_cli("run", "recipe.yaml", "-o", ".", cwd=run)
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-3000:]
        assert sender.seen == [], sender.seen
        assert json.loads((run / "metrics.json").read_text(encoding="utf-8"))["steps"] == 4
        tracking = json.loads((run / "tracking.json").read_text(encoding="utf-8"))
        assert tracking["wandb"] != SENDER_ID and len(said_new_run(out, "wandb")) == 1, out[-3000:]
        offline = sorted((run / "wandb").glob(f"offline-run-*-{tracking['wandb']}"))
        assert len(offline) == 1, sorted(p.name for p in (run / "wandb").iterdir())  # the user's mode: offline
        config = (offline[0] / "files" / "config.yaml")
        assert not config.exists() or "by-the-sender" not in config.read_text(encoding="utf-8")
    finally:
        sender.shutdown()


def test_a_received_folders_wandb_settings_reach_no_server_when_the_web_ui_resumes_it(recipe_dict, alpaca_file, victim):
    """The web UI's Resume (over HTTP) of the same received run folder: its job no longer runs inside the run folder
    but in finetuner's working folder, so W&B reads only the user's settings; the sender's server receives nothing
    (before: 5 requests)."""
    pytest.importorskip("wandb")
    sender = Recorder()
    try:
        runs = victim / "ui" / "runs"
        run = received_run(recipe_dict, runs / "received", "wandb", {"wandb": SENDER_ID})
        plant_wandb_settings(run, sender.url)
        model = Path(recipe_dict["model"]["name"])  # the served UI's scope holds the run's model and data
        with ui_client(victim / "ui", data_dirs=[alpaca_file.parent, model.parent]) as c:
            c.predict("received", False, api_name="/resume_training")
            st = wait_until_done(runs, "received")
        log = (run / "train.log").read_text(encoding="utf-8", errors="replace") if (run / "train.log").exists() else ""
        assert st.state == "done", (st.state, st.error, log[-2000:])
        assert sender.seen == [], sender.seen
        tracking = json.loads((run / "tracking.json").read_text(encoding="utf-8"))
        assert tracking["wandb"] != SENDER_ID
        assert sorted((run / "wandb").glob(f"offline-run-*-{tracking['wandb']}"))
        work = victim / "victim-finetuner" / "work"  # where the job ran: finetuner's own, private
        assert work.is_dir() and stat.S_IMODE(work.stat().st_mode) == 0o700
    finally:
        sender.shutdown()


def test_a_received_tracking_json_naming_a_finished_mlflow_run_writes_nothing_into_it_unless_asked(
        recipe_dict, tmp_path, monkeypatch):
    """The user's own finished MLflow run, on their real ``mlflow server``, named by a received folder's
    tracking.json: resuming writes no metric and no artifact into it (before: 69 metrics and the adapter) and
    reports to a new run, saying so in one line; with ``--tracking-resume`` the resume continues the named run."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(tmp_path / "victim-finetuner"))
    with mlflow_server(tmp_path / "server") as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
        client = mlflow.MlflowClient(url)
        finished = client.create_run(client.create_experiment("mine"), run_name="my-finished-run").info.run_id
        client.log_metric(finished, "my/score", 0.9, step=1)
        client.set_terminated(finished, "FINISHED")
        sent = received_run(recipe_dict, tmp_path / "received", "mlflow", {"mlflow": finished})
        again = tmp_path / "received-again"
        shutil.copytree(sent, again)

        p = cli_in_process("run", str(sent / "recipe.yaml"), "-o", str(sent))
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        run = client.get_run(finished)
        assert set(run.data.metrics) == {"my/score"} and run.info.status == "FINISHED"
        assert client.list_artifacts(finished) == []
        new = json.loads((sent / "tracking.json").read_text(encoding="utf-8"))["mlflow"]
        assert new != finished
        assert sorted(m.step for m in client.get_metric_history(new, "train/loss")) == [3, 4]

        p = cli_in_process("run", str(again / "recipe.yaml"), "-o", str(again), "--tracking-resume")
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        assert json.loads((again / "tracking.json").read_text(encoding="utf-8"))["mlflow"] == finished
        assert sorted(m.step for m in client.get_metric_history(finished, "train/loss")) == [3, 4]


def test_a_received_id_is_said_in_one_line_and_the_users_own_id_is_continued(tmp_path, monkeypatch, caplog):
    """The mark: a run's own tracking.json id (marked with this user's key) is continued; the same id copied with
    another user's mark, or without one, is not, and the run says so once per tracker."""
    mlflow = pytest.importorskip("mlflow")
    from finetuner.tracking import owned
    from finetuner.tracking.report import Reporters
    from finetuner.training.seal import private_key

    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(tmp_path / "me"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    first = Reporters(["mlflow"], mine, "mine", private_key=private_key)
    first({"event": "start"})
    first.close()
    ids = json.loads((mine / "tracking.json").read_text(encoding="utf-8"))
    second = Reporters(["mlflow"], mine, "mine", private_key=private_key)
    second({"event": "start"})
    second.close()
    assert json.loads((mine / "tracking.json").read_text(encoding="utf-8"))["mlflow"] == ids["mlflow"]
    said = [r.getMessage() for r in caplog.records if r.name == "finetuner.tracking.report"]
    assert said == []

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(tmp_path / "someone-else"))  # the id marked with another key
    their_mark = owned.mark("mlflow", ids["mlflow"], private_key())
    (theirs / "tracking.json").write_text(json.dumps({"mlflow": ids["mlflow"], "marks": {"mlflow": their_mark}}),
                                          encoding="utf-8")
    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(tmp_path / "me"))
    third = Reporters(["mlflow"], theirs, "theirs", private_key=private_key)
    third({"event": "start"})
    third.close()
    assert json.loads((theirs / "tracking.json").read_text(encoding="utf-8"))["mlflow"] != ids["mlflow"]
    said = [r.getMessage() for r in caplog.records if r.name == "finetuner.tracking.report"]
    assert len(said) == 1 and said[0].startswith("mlflow: ") and "--tracking-resume" in said[0], said
    assert mlflow.MlflowClient().get_run(ids["mlflow"]).info.status == "FINISHED"


@contextlib.contextmanager
def silent_server():
    """A TCP port that takes connections and never answers (a hung server): its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_dead_or_wrong_mlflow_costs_one_line_and_a_few_seconds(recipe_dict, tmp_path, monkeypatch):
    """No server on the port, a server that never answers, a host that does not exist: each costs the run's start
    at most the probe's timeout (5 s) and one warning line, with MLflow's own HTTP settings left to finetuner
    (before: 246 s and 7 urllib3 retry lines for a dead server, 274-286 s for a bad URI); the run trains on."""
    pytest.importorskip("mlflow")
    from finetuner.tracking.report import Reporters
    from finetuner.tracking.to_mlflow import PROBE_TIMEOUT_S

    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"):
        monkeypatch.delenv(name, raising=False)
    with silent_server() as hung:
        for uri in (f"http://127.0.0.1:{free_port()}", hung, "http://no-such-host.invalid:5000"):
            monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
            folder = tmp_path / f"r{free_port()}"
            folder.mkdir()
            rep = Reporters(["mlflow"], folder, folder.name)
            began = time.monotonic()
            rep({"event": "start"})
            for step in (1, 2):
                rep({"event": "step", "step": step, "loss": 1.0})
            rep.close()
            took = time.monotonic() - began
            assert rep.runs == {} and took < PROBE_TIMEOUT_S + 5, (uri, took)
            print(f"{uri}: {took:.2f} s")

        monkeypatch.setenv("MLFLOW_TRACKING_URI", hung)
        d = dict(recipe_dict, logging={"report_to": ["mlflow"]}, training=dict(recipe_dict["training"], max_steps=2))
        recipe = tmp_path / "r.yaml"
        recipe.write_text(yaml.safe_dump(d), encoding="utf-8")
        p = run_cli("run", str(recipe))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()
    assert not [line for line in out.splitlines() if "retry" in line.lower() or "urllib3" in line], out[-3000:]
    said = [line for line in out.splitlines() if "mlflow:" in line.lower() or "MLflow" in line]
    assert len(said) == 1 and "no MLflow tracking server answers" in said[0], out[-3000:]

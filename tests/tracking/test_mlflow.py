"""A run reported to MLflow (``logging.report_to: [mlflow]``), read back through MLflow's own client from a local store:
its recipe as parameters, every step's metrics, the final predicted-vs-measured figures, the adapter and the plan as
artifacts; stopped and resumed, it stays one MLflow run (its id kept in the run folder's tracking.json)."""

from __future__ import annotations

import json
import threading

import pytest

import finetuner
from finetuner.config.recipe import Recipe
from tests.tracking.support import mlflow_server

mlflow = pytest.importorskip("mlflow")


def test_a_stopped_and_resumed_run_is_one_mlflow_run_with_params_metrics_and_artifacts(recipe_dict, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)  # where a SQLite store keeps artifacts: ./mlruns
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tracking-test")
    stop = threading.Event()

    def stop_at_2(ev):
        if ev["event"] == "step" and ev["step"] == 2:
            stop.set()

    d = dict(recipe_dict, logging={"report_to": ["mlflow"]})
    recipe = Recipe.from_dict(d, overrides=["training.max_steps=4", "checkpointing.save_every=2"])
    first = finetuner.train(recipe, callbacks=[stop_at_2], stop_event=stop)
    assert first.stopped
    run_id = json.loads((first.run_dir / "tracking.json").read_text())["mlflow"]
    client = mlflow.MlflowClient()
    assert client.get_run(run_id).info.status == "KILLED"
    second = finetuner.train(recipe)
    assert not second.stopped
    assert json.loads((second.run_dir / "tracking.json").read_text())["mlflow"] == run_id  # continued, not a new run
    assert len(client.search_runs([client.get_experiment_by_name("tracking-test").experiment_id])) == 1
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["recipe.training.max_steps"] == "4" and p["recipe.lora.r"] == "8" and p["run.method"] == "lora"
    losses = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in losses) == [1, 2, 3, 4]  # two steps before the stop, two after the resume
    assert [round(m.value, 5) for m in sorted(losses, key=lambda m: m.step)] == pytest.approx(
        first.losses + second.losses[len(first.losses):], abs=1e-5)
    m = run.data.metrics
    for name in ("train/lr", "train/tokens_per_s", "memory/mem_peak_gib", "time/measured.total", "time/predicted.steps"):
        assert name in m, sorted(m)
    metrics = json.loads((second.run_dir / "metrics.json").read_text())
    assert m["time/measured.total"] == pytest.approx(metrics["time"]["measured"]["total"])
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"adapter", "recipe.yaml", "metrics.json"} <= arts, arts
    assert "adapter_model.safetensors" in {a.path.split("/")[-1] for a in client.list_artifacts(run_id, "adapter")}


def test_a_tracker_that_fails_costs_one_warning_line_and_the_run_goes_on(recipe_dict, tmp_path, monkeypatch, caplog):
    """MLflow pointed at a server nobody runs: the run trains, saves its adapter, and says so once."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # the discard port: nothing answers
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    d = dict(recipe_dict, logging={"report_to": ["mlflow"]})
    res = finetuner.train(Recipe.from_dict(d, overrides=["training.max_steps=2"]))
    assert (res.run_dir / "adapter" / "adapter_model.safetensors").exists()
    said = [r.getMessage() for r in caplog.records if r.name == "finetuner.tracking.report"]
    assert len(said) == 1 and said[0].startswith("mlflow: ") and "the run goes on without it" in said[0], said
    assert "\n" not in said[0]


def test_a_run_appears_in_a_local_mlflow_server(recipe_dict, tmp_path, monkeypatch):
    """A real ``mlflow server`` (its own process, a SQLite store and an artifact folder of its own) receives the run
    over HTTP: parameters, per-step metrics and the adapter read back through the client, and the run folder says
    where the run's page is."""
    with mlflow_server(tmp_path / "server") as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "server-test")
        monkeypatch.chdir(tmp_path)
        d = dict(recipe_dict, logging={"report_to": ["mlflow"]})
        res = finetuner.train(Recipe.from_dict(d, overrides=["training.max_steps=2"]))
        tracking = json.loads((res.run_dir / "tracking.json").read_text())
        run_id = tracking["mlflow"]
        client = mlflow.MlflowClient(url)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.params["recipe.training.max_steps"] == "2"
        assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2]
        assert "adapter_model.safetensors" in {a.path.split("/")[-1] for a in client.list_artifacts(run_id, "adapter")}
        assert any((tmp_path / "server" / "artifacts").rglob("adapter_model.safetensors"))  # stored by the server, not here
        assert url in json.dumps(tracking.get("where", {})) and run_id in json.dumps(tracking.get("where", {}))


def test_grpo_completions_of_a_step_become_a_table_with_their_rewards(tmp_path, monkeypatch):
    """A GRPO step event's ``completions`` (as finetuner.objectives.grpo writes them: prompt, completion, reward and
    each reward function's score) reach MLflow as a table, read back through mlflow.load_table."""
    from finetuner.tracking.report import Reporters

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "completions-test")
    run_dir = tmp_path / "runs" / "g"
    run_dir.mkdir(parents=True)
    rep = Reporters(["mlflow"], run_dir, "g")
    rep({"event": "start", "objective": "grpo"})
    shown = [{"prompt": "2+2?", "completion": "4", "reward": 1.0, "rewards": {"exact_match": 1.0, "length_bounds": None}},
             {"prompt": "3+3?", "completion": "7", "reward": 0.0, "rewards": {"exact_match": 0.0, "length_bounds": 0.5}}]
    rep({"event": "step", "step": 1, "loss": 0.5, "reward": 0.5, "completions": shown})
    rep.close()
    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    table = mlflow.load_table("completions.json", run_ids=[run_id]).astype(str)  # pandas reads "4" back as 4
    assert list(table["completion"]) == ["4", "7"] and list(table["rewards.exact_match"]) == ["1.0", "0.0"]
    assert list(table["rewards.length_bounds"]) == ["", "0.5"]  # a function that scored nothing: empty, not "None"
    assert mlflow.MlflowClient().get_metric_history(run_id, "train/reward")[0].value == 0.5

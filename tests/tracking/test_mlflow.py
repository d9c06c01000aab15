"""A run reported to MLflow (``logging.report_to: [mlflow]``), read back through MLflow's own client from a local store:
its recipe as parameters, every step's metrics, the final predicted-vs-measured figures, the adapter and the plan as
artifacts; stopped and resumed, it stays one MLflow run (its id kept in the run folder's tracking.json)."""

from __future__ import annotations

import json
import threading

import pytest

import finetuner
from finetuner.config.recipe import Recipe

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

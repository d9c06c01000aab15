"""A run in MLflow, through :class:`mlflow.MlflowClient` (no global active run: the Python API may train twice in one
process). Where: MLflow's own setting, ``MLFLOW_TRACKING_URI`` (a server, or a local store); the experiment:
``MLFLOW_EXPERIMENT_NAME``, else ``finetuner``."""

from __future__ import annotations

import os
from pathlib import Path

#: the experiment a run goes in when ``MLFLOW_EXPERIMENT_NAME`` names none
EXPERIMENT = "finetuner"
#: what MLflow takes in one log_batch call
_BATCH = 100
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


class MlflowRun:
    def __init__(self, run_dir: Path, run_name: str, run_id: str | None):
        import mlflow
        from mlflow import MlflowClient

        self.client = MlflowClient()
        if run_id is not None:
            info = self.client.get_run(run_id).info
            self.client.update_run(run_id, status="RUNNING")
            self.resumed = True
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            info = self.client.create_run(exp_id, run_name=run_name, tags={"finetuner.run_dir": str(run_dir)}).info
            self.resumed = False
        self.run_id = info.run_id
        uri = mlflow.get_tracking_uri()
        self.where = (f"{uri.rstrip('/')}/#/experiments/{info.experiment_id}/runs/{self.run_id}"
                      if uri.startswith(("http://", "https://")) else f"run {self.run_id} in {uri}")

    def log_params(self, params: dict[str, str]) -> None:
        if self.resumed:  # MLflow keeps a parameter's first value; the resumed run's recipe is the same run's
            return
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + _BATCH])

    def log_table(self, name: str, rows: list[dict[str, str]], step: int) -> None:
        self.client.log_table(self.run_id, {k: [r.get(k, "") for r in rows] for k in rows[0]}, f"{name}.json")

    def log_artifacts(self, paths: list[Path]) -> None:
        for p in paths:
            if p.is_dir():
                self.client.log_artifacts(self.run_id, str(p), p.name)
            else:
                self.client.log_artifact(self.run_id, str(p))

    def finish(self, state: str) -> None:
        self.client.set_terminated(self.run_id, _STATUS[state])

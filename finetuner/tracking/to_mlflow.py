"""A run in MLflow, through :class:`mlflow.MlflowClient` (no global active run: the Python API may train twice in one
process). Where: MLflow's own setting, ``MLFLOW_TRACKING_URI`` (a server, or a local store); the experiment:
``MLFLOW_EXPERIMENT_NAME``, else ``finetuner``.

A server that is not there costs the run one warning line and a few seconds, not minutes: it is asked once
(``/health``, :data:`PROBE_TIMEOUT_S`) before the run starts, and MLflow's HTTP retries and timeout are short
unless the user set them (:data:`HTTP_DEFAULTS`); a request that still fails drops MLflow for the run."""

from __future__ import annotations

import logging
import os
from pathlib import Path

#: the experiment a run goes in when ``MLFLOW_EXPERIMENT_NAME`` names none
EXPERIMENT = "finetuner"
#: what MLflow takes in one log_batch call
_BATCH = 100
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


#: MLflow's HTTP settings when the user set none (MLflow's own: 7 retries with a growing back-off, 120 s a
#: request; a dead server stalled a run about 4 minutes and printed a urllib3 line per retry): one retry after 1 s,
#: 10 s a request
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
#: how long the server has to answer before the run starts without it
PROBE_TIMEOUT_S = 5.0


class _NoRetryLines(logging.Filter):
    """urllib3's "Retrying (Retry(total=...))" warnings: the failure, if it stays, is finetuner's one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Retrying")


_QUIET_RETRIES = _NoRetryLines()


def probe(uri: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise ConnectionError unless an HTTP(S) tracking server at ``uri`` answers (any HTTP status) within
    ``timeout`` seconds, name lookup included (run in a thread: a lookup takes no timeout of its own)."""
    import threading
    import urllib.error
    import urllib.request

    why: list[str] = []

    def ask() -> None:
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout):
                pass
        except urllib.error.HTTPError:  # it answered: a server is there (a proxy may not route /health)
            pass
        except (OSError, ValueError) as e:  # refused, no such host, a timeout, not a URL
            reason = getattr(e, "reason", e)
            why.append(f"{type(reason).__name__}: {reason}")

    asker = threading.Thread(target=ask, daemon=True, name="mlflow-probe")
    asker.start()
    asker.join(timeout + 1)
    if asker.is_alive():
        why.append(f"no answer in {timeout:g} s")
    if why:
        raise ConnectionError(f"no MLflow tracking server answers at {uri} ({why[0]})")


class MlflowRun:
    def __init__(self, run_dir: Path, run_name: str, run_id: str | None):
        import mlflow
        from mlflow import MlflowClient

        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        logging.getLogger("urllib3.connectionpool").addFilter(_QUIET_RETRIES)
        if mlflow.get_tracking_uri().startswith(("http://", "https://")):
            probe(mlflow.get_tracking_uri())
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

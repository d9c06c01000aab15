"""A run in Trackio, through its own library (``pip install 'finetuner[trackio]'``). Where: Trackio's own settings
(``TRACKIO_DIR``, else ``$HF_HOME/trackio``: a local SQLite store per project; ``TRACKIO_SPACE_ID`` or
``TRACKIO_SERVER_URL`` for a Space or a server); the project: ``finetuner``. A resumed run continues the Trackio run
of the same name (Trackio resumes by name; its id is kept in tracking.json with the others').

Trackio announces itself with ``print`` (the project, where it logs, the dashboard command): that goes nowhere, so
finetuner's output stays its own; its calls go to the :class:`trackio.Run` object, never the module's current run."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from finetuner.workdir import in_work_dir

#: the Trackio project a run goes in
PROJECT = "finetuner"
#: what an artifact's name takes: letters, digits, ``- _ .``
_NOT_IN_ARTIFACT = re.compile(r"[^\w\-.]")


def _unprinted():
    return contextlib.redirect_stdout(io.StringIO())


class TrackioRun:
    def __init__(self, run_dir: Path, run_name: str, run_id: str | None):
        import trackio

        self.run_name = run_name
        with _unprinted(), in_work_dir():  # nothing of the folder a command was typed in steers it
            self.run = trackio.init(project=PROJECT, name=run_name, resume="allow" if run_id else "never", embed=False)
        self.run_id = self.run.id
        self.where = f"run {run_name} of project {PROJECT}: trackio show --project {PROJECT}"

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params)  # sent with the next logged row

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, rows: list[dict[str, str]], step: int) -> None:
        import trackio

        columns = list(rows[0])
        self.run.log({name: trackio.Table(columns=columns, data=[[r.get(c, "") for c in columns] for r in rows])}, step=step)

    def log_artifacts(self, paths: list[Path]) -> None:
        import trackio

        art = trackio.Artifact(_NOT_IN_ARTIFACT.sub("_", self.run_name), type="model")
        for p in paths:
            if p.is_dir():
                art.add_dir(p, name=p.name)
            else:
                art.add_file(p)
        self.run.log_artifact(art)

    def finish(self, state: str) -> None:
        import trackio

        with _unprinted():
            if trackio.context_vars.current_run.get() is self.run:  # else Trackio finishes it again at exit, printing
                trackio.finish()
            else:
                self.run.finish()

"""A run in Weights & Biases, through its own library (``pip install 'finetuner[wandb]'``). Where: W&B's own settings
(``WANDB_MODE``: ``offline`` keeps the run in files for ``wandb sync``; ``WANDB_API_KEY``, ``WANDB_ENTITY``); the
project: ``WANDB_PROJECT``, else ``finetuner``; its files: ``WANDB_DIR``, else the run folder's ``wandb/``.
W&B's settings files are the user's own (``~/.config/wandb/settings``, or ``$WANDB_CONFIG_DIR``'s): ``wandb.init``
runs in finetuner's working folder (:mod:`finetuner.workdir`), so that a ``wandb/settings`` or
``config-defaults.yaml`` in the folder a command was typed in (a received run folder) is never read.

Each tracking run is its own :class:`wandb.Run` object (``reinit="create_new"``, never the global ``wandb.run``), so
the Python API may train twice in one process. W&B's console capture is off: finetuner's output stays its own."""

from __future__ import annotations

import os
import re
from pathlib import Path

from finetuner.workdir import in_work_dir

#: the project a run goes in when ``WANDB_PROJECT`` names none
PROJECT = "finetuner"
#: W&B's exit codes: 0 a finished run; a stopped one (resumable) is "preempted" before it exits
_EXIT = {"finished": 0, "failed": 1, "stopped": 0}
#: what an artifact's name takes: letters, digits, ``- _ .``
_NOT_IN_ARTIFACT = re.compile(r"[^\w\-.]")


class WandbRun:
    def __init__(self, run_dir: Path, run_name: str, run_id: str | None):
        import wandb

        self.run_name = run_name
        # absolute before wandb.init runs in the working folder: a relative WANDB_DIR is the user's folder's
        where = {"dir": str(Path(os.environ.get("WANDB_DIR") or run_dir).expanduser().resolve())}
        settings = wandb.Settings(silent=True, console="off", reinit="create_new")
        with in_work_dir():  # W&B reads ./wandb/settings and ./config-defaults.yaml: never a received folder's
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, name=run_name, id=run_id,
                                  resume="allow" if run_id else None, settings=settings, **where)
        self.run_id = self.run.id
        # offline: the folder ``wandb sync`` uploads (asking an offline run its url only warns)
        self.where = str(Path(self.run.dir).parent) if self.run.offline else (self.run.url or f"run {self.run_id}")

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)  # a resumed run's recipe is the same run's

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, rows: list[dict[str, str]], step: int) -> None:
        import wandb

        columns = list(rows[0])
        self.run.log({name: wandb.Table(columns=columns, data=[[r.get(c, "") for c in columns] for r in rows])}, step=step)

    def log_artifacts(self, paths: list[Path]) -> None:
        import wandb

        art = wandb.Artifact(_NOT_IN_ARTIFACT.sub("_", self.run_name), type="model",
                             description="finetuner run: the adapter, the plan, the recipe and the final metrics")
        for p in paths:
            if p.is_dir():
                art.add_dir(str(p), name=p.name)
            else:
                art.add_file(str(p))
        self.run.log_artifact(art)

    def finish(self, state: str) -> None:
        if state == "stopped":
            self.run.mark_preempting()
        self.run.finish(exit_code=_EXIT[state])

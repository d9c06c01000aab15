"""A run reported to Trackio (``logging.report_to: [trackio]``), read back from Trackio's local SQLite store through
Trackio's own API: the recipe as the run's config, every step's metrics, the final predicted-vs-measured figures, the
samples as a table, the adapter and the plan as an artifact; stopped and resumed, it stays one Trackio run.

Trackio fixes its folder (``TRACKIO_DIR``) when it is imported, so the run and the read-back happen in a Python process
of their own, started with the test's folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import finetuner
from finetuner.config.recipe import Recipe

pytest.importorskip("trackio")

REPO = Path(finetuner.__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys, threading
import finetuner
from finetuner.config.recipe import Recipe

recipe = Recipe.from_dict(json.loads(sys.argv[1]), overrides=["training.max_steps=4", "checkpointing.save_every=2"])
stop = threading.Event()
first = finetuner.train(recipe, callbacks=[lambda ev: ev["event"] == "step" and ev["step"] == 2 and stop.set()],
                        stop_event=stop)
second = finetuner.train(recipe)

import trackio
from trackio.sqlite_storage import SQLiteStorage

runs = list(trackio.Api().runs("finetuner"))
out = {"stopped": [first.stopped, second.stopped], "losses": [first.losses, second.losses],
       "run_dir": str(second.run_dir), "runs": [[r.name, r.id] for r in runs], "config": runs[0].config,
       "logs": SQLiteStorage.get_logs("finetuner", runs[0].name, run_id=runs[0].id),
       "artifacts": SQLiteStorage.get_run_artifacts("finetuner", runs[0].name, runs[0].id),
       "manifest": SQLiteStorage.get_artifact_manifest("finetuner", runs[0].name, "latest")}
print("READBACK " + json.dumps(out, default=str))
"""


def test_a_stopped_and_resumed_run_is_one_trackio_run_with_config_metrics_table_and_artifact(recipe_dict, tmp_path):
    d = dict(recipe_dict, logging={"report_to": ["trackio"]}, samples={"prompts": ["Say hi."], "max_new_tokens": 4})
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio"), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(d)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Trackio" not in r.stdout  # its announcements (project, dashboard) are not finetuner's output
    out = json.loads(r.stdout.split("READBACK ", 1)[1])
    assert out["stopped"] == [True, False]
    run_dir = Path(out["run_dir"])
    assert out["runs"] == [[run_dir.name, json.loads((run_dir / "tracking.json").read_text())["trackio"]]]
    c = out["config"]
    assert c["recipe.training.max_steps"] == "4" and c["recipe.lora.r"] == "8" and c["run.method"] == "lora"

    first, second = out["losses"]
    losses = {row["step"]: row["train/loss"] for row in out["logs"] if "train/loss" in row}
    assert sorted(losses) == [1, 2, 3, 4]  # two steps before the stop, two after the resume
    assert [losses[s] for s in sorted(losses)] == pytest.approx(first + second[len(first):], abs=1e-5)
    final = {k: v for row in out["logs"] for k, v in row.items()}
    for name in ("train/lr", "train/tokens_per_s", "memory/mem_peak_gib", "time/predicted.steps"):
        assert name in final, sorted(final)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert final["time/measured.steps"] == pytest.approx(metrics["time"]["measured"]["steps"])
    table = final["samples"]
    assert table["_type"] == "trackio.table" and [row["prompt"] for row in table["_value"]] == ["Say hi."], table

    assert [(a["name"], a["type"]) for a in out["artifacts"]["output"]] == [(run_dir.name, "model")], out["artifacts"]
    files = {f["path"] for f in out["manifest"]["manifest"]}
    assert {"adapter/adapter_model.safetensors", "recipe.yaml", "metrics.json"} <= files, files

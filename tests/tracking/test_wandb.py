"""A run reported to Weights & Biases (``logging.report_to: [wandb]``) in offline mode, read back from the run files
W&B writes (its ``.wandb`` transaction log, parsed with W&B's own protobuf records): the recipe as config, every step's
metrics, the final predicted-vs-measured figures, the adapter and the plan as an artifact, the samples as a table;
stopped and resumed, both sessions carry the one run id that tracking.json keeps (``wandb sync`` makes them one run)."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest

import finetuner
from finetuner.config.recipe import Recipe

wandb = pytest.importorskip("wandb")

#: W&B's transaction log: a LevelDB-style log of 32 KiB blocks after a 7-byte header (``:W&B``, a magic, a version);
#: each chunk has a 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last)
_BLOCK, _FULL, _LAST = 32768, 1, 4


def records(path: Path) -> list:
    """The :class:`wandb.proto.wandb_internal_pb2.Record` s of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        chunk += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


def items(update) -> dict[str, object]:
    """A history row's or summary's items, by their ``/``-joined key."""
    return {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in update}


def test_a_stopped_and_resumed_run_is_one_wandb_run_with_config_metrics_table_and_artifact(recipe_dict, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the run folder's wandb/
    monkeypatch.setenv("WANDB_PROJECT", "tracking-test")
    stop = threading.Event()

    def stop_at_2(ev):
        if ev["event"] == "step" and ev["step"] == 2:
            stop.set()

    d = dict(recipe_dict, logging={"report_to": ["wandb"]}, samples={"prompts": ["Say hi."], "max_new_tokens": 4})
    recipe = Recipe.from_dict(d, overrides=["training.max_steps=4", "checkpointing.save_every=2"])
    first = finetuner.train(recipe, callbacks=[stop_at_2], stop_event=stop)
    assert first.stopped
    run_id = json.loads((first.run_dir / "tracking.json").read_text())["wandb"]
    second = finetuner.train(recipe)
    assert not second.stopped and json.loads((second.run_dir / "tracking.json").read_text())["wandb"] == run_id

    sessions = sorted((second.run_dir / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2 and all(s.name.endswith(f"-{run_id}") for s in sessions), sessions
    recs = [r for s in sessions for r in records(s / f"run-{run_id}.wandb")]
    runs = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert {r.run_id for r in runs} == {run_id} and {r.project for r in runs} == {"tracking-test"}
    config = {}
    for r in recs:
        if r.WhichOneof("record_type") in ("run", "config"):
            config.update({u.key: json.loads(u.value_json) for u in (r.run.config if r.HasField("run") else r.config).update})
    assert config["recipe.training.max_steps"] == "4" and config["recipe.lora.r"] == "8" and config["run.method"] == "lora"

    rows = [items(r.history.item) for r in recs if r.WhichOneof("record_type") == "history"]
    losses = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert sorted(losses) == [1, 2, 3, 4]  # two steps before the stop, two after the resume
    assert [losses[s] for s in sorted(losses)] == pytest.approx(first.losses + second.losses[len(first.losses):], abs=1e-5)
    final = {k: v for row in rows for k, v in row.items()}
    for name in ("train/lr", "train/tokens_per_s", "memory/mem_peak_gib", "time/predicted.steps"):
        assert name in final, sorted(final)
    metrics = json.loads((second.run_dir / "metrics.json").read_text())
    assert final["time/measured.steps"] == pytest.approx(metrics["time"]["measured"]["steps"])  # the total grew by the samples
    assert final["samples/_type"] == "table-file" and final["samples/nrows"] == 1
    table = json.loads((sessions[-1] / "files" / final["samples/path"]).read_text())
    assert table["data"][0][table["columns"].index("prompt")] == "Say hi."

    arts = [r.artifact for r in recs if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "model"]
    assert len(arts) == 1 and arts[0].name == second.run_dir.name
    files = {e.path for e in arts[0].manifest.contents}
    assert {"adapter/adapter_model.safetensors", "recipe.yaml", "metrics.json"} <= files, files
    exits = [r.exit for r in recs if r.WhichOneof("record_type") == "exit"]
    assert len(exits) == 2 and exits[-1].exit_code == 0

"""Killed at any moment: SIGKILL after a step, inside a checkpoint write and inside an events write;
every resume continues to the losses and the adapter of the run that was never interrupted."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.runs.events import read_events
from tests.conftest import run_cli, write_recipe


def _adapter(run_dir):
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_sigkill_anywhere_resumes_to_the_uninterrupted_run(recipe_dict, tmp_path, monkeypatch):
    raw = dict(
        recipe_dict,
        lora=dict(recipe_dict["lora"], dropout=0.1),  # the RNG state must be restored for the same masks
        training=dict(recipe_dict["training"], max_steps=6),
        checkpointing={"save_every": 1, "keep_last": 2},
        logging={"tensorboard": False, "every": 1},
    )
    ref = finetuner.train(Recipe.from_dict(dict(raw, output_dir=str(tmp_path / "ref"))))
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", dict(raw, output_dir=str(run_dir)))
    ckpts = run_dir / "checkpoints"

    def killed_by(fault: str) -> None:
        monkeypatch.setenv("FINETUNER_FAULT", fault)
        out = run_cli("run", str(recipe), "--quiet")
        assert out.returncode == -9, out.stderr  # SIGKILL: nothing of the process ran after it

    killed_by("KILL@2")  # right after step 2 (and its checkpoint)
    killed_by("KILL@save:4")  # resumed from 2; dies inside the checkpoint of step 4
    partial = ckpts / ".tmp-step-00000004"
    assert (partial / "adapter").is_dir() and not (partial / "trainer_state.json").exists()
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000003"]
    killed_by("KILL@events:5")  # resumed from 3; dies halfway through the line of step 5
    assert not (run_dir / "events.jsonl").read_text(encoding="utf-8").endswith("\n")
    monkeypatch.delenv("FINETUNER_FAULT")
    out = run_cli("run", str(recipe), "--quiet")
    assert out.returncode == 0, out.stderr

    events = read_events(run_dir / "events.jsonl")
    assert [e["resumed_from_step"] for e in events if e["event"] == "start"] == [None, 2, 3, 4]
    lines = (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    broken = []
    for line in lines:
        try:
            json.loads(line)
        except json.JSONDecodeError:
            broken.append(line)
    # the cut line stays alone: the next run's first event starts on a line of its own
    assert len(broken) == 1 and broken[0].startswith('{"event": "step"') and broken[0].count('"event"') == 1
    last_loss = {e["step"]: e["loss"] for e in events if e["event"] == "step"}
    assert sorted(last_loss) == [1, 2, 3, 4, 5, 6]
    state = json.loads((ckpts / "step-00000006" / "trainer_state.json").read_text())
    assert state["losses"] == pytest.approx(ref.losses, abs=1e-6)
    assert [last_loss[s] for s in range(1, 7)] == pytest.approx(ref.losses, abs=1e-6)
    mine, theirs = _adapter(run_dir), _adapter(ref.run_dir)
    assert mine.keys() == theirs.keys()
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in mine) < 1e-6
    assert not list(ckpts.glob(".tmp-step-*"))  # the cut checkpoint was removed by the resume after it

"""Training that survives: out-of-memory back-off, unreadable checkpoints, the run lock, disk checks."""

from __future__ import annotations

import threading

import pytest
import yaml

import finetuner
from finetuner.errors import OutOfMemory, UserError
from finetuner.runs.events import read_events
from finetuner.config.recipe import Recipe
from tests.conftest import cli_in_process, run_cli, write_recipe


def run(recipe_dict, overrides=(), **kw):
    return finetuner.train(Recipe.from_dict(recipe_dict, overrides=list(overrides)), **kw)


def test_oom_backoff_halves_the_micro_batch_and_keeps_the_loss_curve(recipe_dict, tmp_path, monkeypatch):
    common = ["training.max_steps=6", "training.micro_batch_size=4", "training.gradient_accumulation=1"]
    monkeypatch.setenv("FINETUNER_FAULT", "OOM@3*2")
    backed = run(dict(recipe_dict, output_dir=str(tmp_path / "oom")), common)
    monkeypatch.delenv("FINETUNER_FAULT")
    small = run(dict(recipe_dict, output_dir=str(tmp_path / "small")), ["training.max_steps=6", "training.micro_batch_size=1", "training.gradient_accumulation=4"])
    assert backed.losses == pytest.approx(small.losses, abs=2e-4)
    events = read_events(tmp_path / "oom" / "events.jsonl")
    backoffs = [e for e in events if e["event"] == "oom_backoff"]
    assert [(e["step"], e["micro_batch_size"], e["gradient_accumulation"]) for e in backoffs] == [(3, 2, 2), (3, 1, 4)]
    saved = yaml.safe_load((tmp_path / "oom" / "recipe.yaml").read_text())
    assert (saved["training"]["micro_batch_size"], saved["training"]["gradient_accumulation"]) == (1, 4)
    steps = [e for e in events if e["event"] == "step"]
    assert [e["micro_batch_size"] for e in steps] == [4, 4, 1, 1, 1, 1]


def test_oom_gives_up_after_micro_batch_1_with_advice(recipe_dict, monkeypatch):
    monkeypatch.setenv("FINETUNER_FAULT", "OOM@2*inf")
    with pytest.raises(OutOfMemory, match=r"even with micro_batch_size 1 \(tried 2, 1\)") as e:
        run(recipe_dict, ["training.max_steps=4"])
    assert "gradient_checkpointing" in str(e.value)


def test_oom_give_up_from_the_cli_exits_3(recipe_dict, tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict)
    monkeypatch.setenv("FINETUNER_FAULT", "OOM@1*inf")
    r = cli_in_process("run", str(recipe))
    assert r.returncode == 3 and "Out of device memory" in r.stderr and "Traceback" not in r.stderr


def test_unreadable_checkpoint_falls_back_to_the_previous_one(recipe_dict, tmp_path):
    stop = threading.Event()
    cb = lambda ev: ev["event"] == "step" and ev["step"] == 6 and stop.set()  # noqa: E731
    d = dict(recipe_dict, checkpointing={"save_every": 2, "keep_last": 3})
    run(d, ["training.max_steps=8"], callbacks=[cb], stop_event=stop)
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    weights = ckpts / "step-00000006" / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    res = run(d, ["training.max_steps=8"])
    events = read_events(tmp_path / "run" / "events.jsonl")
    assert any(e["event"] == "checkpoint_invalid" and "step-00000006" in e["path"] for e in events)
    assert [e for e in events if e["event"] == "start"][-1]["resumed_from_step"] == 4
    assert res.metrics["steps"] == 8


def test_a_second_process_on_the_same_run_folder_is_refused(recipe_dict, tmp_path):
    from finetuner.runs.folder import RunLock
    from finetuner.run_marker import mark_run_folder

    (tmp_path / "run").mkdir()
    mark_run_folder(tmp_path / "run")  # a run folder as finetuner sets it up
    write_recipe(tmp_path / "run" / "recipe.yaml", recipe_dict)
    lock = RunLock(tmp_path / "run").acquire()
    try:
        recipe = write_recipe(tmp_path / "r.yaml", recipe_dict)
        r = cli_in_process("run", str(recipe))
        assert r.returncode == 2 and "Another finetuner process" in r.stderr
    finally:
        lock.release()


def test_low_disk_fails_before_training(recipe_dict, monkeypatch):
    import shutil
    from collections import namedtuple

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(UserError, match="Not enough free disk space"):
        run(recipe_dict)


def test_sigterm_saves_a_checkpoint(recipe_dict, tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict)
    monkeypatch.setenv("FINETUNER_FAULT", "TERM@2")
    r = run_cli("run", str(recipe))
    assert r.returncode == 143  # 128 + SIGTERM, the shell's convention (Ctrl-C, SIGINT: 130)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert (ckpt / "optimizer.pt").exists() and (ckpt / "recipe.yaml").exists()


@pytest.mark.parametrize("gc", [True, False])
def test_activation_offload_keeps_the_loss_curve(recipe_dict, tmp_path, gc):
    common = ["training.max_steps=5", f"training.gradient_checkpointing={str(gc).lower()}", "lora.dropout=0.1"]
    plain = run(dict(recipe_dict, output_dir=str(tmp_path / "plain")), common)
    off = run(dict(recipe_dict, output_dir=str(tmp_path / "off")), common + ["training.offload_activations=true"])
    assert off.losses == pytest.approx(plain.losses, abs=1e-5)


def test_offloaded_checkpointing_is_installed_and_trains_every_layer(recipe_dict):
    from finetuner.model.loading import load_base_model, prepare_for_training
    from finetuner.config.runtime import resolve_runtime
    from finetuner.model.offload import offloaded_checkpoint
    from finetuner.model.scoring import token_loss_sum

    import torch

    r = Recipe.from_dict(recipe_dict, ["training.gradient_checkpointing=true", "training.offload_activations=true"])
    model = prepare_for_training(load_base_model(r, resolve_runtime(r)), r)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers and all(m._gradient_checkpointing_func is offloaded_checkpoint for m in layers)
    model.train()
    ids = torch.randint(3, 300, (2, 16))
    loss, _ = token_loss_sum(model, {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    loss.backward()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)


def test_the_space_a_resume_needs_counts_the_checkpoints_already_on_disk(tmp_path):
    """A resume with its keep_last checkpoints on disk needs room for one more being written and the
    adapter, not for keep_last more: the advice after a full disk names what the resume's check asks."""
    import torch

    from finetuner.runs.folder import checkpoint_bytes, disk_space_needed

    model = torch.nn.Linear(100, 100)
    one = checkpoint_bytes(model, "adamw")
    run = tmp_path / "run"
    assert disk_space_needed(run, model, "adamw", 3) == (one, 3, 5 * one)  # a new run: 3 kept + 1 written + adapter
    for step in (2, 4):
        (run / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").write_text("{}")
    assert disk_space_needed(run, model, "adamw", 3) == (one, 1, 3 * one)
    assert disk_space_needed(run, model, "adamw", 2) == (one, 0, 2 * one)

"""Resuming is exact on several processes too, and checkpoint pruning never loses the newest.

- Every rank saves its own RNG state in each checkpoint (``rng_rank{N}.pt``) and gets it back on
  resume: a two-process DDP run with LoRA dropout, stopped mid-way and resumed, logs the same
  per-step losses as the run that was never interrupted (with rank 0's state on every rank, as
  before, rank 1's dropout masks changed and the losses with them, by ~1e-3).
- When every checkpoint of a run is unreadable, the restarted run's new checkpoints are kept
  and the corrupt ones are the ones pruned.
"""

from __future__ import annotations

import pytest
import torch

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.runs.events import read_events
from finetuner.training import checkpoint as ckpt_io
from tests.training.test_distributed import without_deepspeed  # noqa: F401  (a fixture)


def _step_losses(run_dir) -> dict[int, float]:
    """The loss of each step as events.jsonl last logged it (a resumed run logs its steps again)."""
    return {e["step"]: e["loss"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"}


def test_a_two_process_run_stopped_and_resumed_logs_the_losses_of_the_uninterrupted_run(
    recipe_dict, tmp_path, monkeypatch, without_deepspeed  # noqa: F811
):
    raw = dict(
        recipe_dict,
        lora=dict(recipe_dict["lora"], dropout=0.1),  # each rank draws its own dropout masks
        training=dict(recipe_dict["training"], max_steps=4),
        checkpointing={"save_every": 10, "keep_last": 2},
        logging={"tensorboard": False, "every": 1},
        distributed={"strategy": "ddp", "num_processes": 2},
    )
    ref = finetuner.train(Recipe.from_dict(dict(raw, output_dir=str(tmp_path / "ref"))))
    assert not ref.stopped
    recipe = Recipe.from_dict(dict(raw, output_dir=str(tmp_path / "run")))
    monkeypatch.setenv("FINETUNER_FAULT", "INT@2")  # every rank gets SIGINT after step 2: they stop and save together
    assert finetuner.train(recipe).stopped
    monkeypatch.delenv("FINETUNER_FAULT")
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in ckpt.glob("rng*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    states = [torch.load(ckpt / f"rng_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert not torch.equal(states[0]["cpu"], states[1]["cpu"])  # the ranks' generators did diverge
    assert set(states[0]) >= {"python", "numpy", "cpu"}
    result = finetuner.train(recipe)
    assert not result.stopped and result.metrics["steps"] == 4
    starts = [e["resumed_from_step"] for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "start"]
    assert starts == [None, 2]
    want, got = _step_losses(ref.run_dir), _step_losses(tmp_path / "run")
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    # the same computation on the same states, in the same order, with gloo's deterministic sums:
    # equal to the last bit (restoring rank 0's state on rank 1 moved steps 3 and 4 by ~1e-3)
    assert [got[s] for s in range(1, 5)] == [want[s] for s in range(1, 5)]


def _run_until(raw: dict, stop_after: int, max_steps: int):
    """A single-process run of ``raw`` that the user stops after step ``stop_after``."""
    import threading

    stop = threading.Event()
    cb = lambda ev: ev["event"] == "step" and ev["step"] == stop_after and stop.set()  # noqa: E731
    return finetuner.train(Recipe.from_dict(raw, overrides=[f"training.max_steps={max_steps}"]), callbacks=[cb], stop_event=stop)


def test_after_every_checkpoint_was_unreadable_pruning_keeps_the_new_ones_and_removes_the_corrupt(recipe_dict, tmp_path):
    raw = dict(recipe_dict, checkpointing={"save_every": 2, "keep_last": 2})
    ckpts = tmp_path / "run" / "checkpoints"
    assert _run_until(raw, 8, 10).stopped
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000006", "step-00000008"]
    for name in ("step-00000006", "step-00000008"):  # every checkpoint truncated: nothing to resume from
        weights = ckpts / name / "adapter" / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])

    # the restarted run begins again at step 0 and saves steps 2 and 4 (more than keep_last with the corrupt ones)
    assert _run_until(raw, 4, 10).stopped
    events = read_events(tmp_path / "run" / "events.jsonl")
    assert [e["resumed_from_step"] for e in events if e["event"] == "start"] == [None, None]
    assert sum(e["event"] == "checkpoint_invalid" for e in events) == 2
    # the new checkpoints are kept, the corrupt ones (of later steps, from before the restart) removed
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004"]
    for ckpt in ckpt_io.checkpoint_dirs(tmp_path / "run"):
        assert ckpt_io.read_checkpoint(ckpt)["state"]["step"] == int(ckpt.name[5:])

    # so the next run continues from the restarted run's progress, not from scratch once more
    result = finetuner.train(Recipe.from_dict(raw, overrides=["training.max_steps=6"]))
    assert result.metrics["steps"] == 6
    starts = [e["resumed_from_step"] for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "start"]
    assert starts == [None, None, 4]


def test_a_checkpoint_of_an_older_version_with_one_rng_file_still_resumes(recipe_dict, tmp_path, caplog):
    raw = dict(recipe_dict, lora=dict(recipe_dict["lora"], dropout=0.1), checkpointing={"save_every": 2, "keep_last": 2})
    ref = finetuner.train(Recipe.from_dict(dict(raw, output_dir=str(tmp_path / "ref")), overrides=["training.max_steps=4"]))
    assert _run_until(raw, 2, 4).stopped
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    new = torch.load(ckpt / "rng_rank0.pt", weights_only=True)
    torch.save({"cpu": new["cpu"]}, ckpt / "rng.pt")  # what versions before rng_rank{N}.pt wrote
    (ckpt / "rng_rank0.pt").unlink()
    # several processes: every rank gets rank 0's state, and rank 0 says the resume is not exact
    with caplog.at_level("WARNING", logger="finetuner.training.checkpoint"):
        parts = [ckpt_io.read_checkpoint(ckpt, rank=r, world_size=2) for r in (0, 1)]
    assert all(torch.equal(p["rng"]["cpu"], new["cpu"]) for p in parts)
    assert "holds no random-generator state of rank 1 " in caplog.text and "rank 0's is used instead" in caplog.text
    # one process: rank 0's state is its own, so the resume is exact
    result = finetuner.train(Recipe.from_dict(raw, overrides=["training.max_steps=4"]))
    assert [e["resumed_from_step"] for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "start"] == [None, 2]
    assert result.losses == ref.losses

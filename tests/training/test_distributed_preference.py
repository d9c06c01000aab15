"""Preference objectives on several processes: DPO (DDP and ZeRO-2) and KTO on two CPU
processes (torchrun or spawned ranks, gloo) follow the single-process run with the same effective
batch: the loss, the rewards of every step (summed over the ranks' pairs, the zero-weight padding
pass of a rank with fewer micro-batches not counted), the evaluation's loss and rewards (the same
on every rank) and the adapter. A ``precomputed`` reference, an out-of-memory back-off on one rank
and a stop and resume give the same run again.

The runs are tiny (a 2-layer model, 6 steps of at most 6 pairs): each two-process run takes
seconds, most of it the processes starting.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.runs.events import read_events
from tests.conftest import free_port
from tests.training.test_distributed import _adapter, _max_diff, _rank0_only, deepspeed, without_deepspeed  # noqa: F401  (fixtures)
from tests.training.test_preference import pair_rows, pref_recipe

REWARDS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
EVAL = ("eval_loss", *(f"eval_{k}" for k in REWARDS))
TOL = 1e-5  # as the SFT two-process tests: fp32 sums of the same terms in another order


def dpo_recipe(tiny_model_dir, data, tmp_path, name):
    """23 training pairs (4 held out), 6 pairs a step as 3 micro-batches of 2: steps 1-3 and 5-6
    take 6 pairs, step 4 (the epoch's last) 5. On two processes a step of 6 is two micro-batches per
    rank, and step 4 is split 3 + 2: rank 1 has one micro-batch and runs a zero-weight pass."""
    raw = pref_recipe(tiny_model_dir, data, tmp_path, name=name, max_steps=6, micro_batch_size=2,
                      gradient_accumulation=3, eval_every=3)
    raw["checkpointing"] = {"save_every": 3, "keep_last": 2}
    return raw


@pytest.fixture(scope="module")
def dpo_one_process(tmp_path_factory, tiny_model_dir):
    """The single-process DPO run (reference: the base, adapter off) the two-process runs must follow."""
    tmp = tmp_path_factory.mktemp("dpo_one")
    data = tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pair_rows(27)), encoding="utf-8")
    raw = dpo_recipe(tiny_model_dir, data, tmp, "one")
    result = finetuner.train(Recipe.from_dict(raw))
    events = read_events(result.run_dir / "events.jsonl")
    assert [len(x) for x in (result.losses, [e for e in events if e["event"] == "eval"])] == [6, 2]
    return raw, result, events


def _of(events, kind, keys):
    return [{"step": e["step"], **{k: e[k] for k in keys}} for e in events if e["event"] == kind]


def _same_run(events, ref_events, run_dir, ref_dir):
    """Step losses and rewards, evaluations and the adapter as the single-process run's."""
    for kind, keys in (("step", ("loss", *REWARDS)), ("eval", EVAL)):
        got, want = _of(events, kind, keys), _of(ref_events, kind, keys)
        assert [g["step"] for g in got] == [w["step"] for w in want]
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=TOL), (kind, g, w)
    assert _max_diff(_adapter(run_dir), _adapter(ref_dir)) < TOL


def test_dpo_on_two_ddp_processes_matches_one_process(dpo_one_process, tmp_path, without_deepspeed):
    raw, ref, ref_events = dpo_one_process
    result = finetuner.train(Recipe.from_dict(dict(raw, output_dir=str(tmp_path / "ddp")), ["distributed.num_processes=2"]))
    events = _rank0_only(tmp_path / "ddp", 2)
    assert "DistributedDataParallel" in next(e for e in events if e["event"] == "distributed")["engine"]
    assert [e["reward_accuracy"] for e in events if e["event"] == "step"] != [0.0] * 6  # the rewards moved
    _same_run(events, ref_events, result.run_dir, ref.run_dir)
    assert result.metrics["eval_reward_margin"] == pytest.approx(ref.metrics["eval_reward_margin"], abs=TOL)


def test_dpo_on_zero2_two_processes_matches_one_process(deepspeed, dpo_one_process, tmp_path):
    """Through a DeepSpeed engine: the reference pass (adapter off) inside the engine's forward, its
    backward, its partitioned gradients, and rank 1's zero-weight pass in step 4."""
    raw, ref, ref_events = dpo_one_process
    raw = dict(raw, output_dir=str(tmp_path / "z2"), distributed={"strategy": "zero2", "num_processes": 2})
    result = finetuner.train(Recipe.from_dict(raw))
    events = read_events(result.run_dir / "events.jsonl")
    assert next(e for e in events if e["event"] == "distributed")["engine"] == "deepspeed"
    _same_run(events, ref_events, result.run_dir, ref.run_dir)


def test_dpo_precomputed_reference_out_of_memory_and_resume_on_two_processes(dpo_one_process, tmp_path, monkeypatch,
                                                                             without_deepspeed):
    """``reference: precomputed`` (each rank scores every pair at the start, rank 0 writes the file;
    with a fresh adapter it is the base's scores, so the run is the adapter-off one); rank 1 runs out
    of memory in step 3 (both ranks go to micro-batch 1 x 6), and every rank gets SIGINT after step 4:
    they stop together. The same recipe resumes (reading the saved reference) and ends on the
    single-process run."""
    raw, ref, ref_events = dpo_one_process
    raw = dict(raw, output_dir=str(tmp_path / "pre"), preference={"reference": "precomputed"})
    recipe = Recipe.from_dict(raw, ["distributed.num_processes=2"])
    monkeypatch.setenv("FINETUNER_FAULT", "OOM@3:1,INT@4")
    stopped = finetuner.train(recipe)
    assert stopped.stopped
    run_dir = tmp_path / "pre"
    reference = run_dir / "reference_logps.pt"
    written = reference.stat().st_mtime_ns
    monkeypatch.delenv("FINETUNER_FAULT")
    result = finetuner.train(recipe)
    assert not result.stopped and result.metrics["steps"] == 6
    assert reference.stat().st_mtime_ns == written  # read back, not scored again
    assert not list(run_dir.glob(".reference_logps*"))
    events = read_events(run_dir / "events.jsonl")
    assert [e["resumed_from_step"] for e in events if e["event"] == "start"] == [None, 4]
    (backoff,) = [e for e in events if e["event"] == "oom_backoff"]
    assert (backoff["step"], backoff["micro_batch_size"], backoff["gradient_accumulation"]) == (3, 1, 6)
    assert "on rank 1" in backoff["message"]
    assert [e["micro_batch_size"] for e in events if e["event"] == "step"] == [2, 2, 1, 1, 1, 1]
    _same_run(events, ref_events, run_dir, ref.run_dir)


# --------------------------------------------------------------------------- every rank's numbers
def _kto_rank(rank: int, world_size: int, port: int, recipe_dict: dict, out: str) -> None:
    """One rank of test_kto_on_two_processes... (started by multiprocessing, spawn), or with
    ``world_size`` 1 the single-process trainer (in the test's process): three steps, then an
    evaluation, recording what this rank got."""
    import torch

    from finetuner.training.trainer import Trainer

    recipe = Recipe.from_dict(recipe_dict)
    if world_size == 1:
        trainer = Trainer(recipe, Path(out))
    else:
        from finetuner.training.distributed import DistributedTrainer, init_rank

        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), ACCELERATE_USE_CPU="true")
        torch.set_num_threads(1)  # as torchrun's workers (OMP_NUM_THREADS=1): torch was imported before this ran
        trainer = DistributedTrainer(recipe, Path(out), init_rank(recipe))
    trainer.setup()
    steps = []
    for step in range(3):
        loss, _, _ = trainer.train_step(step)
        steps.append({"loss": loss, **trainer.objective.step_metrics()})
    eval_loss, eval_rewards = trainer.objective.evaluate(trainer)
    final = {n: p.detach().tolist() for n, p in trainer.model.named_parameters() if p.requires_grad}
    Path(out, f"rank{rank}-of-{world_size}.json").write_text(
        json.dumps({"steps": steps, "eval": {"eval_loss": eval_loss, **eval_rewards}, "final": final}))
    trainer.cleanup()  # a rank of several leaves its process group here (leave_process_group)
    assert not torch.distributed.is_initialized()


def test_kto_on_two_processes_every_rank_reports_the_one_process_rewards(tiny_model_dir, tmp_path, without_deepspeed):
    """KTO, 3 rated responses a step as 3 micro-batches of 1: on two processes rank 0 takes two and
    rank 1 one and a zero-weight pass. Both ranks report the single-process step rewards (the sums
    of all three responses, the padding pass not among them) and the same evaluation."""
    data = tmp_path / "rated.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Tell me about bird {i}."},
                          {"role": "assistant", "content": "Tern here! It nests on the cliff." if i % 3 else "A fish."}],
             "label": bool(i % 3)} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    raw = pref_recipe(tiny_model_dir, data, tmp_path, name="kto", micro_batch_size=1, gradient_accumulation=3)
    raw["objective"] = "kto"
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    ctx, port = multiprocessing.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_kto_rank, args=(r, 2, port, raw, str(tmp_path / "two"))) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        _kto_rank(0, 1, 0, raw, str(tmp_path / "one"))  # the single-process trainer, here, meanwhile
    finally:
        for proc in procs:
            proc.join(240)
    assert [proc.exitcode for proc in procs] == [0, 0]
    one, *ranks = [json.loads(p.read_text()) for p in (tmp_path / "one" / "rank0-of-1.json",
                                                      *(tmp_path / "two" / f"rank{r}-of-2.json" for r in range(2)))]
    assert one["steps"][-1]["reward_margin"] != one["steps"][0]["reward_margin"]  # the rewards moved
    for got in ranks:
        for g, w in zip(got["steps"], one["steps"], strict=True):
            assert g == pytest.approx(w, abs=TOL)
        assert got["eval"] == pytest.approx(one["eval"], abs=TOL)
        assert max(abs(a - b) for k in one["final"] for a, b in zip(_flat(got["final"][k]), _flat(one["final"][k]))) < TOL
    assert ranks[0]["steps"] == ranks[1]["steps"] and ranks[0]["eval"] == ranks[1]["eval"]  # the ranks agree exactly


def _flat(x):
    return [v for row in x for v in _flat(row)] if isinstance(x, list) else [x]

"""Out of memory: what counts as one, faults on one rank, and several processes backing off together."""

from __future__ import annotations

import json

import pytest
import yaml

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.errors import OutOfMemory
from finetuner.runs.events import read_events
from tests.training.test_distributed import _adapter, _max_diff, _rank0_only, one_process  # noqa: F401  (a fixture)
from tests.conftest import run_module


# --------------------------------------------------------------------------- without processes
def test_allocation_failures_that_surface_as_other_errors_count_as_out_of_memory():
    import torch

    from finetuner.training.oom import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.1 GiB total)"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not is_out_of_memory(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
    assert not is_out_of_memory(ValueError("CUDA out of memory"))  # not an error torch raises for it
    assert not is_out_of_memory(MemoryError())  # host memory: a smaller micro-batch is not the answer


def test_a_cublas_allocation_failure_in_a_step_is_backed_off(recipe_dict, tmp_path, monkeypatch):
    from finetuner.training import trainer as trainer_module

    real, calls = trainer_module.Trainer._micro_step, {"n": 0}

    def failing_once(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:  # step 3's first micro-batch (2 per step before)
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return real(self, *a, **kw)

    monkeypatch.setattr(trainer_module.Trainer, "_micro_step", failing_once)
    result = finetuner.train(Recipe.from_dict(recipe_dict, ["training.max_steps=4"]))
    backoff = next(e for e in read_events(result.run_dir / "events.jsonl") if e["event"] == "oom_backoff")
    assert (backoff["step"], backoff["micro_batch_size"], backoff["gradient_accumulation"]) == (3, 1, 4)
    assert "CUBLAS_STATUS_ALLOC_FAILED" in backoff["message"] and result.metrics["steps"] == 4


def test_the_failed_attempts_tensors_are_freed_before_the_back_off(recipe_dict, monkeypatch):
    """Memory is given back after the ``except`` block: by the time the cache is emptied nothing
    (no traceback, no frame) holds the tensors of the attempt that failed."""
    import weakref

    import torch

    from finetuner.training import backoff
    from finetuner.training import trainer as trainer_module

    held, alive_at_free = [], []
    real_step, real_free = trainer_module.Trainer._micro_step, backoff.free_after_oom

    def failing_first(self, *a, **kw):
        if not held:
            activations = torch.ones(1 << 16)  # what a pass holds when the allocator gives up
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(self, *a, **kw)

    def spy(optimizer, is_cuda):
        alive_at_free.append(held[0]() is not None)
        real_free(optimizer, is_cuda)

    monkeypatch.setattr(trainer_module.Trainer, "_micro_step", failing_first)
    monkeypatch.setattr(backoff, "free_after_oom", spy)
    result = finetuner.train(Recipe.from_dict(recipe_dict, ["training.max_steps=1"]))
    assert alive_at_free == [False] and result.metrics["steps"] == 1


def test_fault_specs_with_a_rank_and_inside_writes():
    from finetuner.training.faults import FaultPlan

    plan = FaultPlan("OOM@3:1, OOM@5*2, KILL@save:4, KILL@events:2:0, TERM@7:1")
    plan.in_step(3, rank=0)  # not rank 0's fault
    with pytest.raises(Exception, match="in step 3 on rank 1"):
        plan.in_step(3, rank=1)
    plan.in_step(3, rank=1)  # once
    for _ in range(2):
        with pytest.raises(Exception, match="in step 5"):
            plan.in_step(5, rank=0)
    plan.in_step(5, rank=0)
    assert plan.wants_kill_in("save") and plan.wants_kill_in("events")
    assert plan.kills_in == {"save": {(4, None)}, "events": {(2, 0)}}
    import signal

    assert plan.signals == {(7, 1): signal.SIGTERM}
    assert not FaultPlan("KILL@5").wants_kill_in("save")
    # a full disk is no fault of the plan: tests/training/test_full_disk.py fills a real file system
    for bad in ("OOM3", "KILL@save", "OOM@save:3", "KILL@disk:3", "BOOM@3", "OOM@3:1:2", "FULL@shards:4"):
        with pytest.raises(ValueError, match="FINETUNER_FAULT"):
            FaultPlan(bad)



def test_a_hold_fault_holds_after_its_step_while_the_gate_file_exists(tmp_path, monkeypatch):
    """``HOLD@4``: after step 4 the run waits for as long as the gate file exists, and no longer;
    a stop asked for ends it; other steps pass; without a gate file named the spec is refused."""
    import threading

    from finetuner.training.faults import HOLD_ENV, FaultPlan

    gate = tmp_path / "gate"
    monkeypatch.setenv(HOLD_ENV, str(gate))
    plan = FaultPlan("HOLD@4")
    gate.touch()
    plan.after_step(3)  # not its step: returns although the gate exists
    held = threading.Thread(target=plan.after_step, args=(4,), daemon=True)
    held.start()
    held.join(0.5)
    assert held.is_alive()  # it cannot return while the gate exists
    gate.unlink()
    held.join(30)
    assert not held.is_alive()
    plan.after_step(4)  # no gate: passes at once
    gate.touch()
    plan.after_step(4, stopping=lambda: True)  # a stop asked for ends the hold (the run then stops)
    gate.unlink()
    monkeypatch.delenv(HOLD_ENV)
    with pytest.raises(ValueError, match=f"HOLD@4 needs {HOLD_ENV}"):
        FaultPlan("HOLD@4")
    with pytest.raises(ValueError, match="FINETUNER_FAULT"):
        FaultPlan("HOLD@save:4")
    # HOLD@POINT, inside a one-off write (finetuner.fileio.hold): no step; a trainer's plan accepts it and holds no step
    monkeypatch.setenv(HOLD_ENV, str(gate))
    assert FaultPlan("HOLD@adapter, HOLD@2").hold_points == {"adapter"} and FaultPlan("HOLD@merge").holds == set()
    for bad in ("HOLD@merge:3", "HOLD@write", "KILL@export"):
        with pytest.raises(ValueError, match="FINETUNER_FAULT"):
            FaultPlan(bad)

# --------------------------------------------------------------------------- two processes
def test_out_of_memory_on_one_rank_backs_off_every_rank_and_keeps_the_loss(one_process, tmp_path, monkeypatch):
    """Only rank 1 fails in step 3: the ranks agree, both go from micro-batch 2 x 2 to 1 x 4 (the same
    effective batch and the same split of the step) and land on the run without the fault."""
    base, ref = one_process
    monkeypatch.setenv("FINETUNER_FAULT", "OOM@3:1")
    recipe = Recipe.from_dict(dict(base, output_dir=str(tmp_path / "oom")), ["distributed.num_processes=2"])
    result = finetuner.train(recipe)
    run_dir = tmp_path / "oom"
    events = _rank0_only(run_dir, 2)  # one writer: one start, one done, steps 1..6
    (backoff,) = [e for e in events if e["event"] == "oom_backoff"]  # written once, by rank 0
    assert (backoff["step"], backoff["old_micro_batch_size"], backoff["micro_batch_size"], backoff["gradient_accumulation"]) == (3, 2, 1, 4)
    assert "on rank 1" in backoff["message"]
    assert [e["micro_batch_size"] for e in events if e["event"] == "step"] == [2, 2, 1, 1, 1, 1]
    saved = yaml.safe_load((run_dir / "recipe.yaml").read_text())["training"]
    assert (saved["micro_batch_size"], saved["gradient_accumulation"]) == (1, 4)
    state = json.loads((run_dir / "checkpoints" / "step-00000006" / "trainer_state.json").read_text())
    assert state["micro_batch_size"] * state["gradient_accumulation"] == 4  # the effective batch
    assert result.losses == pytest.approx(ref.losses, abs=1e-5)
    assert _max_diff(_adapter(run_dir), _adapter(ref.run_dir)) < 1e-5


def test_out_of_memory_at_micro_batch_1_on_several_processes_ends_the_run(one_process, tmp_path, monkeypatch):
    base, _ = one_process
    monkeypatch.setenv("FINETUNER_FAULT", "OOM@2*inf:1")
    training = dict(base["training"], micro_batch_size=1, gradient_accumulation=4)
    recipe = Recipe.from_dict(dict(base, output_dir=str(tmp_path / "fail"), training=training), ["distributed.num_processes=2"])
    with pytest.raises(OutOfMemory, match=r"Out of device memory in step 2 on 2 processes even with micro_batch_size 1"):
        finetuner.train(recipe)
    events = read_events(tmp_path / "fail" / "events.jsonl")
    assert events[-1]["event"] == "error" and events[-1]["type"] == "OutOfMemory"
    assert [e["event"] for e in events].count("error") == 1  # rank 0 alone writes


def test_out_of_memory_under_zero_ends_the_run_together_and_the_same_command_resumes_smaller(one_process, tmp_path, monkeypatch):
    """A DeepSpeed engine cannot lower its micro-batch while it runs: the ranks agree and stop (exit 3)
    with the backed-off values in the run's recipe.yaml; the same command resumes with them
    (deepspeed.json written from them) and lands on the run without the fault."""
    from tests.conftest import run_cli, write_recipe

    base, ref = one_process
    monkeypatch.setenv("FINETUNER_FAULT", "OOM@5:1")
    raw = dict(base, output_dir=str(tmp_path / "z2"), distributed={"strategy": "zero2", "num_processes": 2})
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    out = run_cli("run", str(recipe))
    assert out.returncode == 3, out.stderr + out.stdout
    assert "Out of device memory in step 5 on 2 processes (micro_batch_size 2; " in out.stderr and "on rank 1" in out.stderr
    assert "recipe.yaml now has micro_batch_size 1 and gradient_accumulation 4" in out.stderr
    assert "run the same command again" in out.stderr
    events = read_events(tmp_path / "z2" / "events.jsonl")
    assert [e["event"] for e in events].count("error") == 1 and events[-1]["type"] == "OutOfMemory"
    assert [e["event"] for e in events].count("oom_backoff") == 1
    saved = yaml.safe_load((tmp_path / "z2" / "recipe.yaml").read_text())["training"]
    assert (saved["micro_batch_size"], saved["gradient_accumulation"]) == (1, 4)
    monkeypatch.delenv("FINETUNER_FAULT")
    resumed = run_cli("run", str(recipe))
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    ds = json.loads((tmp_path / "z2" / "distributed" / "deepspeed.json").read_text())
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (1, 2, 4)
    events = read_events(tmp_path / "z2" / "events.jsonl")
    assert [e["resumed_from_step"] for e in events if e["event"] == "start"] == [None, 3]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["micro_batch_size"] for e in steps[-3:]] == [1, 1, 1]
    assert [e["loss"] for e in steps[-3:]] == pytest.approx(ref.losses[-3:], abs=1e-5)


def test_the_gpu_oom_script_runs_its_smoke_check(tmp_path):
    """``python -m scripts.validate.oom_backoff --smoke``: the CPU stand-in of the GPU check (an
    injected error instead of a real one) runs end to end and reports the recovery."""
    import os

    from tests.conftest import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FINETUNER_FAULT", None)
    out = run_module("scripts.validate.oom_backoff", "--smoke", "--steps", "3", "--out", str(tmp_path), cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "oom_backoff_smoke.json").read_text())
    assert report["recovered"] and report["mode"] == "smoke (injected fault)"
    limited = report["limited"]
    assert [(b["step"], b["old_micro_batch_size"], b["micro_batch_size"]) for b in limited["backoffs"]] == [(2, 4, 2), (2, 2, 1)]
    assert limited["micro_batch_per_step"] == [4, 1, 1] and report["max_loss_diff"] < 1e-4


def test_a_rank_waits_for_rank_0s_error_event_before_exiting(tmp_path):
    """On a stop the ranks agreed on, a rank other than 0 exits only once rank 0 wrote the run's error event (else
    torchrun could end rank 0 before it and the launcher would not see the stop), and not forever."""
    import threading

    from finetuner.runs.events import EventWriter
    from finetuner.training.distributed import wait_for_the_error_event

    events = tmp_path / "events.jsonl"
    log = EventWriter(events)
    threading.Timer(0.3, lambda: log.error(RuntimeError("simulated"))).start()
    assert wait_for_the_error_event(events, timeout=30)
    assert not wait_for_the_error_event(tmp_path / "none.jsonl", timeout=0.2)

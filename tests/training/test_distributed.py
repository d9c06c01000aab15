"""Multi-process training on CPU for real: torchrun, gloo, DDP through accelerate, DeepSpeed ZeRO.

Every strategy the planner can choose (finetuner.memory.sharding.candidate_strategies: ddp,
zero1-3, ZeRO-Offload of the optimizer and of the parameters) runs here on two processes with
the same effective batch and must follow the single-process run (loss and adapter); so do two
nodes on 127.0.0.1. Only rank 0 writes; Ctrl-C of the launcher leaves no process behind; the
configs are saved in the run folder. ``fsdp`` (torch FSDP2) has its own file, test_fsdp.py.

DeepSpeed is needed by the ZeRO tests only (their ``deepspeed`` fixture); the DDP run and the
tests without processes run with it hidden. DeepSpeedCPUAdam (the default of offload) is a C++
extension built once into ``$TORCH_EXTENSIONS_DIR`` (``.cache/torch_extensions``) by the
``cpu_adam_built`` fixture (tests/conftest.py) of the offload tests, the first time one runs.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file

import finetuner
from finetuner.errors import UserError
from finetuner.runs.events import read_events
from finetuner.config.recipe import Recipe
from tests.conftest import REPO, HANG_GUARD_S, Planted, free_port, run_cli, write_recipe


@pytest.fixture
def deepspeed():
    """The ZeRO tests need DeepSpeed (the ``test`` and ``distributed`` extras); with CI=true its absence fails them."""
    return pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -c constraints.txt -e '.[test]')")


@pytest.fixture
def without_deepspeed(tmp_path, monkeypatch):
    """DeepSpeed hidden from this process and from every process it starts (as if not installed):
    ``import deepspeed`` fails and ``importlib.util.find_spec`` finds nothing, which is what
    accelerate and transformers check."""
    import importlib.util

    site = tmp_path / "no_deepspeed"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None\n", encoding="utf-8")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert importlib.util.find_spec("deepspeed") is None
    return site


def _recipe(recipe_dict, tmp_path, name, **distributed):
    r = dict(recipe_dict, output_dir=str(tmp_path / name))
    r["training"] = dict(r["training"], max_steps=6)
    r["checkpointing"] = {"save_every": 3, "keep_last": 2}
    if distributed:
        r["distributed"] = distributed
    return r


def _train(recipe_dict, overrides=(), **kw):
    return finetuner.train(Recipe.from_dict(recipe_dict, overrides=list(overrides)), **kw)


def _adapter(run_dir: Path) -> dict:
    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def reference_recipe(tmp: Path, model_dir: Path) -> dict:
    """The recipe the multi-process tests compare with one process: LoRA r8 on the tiny model, the
    alpaca rows written into ``tmp``, micro-batch 2 x accumulation 2, 6 steps, a checkpoint every 3."""
    from tests.conftest import alpaca_rows

    data = tmp / "alpaca.json"
    data.write_text(json.dumps(alpaca_rows()), encoding="utf-8")
    return {
        "name": "test",
        "model": {"name": str(model_dir)},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64},
        "training": {"max_steps": 6, "lr": 5e-3, "micro_batch_size": 2, "gradient_accumulation": 2, "warmup_steps": 0},
        "checkpointing": {"save_every": 3, "keep_last": 2},
        "logging": {"tensorboard": False},
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir):
    """The single-process reference run (micro-batch 2 x accumulation 2, 6 steps)."""
    tmp = tmp_path_factory.mktemp("one")
    base = reference_recipe(tmp, tiny_model_dir)
    result = _train(dict(base, output_dir=str(tmp / "run")))
    return base, result


def _rank0_only(run_dir: Path, world_size: int, per_node: int | None = None) -> list[dict]:
    events = read_events(run_dir / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds.count("start") == 1 and kinds.count("done") == 1  # one writer
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 7))
    dist = next(e for e in events if e["event"] == "distributed")
    assert dist["world_size"] == world_size and dist["backend"] == "gloo"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    assert (run_dir / "metrics.json").is_file() and not (run_dir / ".stop").exists()
    assert (run_dir / "distributed" / "accelerate_config.yaml").is_file()
    launch = (run_dir / "distributed" / "launch.sh").read_text()
    assert f"--nproc_per_node={per_node or world_size}" in launch and "-m finetuner.training.distributed" in launch
    return events


def test_ddp_two_processes_match_one_process(one_process, tmp_path, without_deepspeed):
    base, ref = one_process
    recipe = write_recipe(tmp_path / "r.yaml", dict(base, output_dir=str(tmp_path / "ddp")))
    out = run_cli("run", str(recipe), "--gpus", "2", "--quiet")
    assert out.returncode == 0, out.stderr + out.stdout
    run_dir = tmp_path / "ddp"
    events = _rank0_only(run_dir, 2)
    assert "DistributedDataParallel" in next(e for e in events if e["event"] == "distributed")["engine"]
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert losses == pytest.approx(ref.losses, abs=1e-5)
    assert _max_diff(_adapter(run_dir), _adapter(ref.run_dir)) < 1e-5
    acc = yaml.safe_load((run_dir / "distributed" / "accelerate_config.yaml").read_text())
    assert acc["distributed_type"] == "MULTI_CPU" and acc["num_processes"] == 2 and acc["use_cpu"] is True


def test_zero2_two_processes_match_one_process_and_resume_after_stop(deepspeed, one_process, tmp_path, monkeypatch):
    """Each rank gets SIGINT after step 3: they stop together with a ZeRO checkpoint; the resume finishes."""
    base, ref = one_process
    recipe = Recipe.from_dict(dict(base, output_dir=str(tmp_path / "z2"), distributed={"strategy": "zero2", "num_processes": 2}))
    monkeypatch.setenv("FINETUNER_FAULT", "INT@3")
    stopped = finetuner.train(recipe)
    assert stopped.stopped
    monkeypatch.delenv("FINETUNER_FAULT")
    ckpt = tmp_path / "z2" / "checkpoints" / "step-00000003"
    shards = sorted(p.name for p in (ckpt / "deepspeed" / "state").glob("*optim_states.pt"))
    assert len(shards) == 2  # one optimizer shard per rank
    # sealed (finetuner.training.seal): DeepSpeed unpickles its state files when it resumes
    from finetuner.training import seal

    listed = json.loads((ckpt / seal.SEAL).read_text())["files"]
    assert {f"deepspeed/state/{n}" for n in shards} <= set(listed) and seal.is_ours(ckpt)
    # the same folder received by someone else, with a crafted state file: refused before DeepSpeed unpickles it
    import shutil

    import torch

    received, marker = tmp_path / "received", tmp_path / "code-ran"
    shutil.copytree(tmp_path / "z2", received, ignore=shutil.ignore_patterns(".lock"))
    torch.save({"optimizer_state_dict": Planted(marker)}, received / "checkpoints" / "step-00000003" / "deepspeed" / "state" / shards[0])
    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(tmp_path / "someone-else"))
    with pytest.raises(UserError, match=r"step-00000003 was not written by finetuner for this user on this machine"):
        finetuner.train(Recipe.from_dict(dict(base, output_dir=str(received), distributed={"strategy": "zero2", "num_processes": 2})))
    assert not marker.exists()
    monkeypatch.undo()  # this user again (and FINETUNER_FAULT gone)
    result = finetuner.train(recipe)
    assert not result.stopped and result.metrics["steps"] == 6
    events = read_events(tmp_path / "z2" / "events.jsonl")
    assert [e["event"] for e in events].count("stopped") == 1
    assert next(e for e in reversed(events) if e["event"] == "start")["resumed_from_step"] == 3
    assert result.losses == pytest.approx(ref.losses, abs=1e-5)
    assert _max_diff(_adapter(result.run_dir), _adapter(ref.run_dir)) < 1e-5
    ds = json.loads((tmp_path / "z2" / "distributed" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 4 and ds["gradient_accumulation_steps"] == 1


def test_zero_offload_full_fine_tune_on_cpu(deepspeed, one_process, tmp_path):
    """method full, ZeRO-2 with the optimizer states offloaded to CPU memory, one process, stepped
    by torch AdamW (cpu_adam: false; the default, DeepSpeedCPUAdam, runs in the two-process tests below)."""
    base, _ = one_process
    full = dict(base, method="full", training=dict(base["training"], lr=1e-3, max_steps=4), checkpointing={"save_every": 10})
    ref = _train(dict(full, output_dir=str(tmp_path / "plain")))
    off = _train(
        dict(full, output_dir=str(tmp_path / "offload")),
        ["distributed.strategy=zero2", "distributed.offload=optimizer", "distributed.cpu_adam=false"],
    )
    assert off.losses == pytest.approx(ref.losses, abs=1e-4)
    ds = json.loads((tmp_path / "offload" / "distributed" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert (tmp_path / "offload" / "adapter" / "model.safetensors").is_file()  # the whole model
    dist = next(e for e in read_events(tmp_path / "offload" / "events.jsonl") if e["event"] == "distributed")
    assert dist["world_size"] == 1 and dist["offload"] == "optimizer" and dist["optimizer"] == "AdamW"


def _logits_with_adapter(base_dir: Path, adapter_dir: Path):
    """The logits of a fixed prompt through the base with the saved adapter, loaded as a user loads it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter_dir)
    ids = torch.arange(3, 35).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(
    "strategy, offload",
    [("zero1", "none"), ("zero3", "none"), ("zero2", "optimizer"), ("zero3", "optimizer"), ("zero3", "optimizer+params")],
)
def test_zero_strategies_on_two_processes_match_one_process(deepspeed, one_process, tmp_path, strategy, offload, request):
    """The ZeRO strategies and offloads the planner chooses besides ddp and zero2 (tested above),
    on two processes: the losses and the saved adapter are the one-process run's. ZeRO-3 shards
    the LoRA weights too, so the adapter is gathered for saving: it holds the full tensors and
    loads with PeftModel.from_pretrained. Offload uses the default optimizer, DeepSpeedCPUAdam (its
    C++ extension is built once into $TORCH_EXTENSIONS_DIR: the cpu_adam_built fixture)."""
    import torch

    if offload != "none":
        request.getfixturevalue("cpu_adam_built")

    base, ref = one_process
    run_dir = tmp_path / strategy
    result = _train(dict(base, output_dir=str(run_dir), distributed={"strategy": strategy, "num_processes": 2, "offload": offload}))
    events = _rank0_only(run_dir, 2)
    dist = next(e for e in events if e["event"] == "distributed")
    assert (dist["strategy"], dist["offload"], dist["engine"]) == (strategy, offload, "deepspeed")
    assert dist["optimizer"] == ("AdamW" if offload == "none" else "DeepSpeedCPUAdam")
    ds = json.loads((run_dir / "distributed" / "deepspeed.json").read_text())["zero_optimization"]
    assert ds["stage"] == int(strategy[-1])
    assert ("offload_optimizer" in ds, "offload_param" in ds) == (offload != "none", offload == "optimizer+params")
    assert result.losses == pytest.approx(ref.losses, abs=1e-5)
    got, want = _adapter(run_dir), _adapter(ref.run_dir)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}  # full tensors, not shards
    assert _max_diff(got, want) < 1e-5
    ckpt = load_file(str(run_dir / "checkpoints" / "step-00000006" / "adapter" / "adapter_model.safetensors"))
    assert _max_diff(ckpt, want) < 1e-5  # the checkpoint's adapter is gathered too
    model_dir = Path(base["model"]["name"])
    assert torch.allclose(_logits_with_adapter(model_dir, run_dir / "adapter"), _logits_with_adapter(model_dir, ref.run_dir / "adapter"), atol=1e-4)


def test_a_rank_leaves_its_process_group_before_it_exits():
    """Every rank ends by destroying its process group (DistributedTrainer.cleanup calls
    leave_process_group), after its last collective: a rank that exits with the group alive can die
    by SIGABRT while Python tears down (see leave_process_group). One process on gloo, in this one."""
    import torch
    import torch.distributed as dist

    from finetuner.training.distributed import leave_process_group

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        t = torch.ones(4)
        dist.all_reduce(t, async_op=True).wait()
        leave_process_group()
        assert not dist.is_initialized()
        leave_process_group()  # a second call (a rank that failed early) does nothing
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_on_one_machine_match_one_process(one_process, tmp_path, strategy, without_deepspeed):
    """distributed.nodes 2: the same recipe launched twice on 127.0.0.1 (node_rank 0 and 1, one
    process each, one master address and port) trains one run in one shared run folder. Node 1
    starts first and waits for node 0 to prepare the folder; both commands end with the result."""
    base, ref = one_process
    run_dir, port = tmp_path / "nodes", free_port()
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (1, 0):
        recipe = write_recipe(tmp_path / f"node{node}.yaml", dict(base, output_dir=str(run_dir), distributed={
            "nodes": 2, "node_rank": node, "num_processes": 1, "master_addr": "127.0.0.1", "master_port": port,
            "strategy": strategy}))
        procs.append(subprocess.Popen([sys.executable, "-m", "finetuner.cli.main", "run", str(recipe), "--quiet"], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if node == 1:
            time.sleep(2)  # node 1 is up before node 0 has made the run folder
    outs = [proc.communicate(timeout=HANG_GUARD_S)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    assert "waiting for node 0" in outs[0]
    events = _rank0_only(run_dir, 2, per_node=1)
    dist = next(e for e in events if e["event"] == "distributed")
    assert dist["nodes"] == 2 and dist["strategy"] == strategy
    launch = (run_dir / "distributed" / "launch.sh").read_text()
    assert f"--nnodes=2 --node_rank=0 --master_addr=127.0.0.1 --master_port={port}" in launch and "--standalone" not in launch
    assert (run_dir / "distributed" / "launch-node1.log").is_file()
    assert [e["loss"] for e in events if e["event"] == "step"] == pytest.approx(ref.losses, abs=1e-5)
    assert _max_diff(_adapter(run_dir), _adapter(ref.run_dir)) < 1e-5
    again = finetuner.train(tmp_path / "node1.yaml")  # node 1 alone on the finished run: it waits for no one
    assert again.finished and "is finished" in again.finished


def _launch_and_interrupt(recipe_path: Path, run_dir: Path, presses: int) -> tuple[int, str, list[int]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetuner.cli.main", "run", str(recipe_path), "--gpus", "2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    events = run_dir / "events.jsonl"
    deadline = time.time() + HANG_GUARD_S
    while time.time() < deadline and proc.poll() is None:
        if events.exists() and '"event": "step"' in events.read_text():
            break
        time.sleep(0.3)
    assert proc.poll() is None, proc.communicate()[0]
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 3  # torchrun and its two workers
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    return proc.returncode, out, family


def _gone(pids: list[int]) -> bool:
    deadline = time.time() + 120  # a hang guard: idle, they are gone within a second
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_a_node_other_than_0_waits_for_node_0_then_says_what_to_start(recipe_dict, tmp_path, monkeypatch, without_deepspeed):
    from finetuner.training import launch

    monkeypatch.setattr(launch, "NODE_WAIT_S", 1.0)
    shared = tmp_path / "shared"
    recipe = Recipe.from_dict(dict(recipe_dict, output_dir=str(shared), distributed={"nodes": 2, "node_rank": 1}))
    with pytest.raises(UserError, match=f"distributed.node_rank: node 1 waited 1 s and node 0 has not prepared the run folder {shared}") as e:
        finetuner.train(recipe)
    assert "Start node 0 with the same recipe" in e.value.hint
    assert not shared.exists()  # nothing written where node 0 makes the run folder


@pytest.mark.parametrize("presses", [1, 2], ids=["stop-with-checkpoint", "abort"])
def test_ctrl_c_of_the_launcher_leaves_no_process(one_process, tmp_path, presses, without_deepspeed):
    base, _ = one_process
    long = dict(base, output_dir=str(tmp_path / "run"), training=dict(base["training"], max_steps=2000), checkpointing={"save_every": 1000})
    rc, out, family = _launch_and_interrupt(write_recipe(tmp_path / "r.yaml", long), tmp_path / "run", presses)
    assert rc == 130, out
    assert _gone(family), "a training process outlived the launcher"
    events = read_events(tmp_path / "run" / "events.jsonl")
    if presses == 1:  # all ranks stopped at the same step and saved one checkpoint
        stop = next(e for e in events if e["event"] == "stopped")
        assert (tmp_path / "run" / "checkpoints" / f"step-{stop['step']:08d}" / "adapter").is_dir()
    assert not (tmp_path / "run" / ".lock").exists() or not _locked(tmp_path / "run" / ".lock")


def _locked(path: Path) -> bool:
    import fcntl

    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def _ddp_rank_with_a_loss_scaler(rank: int, port: int, recipe_dict: dict, out: str) -> None:
    """One rank of test_fp16_loss_scaling_on_two_processes (started by multiprocessing, spawn)."""
    import torch

    from finetuner.training import optimizer as optimizer_module
    from finetuner.training.distributed import DistributedTrainer, init_rank

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    recipe = Recipe.from_dict(recipe_dict)
    trainer = DistributedTrainer(recipe, Path(out), init_rank(recipe))
    trainer.setup()
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)  # what an fp16 run gets on a GPU
    scalers_seen, shared_step = [], optimizer_module.optimizer_step

    def spy(optimizer, scheduler, params, max_grad_norm, scaler=None):
        scalers_seen.append(scaler)
        return shared_step(optimizer, scheduler, params, max_grad_norm, scaler)

    optimizer_module.optimizer_step = spy
    lora_b = next(p for n, p in trainer.model.named_parameters() if p.requires_grad and "lora_B" in n)
    poisoned = {"step": None}
    lora_b.register_hook(lambda g: g * math.inf if poisoned["step"] == 1 and rank == 1 else g)  # rank 1's gradient only
    records = []
    for step in range(3):
        poisoned["step"] = step
        before = [p.detach().clone() for p in trainer._trainable] if step else None
        loss, tokens, norm = trainer.train_step(step)
        changed = before is None or any(not torch.equal(b, p) for b, p in zip(before, trainer._trainable))
        records.append({"loss": loss, "grad_norm": norm, "scale": trainer.scaler.get_scale(), "changed": changed})
    final = {n: p.detach().tolist() for n, p in trainer.model.named_parameters() if p.requires_grad}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"steps": records, "scalers": [c is trainer.scaler for c in scalers_seen], "final": final}))
    trainer.cleanup()
    assert not torch.distributed.is_initialized()  # the rank left its process group (leave_process_group)


def test_fp16_loss_scaling_on_two_processes(one_process, tmp_path, without_deepspeed):
    """DDP on two processes steps through the single-process optimizer_step with the GradScaler:
    the gradient is unscaled before clipping (the first step's gradient norm is the one-process
    one), and an inf in one rank's gradient makes every rank skip that step and lower the scale.
    CPU training has no fp16 (the runtime refuses it), so the ranks get the GradScaler an fp16
    GPU run gets, for the CPU: its arithmetic is the same."""
    import multiprocessing

    from tests.conftest import free_port

    base, ref = one_process
    recipe = dict(base, output_dir=str(tmp_path), distributed={"strategy": "ddp", "num_processes": 2})
    ctx, port = multiprocessing.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_ddp_rank_with_a_loss_scaler, args=(r, port, recipe, str(tmp_path))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(240)
    assert [proc.exitcode for proc in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ref_steps = [e for e in read_events(ref.run_dir / "events.jsonl") if e["event"] == "step"]
    for got in ranks:
        assert got["scalers"] == [True, True, True]  # the shared optimizer step, given the trainer's scaler
        first, skipped, after = got["steps"]
        assert first["loss"] == pytest.approx(ref_steps[0]["loss"], abs=1e-5)
        assert first["grad_norm"] == pytest.approx(ref_steps[0]["grad_norm"], rel=1e-4)  # not 65536 times it
        assert first["scale"] == 2.0**16
        assert not math.isfinite(skipped["grad_norm"]) and not skipped["changed"] and skipped["scale"] == 2.0**15
        assert after["changed"] and math.isfinite(after["grad_norm"]) and after["scale"] == 2.0**15
    same = [[{**step, "grad_norm": str(step["grad_norm"])} for step in got["steps"]] for got in ranks]  # nan != nan
    assert same[0] == same[1] and ranks[0]["final"] == ranks[1]["final"]  # the ranks agree


# --------------------------------------------------------------------------- without processes
def test_split_step_gives_every_example_to_one_rank(without_deepspeed):
    from finetuner.training.schedule import split_step

    assert split_step(4, 1, 2) == [[(0, 1), (2, 3)], [(1, 2), (3, 4)]]  # whole micro-batches, interleaved
    assert split_step(8, 8, 2) == [[(0, 4)], [(4, 8)]]  # one micro-batch of 8: 4 examples each
    assert split_step(3, 2, 2) == [[(0, 2)], [(2, 3)]]
    assert split_step(1, 2, 2) == [[(0, 1)], []]  # a rank with nothing runs a zero-weight pass
    for n, mb, w in [(16, 4, 2), (17, 4, 3), (5, 2, 4), (7, 3, 2)]:
        shares = split_step(n, mb, w)
        covered = sorted(i for share in shares for s, e in share for i in range(s, e))
        assert covered == list(range(n))
        assert all(e - s <= mb for share in shares for s, e in share)


@pytest.mark.parametrize(
    "distributed, extra, key",
    [
        ({"strategy": "ddp", "offload": "optimizer"}, {}, "distributed.offload"),
        ({"strategy": "zero2", "offload": "optimizer+params"}, {}, "distributed.offload"),
        ({"strategy": "ddp", "fsdp_offload": True}, {}, "distributed.fsdp_offload"),
        ({"strategy": "zero3"}, {"method": "qlora"}, "distributed.strategy"),
        ({"strategy": "zero2"}, {"training": {"optimizer": "adamw_8bit"}}, "training.optimizer"),
        ({"nodes": 2, "node_rank": 2}, {}, "distributed.node_rank"),
        ({"strategy": "zero3", "nodes": 1, "num_processes": 0}, {}, "distributed.num_processes"),
    ],
)
def test_impossible_combinations_are_refused_with_the_key(recipe_dict, distributed, extra, key, without_deepspeed):
    raw = dict(recipe_dict, distributed=distributed)
    for k, v in extra.items():
        raw[k] = dict(raw[k], **v) if isinstance(v, dict) else v
    with pytest.raises(UserError) as e:
        Recipe.from_dict(raw)
    assert f"  - {key}:" in e.value.message


def test_a_zero_strategy_without_deepspeed_says_what_to_install(recipe_dict, tmp_path, without_deepspeed):
    recipe = Recipe.from_dict(dict(recipe_dict, output_dir=str(tmp_path / "z"), distributed={"strategy": "zero2", "num_processes": 2}))
    with pytest.raises(UserError, match="distributed.strategy: zero2 runs on DeepSpeed, which is not installed") as e:
        finetuner.train(recipe)
    assert "'.[distributed]'" in e.value.hint and not (tmp_path / "z").exists()


def test_the_generated_fsdp_and_deepspeed_configs_load_in_accelerate(recipe_dict, tmp_path, without_deepspeed):
    """``finetuner run`` trains fsdp itself (tests/training/test_fsdp.py); the accelerate config it saves
    beside the run is for users who launch with ``accelerate launch``."""
    from accelerate.commands.config.config_args import ClusterConfig

    from finetuner.config.runtime import Device, resolve
    from finetuner.training.launch import write_configs

    a100 = Device("cuda", bf16=True)
    recipe = Recipe.from_dict(dict(recipe_dict, distributed={"strategy": "fsdp", "num_processes": 2}, device="cpu"))
    paths = write_configs(recipe, tmp_path, resolve(recipe, a100, "llama"))
    cfg = ClusterConfig.from_yaml_file(str(paths["accelerate"]))
    assert cfg.distributed_type == "FSDP" and cfg.num_processes == 2
    assert cfg.fsdp_config["fsdp_version"] == 2 and cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    zero3 = Recipe.from_dict(dict(recipe_dict, distributed={"strategy": "zero3", "num_processes": 4, "offload": "optimizer+params"}))
    paths = write_configs(zero3, tmp_path / "z3", resolve(zero3, a100, "llama"))
    ds = json.loads(paths["deepspeed"].read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["train_batch_size"] == 2 * 1 * 4 and ds["bf16"]["enabled"]  # micro 2 x accumulation 1 per rank x 4
    acc = ClusterConfig.from_yaml_file(str(paths["accelerate"]))
    assert acc.distributed_type == "DEEPSPEED" and acc.deepspeed_config["deepspeed_config_file"] == "deepspeed.json"


def test_a_zero_checkpoint_resumes_only_with_the_same_strategy_and_process_count(recipe_dict, without_deepspeed):
    from finetuner.runs.folder import recipe_differences

    def d(**dist):
        return Recipe.from_dict(dict(recipe_dict, distributed=dist)).to_dict()

    assert recipe_differences(d(strategy="zero2", num_processes=2), d(strategy="zero2", num_processes=2)) == []
    assert recipe_differences(d(strategy="ddp", num_processes=2), d(strategy="ddp", num_processes=1)) == []  # DDP checkpoints are whole
    (diff,) = recipe_differences(d(strategy="zero2", num_processes=2), d(strategy="zero2", num_processes=4))
    assert "zero2 on 2 → zero2 on 4" in diff
    assert recipe_differences(d(strategy="ddp"), d(strategy="zero3"))


def test_the_ranks_interpreter_is_this_one_or_the_one_the_user_names(recipe_dict, monkeypatch):
    """``$FINETUNER_PYTHON`` stands for ``python`` in each rank's command (a wrapper command; the tests' ranks come
    from tests/zygote_child.py that way), and launch.sh shows it; torchrun itself runs on this interpreter."""
    from finetuner.children import PYTHON_ENV, module_args
    from finetuner.training.launch import torchrun_command

    rank = module_args("finetuner.training.distributed", "/runs/r", unbuffered=True)  # -u -P -m ... /runs/r
    recipe = Recipe.from_dict(dict(recipe_dict, distributed={"strategy": "ddp", "num_processes": 2}))
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    plain = torchrun_command(recipe, Path("/runs/r"))
    assert plain[plain.index("--no-python") + 1:] == [sys.executable, *rank]
    monkeypatch.setenv(PYTHON_ENV, "py-spy record -o 'rank profile.svg' -- /usr/bin/python3")
    wrapped = torchrun_command(recipe, Path("/runs/r"))
    assert wrapped[wrapped.index("--no-python") + 1:] == ["py-spy", "record", "-o", "rank profile.svg", "--", "/usr/bin/python3", *rank]
    assert wrapped[0] == sys.executable and wrapped[:wrapped.index("--no-python")] == plain[:plain.index("--no-python")]

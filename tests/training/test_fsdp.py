"""``distributed.strategy: fsdp``: torch FSDP2 (``fully_shard`` per decoder layer) on two CPU processes (gloo).

Each run here is compared with the same recipe on one process (the same effective batch): the
losses of every step and the saved adapter (or model) must agree. They agree to the last bit:
each rank computes whole micro-batches, the reduce-scatter sums the two ranks' gradients (one
addition, the one the single process makes when it accumulates its two micro-batches) and the
loss scale (x2 then /2) is exact; gloo's sums are deterministic. The tolerance asserted,
1e-5 relative for losses and 1e-5 absolute for weights (|w| < 0.2), leaves room for a reduction in
another order (fp32 rounding of a sum of two terms, ~6e-8 relative) and nothing more. QLoRA
dequantizes the same 4-bit bytes with the same block scales on both sides (the packed weights are
sharded and all-gathered as they are), so it is held to the same tolerance.

DeepSpeed is hidden from these runs (``without_deepspeed``): fsdp does not need it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.runs.events import read_events
from tests.conftest import Planted, run_cli, write_recipe
from tests.training.test_distributed import reference_recipe, without_deepspeed  # noqa: F401  (a fixture)

REL = 1e-5  # see the module's docstring
ABS_W = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    return reference_recipe(tmp_path_factory.mktemp("fsdp"), tiny_model_dir)


def _with(raw: dict, **sections) -> dict:
    out = dict(raw)
    for k, v in sections.items():
        out[k] = dict(out.get(k) or {}, **v) if isinstance(v, dict) else v
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"}


def _weights(run_dir: Path) -> dict:
    out: dict = {}
    for f in sorted((Path(run_dir) / "adapter").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_same_run(run_dir: Path, ref_dir: Path) -> tuple[float, float]:
    """Losses within REL and weights within ABS_W of the reference; returns the largest differences."""
    got, want = _losses(run_dir), _losses(ref_dir)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    rel = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert rel <= REL, (got, want)
    a, b = _weights(run_dir), _weights(ref_dir)
    assert a.keys() == b.keys() and a
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= ABS_W
    return rel, diff


def _fsdp_event(run_dir: Path) -> dict:
    return next(e for e in read_events(run_dir / "events.jsonl") if e["event"] == "distributed")


def _one_and_two(raw: dict, tmp_path: Path, name: str, **fsdp) -> tuple[Path, Path]:
    """The recipe on one process (no distributed section) and through the CLI on two fsdp processes."""
    ref = finetuner.train(Recipe.from_dict(dict(raw, output_dir=str(tmp_path / f"{name}-one"))))
    recipe = write_recipe(tmp_path / f"{name}.yaml", dict(raw, output_dir=str(tmp_path / f"{name}-fsdp")))
    sets = [a for k, v in fsdp.items() for a in ("--set", f"distributed.{k}={v}")]
    out = run_cli("run", str(recipe), "--gpus", "2", "--set", "distributed.strategy=fsdp", *sets, "--quiet")
    assert out.returncode == 0, out.stderr + out.stdout
    return ref.run_dir, tmp_path / f"{name}-fsdp"


def test_lora_on_two_fsdp_processes_matches_one_process(base, tmp_path, without_deepspeed):  # noqa: F811
    ref, run = _one_and_two(base, tmp_path, "lora")
    _assert_same_run(run, ref)
    event = _fsdp_event(run)
    assert event["strategy"] == "fsdp" and event["world_size"] == 2 and "FSDP2" in event["engine"]
    # the model was loaded once: rank 0 read all of it (the base's weights file, and the adapter it
    # added), rank 1 built it empty and received only its shards
    weights_file = sum(f.stat().st_size for f in Path(base["model"]["name"]).glob("*.safetensors"))
    rank0, rank1 = event["loaded_bytes"]
    assert rank1 == 0 and weights_file - 2**16 < rank0 < weights_file + 2**16, (event["loaded_bytes"], weights_file)
    # a checkpoint holds the gathered adapter and one shard file per rank
    ckpt = run / "checkpoints" / "step-00000006"
    assert sorted(p.name for p in (ckpt / "fsdp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and not (ckpt / "optimizer.pt").exists()
    # the adapter is a normal peft folder
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base["model"]["name"]), str(run / "adapter"))
    trained = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert trained and any(float(p.abs().max()) > 0 for p in trained.values())


def test_qlora_4bit_with_checkpointing_on_two_fsdp_processes_matches_one_process_and_shards_the_4bit_bytes(
    base, tmp_path, without_deepspeed  # noqa: F811
):
    raw = _with(base, method="qlora", quantization={"bits": 4}, training={"gradient_checkpointing": True})
    ref, run = _one_and_two(raw, tmp_path, "qlora")
    _assert_same_run(run, ref)
    storage = _fsdp_event(run)["quantized_storage"]
    assert storage["bits"] == 4 and len(storage["ranks"]) == 2
    # the tiny model: 2 layers x (q, k, v, o, gate, up, down); at 4 bits its linear weights take 73,728 bytes
    for rank in storage["ranks"]:
        assert rank["quantized_bytes"] == 73728
        assert rank["local_bytes"] == 73728 // 2  # each rank holds half of the packed 4-bit bytes
        assert rank["dtypes"] == ["float32"]  # bnb_4bit_quant_storage: the dtype FSDP gathers in


def test_full_fine_tune_on_two_fsdp_processes_matches_one_process(base, tmp_path, without_deepspeed):  # noqa: F811
    raw = _with(base, method="full", training={"lr": 1e-4})
    ref, run = _one_and_two(raw, tmp_path, "full")
    _assert_same_run(run, ref)


def test_activation_offload_with_checkpointing_on_two_fsdp_processes_matches_one_process(base, tmp_path, without_deepspeed):  # noqa: F811
    raw = _with(base, training={"gradient_checkpointing": True, "offload_activations": True})
    ref, run = _one_and_two(raw, tmp_path, "actoffload")
    _assert_same_run(run, ref)
    from finetuner.config.recipe_yaml import load_yaml

    resolved = load_yaml((run / "recipe.yaml").read_text(encoding="utf-8"), "recipe.yaml")
    assert resolved["training"]["offload_activations"] is True and resolved["distributed"]["strategy"] == "fsdp"


def test_cpu_offload_policy_on_two_fsdp_processes_matches_one_process(base, tmp_path, without_deepspeed):  # noqa: F811
    ref, run = _one_and_two(base, tmp_path, "offload", fsdp_offload="true")
    _assert_same_run(run, ref)
    assert _fsdp_event(run)["fsdp_offload"] is True


def _storage_of(model, world_size: int):
    """quantized_storage of ``model``'s decoder layers after fully_shard, in a one-process gloo group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from finetuner.training.strategies.fsdp import decoder_layers, quantized_storage

    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    assert dist.get_world_size() == 1
    return quantized_storage(layers, 4, world_size)


@pytest.fixture
def gloo_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_4bit_storage_check_refuses_weights_that_fsdp_holds_at_full_size(recipe_dict, gloo_of_one, without_deepspeed):  # noqa: F811
    """The check on a model whose 4-bit weights were lost (dequantized before sharding): it measures
    fp32 weights, 8 x the 4-bit size, and refuses; on the 4-bit model it passes."""
    from finetuner.config.runtime import resolve_runtime
    from finetuner.model.loading import load_base_model, prepare_for_training
    from finetuner.training.strategies.fsdp import check_quantized_storage

    recipe = Recipe.from_dict(_with(recipe_dict, method="qlora", distributed={"strategy": "fsdp"}))
    rt = resolve_runtime(recipe)
    quantized = prepare_for_training(load_base_model(recipe, rt), recipe)
    report = _storage_of(quantized, 1)
    assert report.local_bytes == report.quantized_bytes == 73728
    check_quantized_storage(report, 0, 4)

    lora = recipe.model_copy(update={"method": "lora", "quantization": None})
    dequantized = prepare_for_training(load_base_model(lora, rt), lora)
    report = _storage_of(dequantized, 1)
    assert report.local_bytes == 8 * report.quantized_bytes and report.dtypes == ("float32",)
    with pytest.raises(UserError, match=r"rank 0 holds 0\.56 MiB of base weights \(stored as float32\).*8\.0 x the 4-bit size"):
        check_quantized_storage(report, 0, 4)


def test_a_qlora_run_whose_4bit_weights_are_lost_refuses_to_start(base, tmp_path, monkeypatch, without_deepspeed):  # noqa: F811
    """Two fsdp processes of a QLoRA recipe whose base is forced to load unquantized (as when the 4-bit
    storage is lost on the way to FSDP): the run ends before any step with the check's message."""
    site = tmp_path / "dequantize"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import finetuner.model.loading as loading\nloading.bnb_config = lambda recipe, rt: None\n", encoding="utf-8"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    raw = _with(base, method="qlora", quantization={"bits": 4}, output_dir=str(tmp_path / "lost"))
    out = run_cli("run", str(write_recipe(tmp_path / "lost.yaml", raw)), "--gpus", "2", "--set", "distributed.strategy=fsdp", "--quiet")
    assert out.returncode == 2, out.stderr + out.stdout
    assert "the quantized weights became ordinary tensors" in out.stderr and "Traceback" not in out.stderr
    assert not [e for e in read_events(tmp_path / "lost" / "events.jsonl") if e["event"] == "step"]


def test_killed_fsdp_runs_resume_from_their_sharded_checkpoints_to_the_uninterrupted_run(base, tmp_path, without_deepspeed):  # noqa: F811
    """SIGKILL of every rank after step 2, then of rank 0 inside the checkpoint of step 4: the same
    recipe run again resumes each time from the last complete checkpoint (the trained weights and
    AdamW's states from each rank's shard, every rank's RNG state: LoRA dropout draws the same
    masks) and logs the losses of the run that was never interrupted, to the last bit."""
    raw = _with(base, lora={"dropout": 0.1}, checkpointing={"save_every": 1, "keep_last": 2},
                logging={"tensorboard": False, "every": 1}, distributed={"strategy": "fsdp", "num_processes": 2})
    ref = finetuner.train(Recipe.from_dict(dict(raw, output_dir=str(tmp_path / "ref"))))
    recipe = Recipe.from_dict(dict(raw, output_dir=str(tmp_path / "run")))
    ckpts = tmp_path / "run" / "checkpoints"
    for fault, last in (("KILL@2", "step-00000002"), ("KILL@save:4:0", "step-00000003")):
        os.environ["FINETUNER_FAULT"] = fault
        try:
            with pytest.raises(UserError, match="Multi-process training failed"):
                finetuner.train(recipe)
        finally:
            del os.environ["FINETUNER_FAULT"]
        assert sorted(p.name for p in ckpts.glob("step-*"))[-1] == last
    assert not (ckpts / ".tmp-step-00000004").exists()  # the cut checkpoint, never published, removed once the ranks ended
    _a_received_copy_is_refused_before_anything_is_unpickled(tmp_path, recipe, raw)
    # step 3's checkpoint damaged after it was sealed (a shard cut short): the resume takes step 2's
    shard = ckpts / "step-00000003" / "fsdp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    result = finetuner.train(recipe)
    assert not result.stopped
    events = read_events(tmp_path / "run" / "events.jsonl")
    starts = [e["resumed_from_step"] for e in events if e["event"] == "start"]
    assert starts == [None, 2, 2]
    (invalid,) = [e for e in events if e["event"] == "checkpoint_invalid"]
    assert invalid["path"].endswith("step-00000003") and "changed since it was written" in invalid["reason"]
    assert [_losses(tmp_path / "run")[s] for s in range(1, 7)] == [_losses(ref.run_dir)[s] for s in range(1, 7)]
    a, b = _weights(tmp_path / "run"), _weights(ref.run_dir)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


def _a_received_copy_is_refused_before_anything_is_unpickled(tmp_path: Path, recipe: Recipe, raw: dict) -> None:
    """The run folder as a colleague would send it, with a crafted ``.metadata`` in its newest checkpoint:
    resuming it (as someone else: another key) stops with one line saying how to opt in, before any rank
    unpickles anything."""
    import pickle
    import shutil

    received = tmp_path / "received"
    shutil.copytree(tmp_path / "run", received, ignore=shutil.ignore_patterns(".lock"))
    marker = tmp_path / "code-ran"
    (received / "checkpoints" / "step-00000003" / "fsdp" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    before = len(read_events(received / "events.jsonl"))
    own_key = os.environ["FINETUNER_CONFIG_DIR"]
    os.environ["FINETUNER_CONFIG_DIR"] = str(tmp_path / "someone-else")
    try:
        with pytest.raises(UserError, match=r"step-00000003 was not written by finetuner for this user on this machine"):
            finetuner.train(Recipe.from_dict(dict(raw, output_dir=str(received))))
    finally:
        os.environ["FINETUNER_CONFIG_DIR"] = own_key
    assert not marker.exists()
    assert not [e for e in read_events(received / "events.jsonl")[before:] if e["event"] == "step"]


def test_a_fsdp_checkpoint_resumes_only_with_the_same_process_count(recipe_dict, without_deepspeed):  # noqa: F811
    from finetuner.runs.folder import recipe_differences

    def d(**dist):
        return Recipe.from_dict(dict(recipe_dict, distributed=dist)).to_dict()

    assert recipe_differences(d(strategy="fsdp", num_processes=2), d(strategy="fsdp", num_processes=2)) == []
    (diff,) = recipe_differences(d(strategy="fsdp", num_processes=2), d(strategy="fsdp", num_processes=4))
    assert "FSDP checkpoints are sharded per process" in diff and "fsdp on 2 → fsdp on 4" in diff
    assert recipe_differences(d(strategy="ddp", num_processes=2), d(strategy="fsdp", num_processes=2))


def test_out_of_memory_on_one_fsdp_rank_backs_off_every_rank_and_keeps_the_loss(base, tmp_path, monkeypatch, without_deepspeed):  # noqa: F811
    """Only rank 1 fails in step 3: both ranks drop the step's sharded gradients and run it again at
    micro-batch 1 x 4 (the same effective batch), in the same run, landing on the one-process run."""
    ref = finetuner.train(Recipe.from_dict(dict(base, output_dir=str(tmp_path / "one"))))
    monkeypatch.setenv("FINETUNER_FAULT", "OOM@3:1")
    raw = dict(base, output_dir=str(tmp_path / "oom"), distributed={"strategy": "fsdp", "num_processes": 2})
    result = finetuner.train(Recipe.from_dict(raw))
    events = read_events(tmp_path / "oom" / "events.jsonl")
    (backoff,) = [e for e in events if e["event"] == "oom_backoff"]
    assert (backoff["step"], backoff["micro_batch_size"], backoff["gradient_accumulation"]) == (3, 1, 4)
    assert "on rank 1" in backoff["message"]
    assert [e["micro_batch_size"] for e in events if e["event"] == "step"] == [2, 2, 1, 1, 1, 1]
    _assert_same_run(result.run_dir, ref.run_dir)


def test_dpo_on_two_fsdp_processes_matches_one_process(tiny_model_dir, tmp_path, without_deepspeed):  # noqa: F811
    """DPO with the base (adapter off) as reference, inside the sharded forward: the step losses and
    rewards, the evaluations (through the root unit's gathered parameters) and the adapter."""
    from tests.training.test_distributed_preference import EVAL, REWARDS, _of, dpo_recipe
    from tests.training.test_preference import pair_rows

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pair_rows(27)), encoding="utf-8")
    raw = dpo_recipe(tiny_model_dir, data, tmp_path, "one")
    ref = finetuner.train(Recipe.from_dict(raw))
    result = finetuner.train(Recipe.from_dict(dict(raw, output_dir=str(tmp_path / "fsdp")),
                                              ["distributed.num_processes=2", "distributed.strategy=fsdp"]))
    events, ref_events = (read_events(d / "events.jsonl") for d in (result.run_dir, ref.run_dir))
    assert [e["reward_accuracy"] for e in events if e["event"] == "step"] != [0.0] * 6  # the rewards moved
    for kind, keys in (("step", ("loss", *REWARDS)), ("eval", EVAL)):
        got, want = _of(events, kind, keys), _of(ref_events, kind, keys)
        assert [g["step"] for g in got] == [w["step"] for w in want] and got
        for g, w in zip(got, want):
            assert g == pytest.approx(w, rel=REL, abs=1e-7), (kind, g, w)
    a, b = _weights(result.run_dir), _weights(ref.run_dir)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= ABS_W


def test_8bit_qlora_with_fsdp_is_refused_with_the_key(recipe_dict, without_deepspeed):  # noqa: F811
    """bitsandbytes' 8-bit weights lose their scales when FSDP replaces the parameter (measured: the
    first forward fails with "'Parameter' object has no attribute 'CB'"): refused in the recipe."""
    raw = _with(recipe_dict, method="qlora", quantization={"bits": 8}, distributed={"strategy": "fsdp", "num_processes": 2})
    with pytest.raises(UserError) as e:
        Recipe.from_dict(raw)
    assert "  - quantization.bits:" in e.value.message and "use bits 4 with fsdp" in e.value.message
    Recipe.from_dict(_with(raw, distributed={"strategy": "zero2"}))  # 8-bit QLoRA still runs on the others


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit", "adafactor"])
def test_optimizers_that_cannot_step_sharded_parameters_are_refused_with_fsdp(recipe_dict, optimizer, without_deepspeed):  # noqa: F811
    """Measured on two processes: bitsandbytes' update has no sharding rule for DTensors and Adafactor
    mixes plain tensors with them; the recipe refuses them with fsdp, naming the key."""
    raw = _with(recipe_dict, training={"optimizer": optimizer}, distributed={"strategy": "fsdp", "num_processes": 2})
    with pytest.raises(UserError) as e:
        Recipe.from_dict(raw)
    assert "  - training.optimizer:" in e.value.message and "fsdp" in e.value.message

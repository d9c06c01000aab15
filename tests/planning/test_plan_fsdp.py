"""`finetuner plan --gpus N` with FSDP2 and the machine's CPU memory, as a user runs it (CLI subprocess).

QLoRA sharded by fsdp where it is best (Qwen2.5-32B and Llama-3.1-70B on 2 x RTX 4090, within
22.5 GiB a card and 64 GiB of CPU memory: the model is loaded once, by rank 0, and scattered into the
shards); a machine with too little CPU memory gets "does not fit" with what it would need.
"""

from __future__ import annotations

import json
import re

import pytest

from finetuner.errors import UserError
from finetuner.planning.planner import plan
from tests.conftest import run_cli

GiB = 2**30
GOAL = ("plan", "--model", "qwen2.5-32b", "--gpu", "rtx4090", "--gpus", "2")


def test_32b_on_two_4090s_is_qlora_sharded_by_fsdp_with_cpu_offload(tmp_path):
    res = run_cli(*GOAL, "--cpu-memory", "64GB")
    assert res.returncode == 0, res.stderr[-2000:]
    text = " ".join(res.stdout.split())
    assert "Plan: QLoRA 4-bit" in text and "fsdp + CPU offload on 2 GPUs" in text
    per_card = float(re.search(r"fsdp \+ CPU offload on 2 GPUs: ([\d.]+) GiB per card", text).group(1))
    machine = float(re.search(r"CPU memory: ([\d.]+) GiB for the machine: 2 processes x", text).group(1))
    assert per_card <= 22.5 and machine <= 64
    assert "the machine has 64.0 GiB (--cpu-memory)" in text

    res = run_cli(*GOAL, "--cpu-memory", "64GB", "--json", "-o", str(tmp_path / "32b.yaml"))
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(res.stdout)
    c = d["choice"]
    assert (c["method"], c["quantization_bits"], c["strategy"], c["distributed_offload"]) == ("qlora", 4, "fsdp", "optimizer+params")
    assert d["total_bytes"] == d["per_device"]["per_device_bytes"] <= 22.5 * GiB
    cpu = d["cpu_memory"]
    assert cpu["needed_bytes"] == 2 * cpu["per_process_bytes"] <= cpu["machine_bytes"] == 64 * GiB and cpu["fits"]
    assert round(per_card, 1) == round(d["total_bytes"] / GiB, 1) and round(machine, 1) == round(cpu["needed_bytes"] / GiB, 1)
    # no card loads the whole 4-bit model (rank 0 loads it into CPU memory): training is the peak
    assert not any("while loading" in k for k in d["components"]) and d["per_device"]["training_bytes"] is None
    assert d["per_device"]["loading_host_bytes"] > 15 * GiB

    # the written recipe says fsdp with CPU offload, and `finetuner estimate` predicts the same for it
    written = (tmp_path / "32b.yaml").read_text()
    assert "strategy: fsdp" in written and "fsdp_offload: true" in written and "method: qlora" in written
    est = run_cli("estimate", str(tmp_path / "32b.yaml"), "--gpu", "rtx4090", "--json")
    assert est.returncode == 0, est.stderr[-2000:]
    assert json.loads(est.stdout)["per_device"]["per_device_bytes"] == d["total_bytes"]


def test_70b_on_two_4090s_is_qlora_sharded_by_fsdp_within_a_card_and_64_gib_of_cpu_memory():
    """The issue's goal: `finetuner plan --model llama-3.1-70b --gpu rtx4090 --gpus 2` on a 64 GiB machine."""
    res = run_cli("plan", "--model", "llama-3.1-70b", "--gpu", "rtx4090", "--gpus", "2", "--cpu-memory", "64GB", "--json")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    d = json.loads(res.stdout)
    c = d["choice"]
    assert (c["method"], c["quantization_bits"], c["strategy"]) == ("qlora", 4, "fsdp")
    assert d["total_bytes"] <= 22.5 * GiB and d["cpu_memory"]["needed_bytes"] <= 64 * GiB and d["cpu_memory"]["fits"]
    # on a 32 GiB machine rank 0 cannot hold the 4-bit model while it loads: nothing fits, and the plan says why
    res = run_cli("plan", "--model", "llama-3.1-70b", "--gpu", "rtx4090", "--gpus", "2", "--cpu-memory", "32GB")
    text = " ".join(res.stdout.split())
    assert res.returncode == 1 and "Nothing fits." in text and "Does not fit the machine's CPU memory" in text, text


def test_too_little_cpu_memory_does_not_fit_and_says_how_much_is_needed():
    res = run_cli(*GOAL, "--cpu-memory", "0.5GB")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    text = " ".join(res.stdout.split())
    assert "Nothing fits." in text and "Does not fit the machine's CPU memory" in text
    # the option needing the least CPU memory: with the cross-entropy's chunk from the vocabulary (192 tokens over
    # 152,064) zero1 with activation offload fits the cards, and needs its 2 processes' offloaded activations (rank 0's
    # copy of the model while an fsdp run loads: tests/memory/test_memory_fsdp.py)
    m = re.search(r"zero1 on 2 GPUs fits the cards \(([\d.]+) GiB per card\) but needs more CPU memory: ([\d.]+) GiB for "
                  r"the machine: 2 processes x ([\d.]+) GiB \(([\d.]+) GiB offloaded activations, ([^)]*)", text)
    assert m, text
    card, needed, per_process, offloaded = (float(m.group(i)) for i in range(1, 5))
    assert card <= 22.5 and needed >= 2 * per_process > 2 * offloaded > 0 and "for the process itself" in m.group(5)
    assert "the machine has 0.5 GiB (--cpu-memory)" in text
    assert re.search(r"more CPU memory: a machine with [\d.]+ GiB of it fits on 2 x rtx4090", text)


def test_a_cpu_memory_that_is_not_a_size_is_a_user_error():
    res = run_cli(*GOAL, "--cpu-memory", "lots")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--cpu-memory lots: give a positive size such as 64GB" in res.stderr + res.stdout


def test_by_default_the_plan_is_for_this_machines_ram(monkeypatch):
    import finetuner.config.hardware as hw

    monkeypatch.setattr(hw, "machine_memory_bytes", lambda: GiB // 2)
    p = plan("qwen2.5-32b", "rtx4090", seq_len=2048, gpus=2)
    assert not p.fits and p.cpu_memory == GiB // 2
    assert "this machine's RAM" in p.reasons[0] and "Does not fit the machine's CPU memory" in p.reasons[0]
    with pytest.raises(UserError, match="--cpu-memory 0GB"):
        plan("qwen2.5-32b", "rtx4090", seq_len=2048, gpus=2, cpu_memory="0GB")


def test_a_recipe_no_strategy_can_run_says_why_instead_of_planning():
    """A recipe that splits its base by layers (model.max_memory) cannot run on several processes with any
    strategy: the plan says the schema's reason, not that nothing fits the memory."""
    from finetuner.config.recipe import Recipe
    from finetuner.planning.planner import plan_recipe

    recipe = Recipe.model_validate({
        "model": {"name": "llama-3.1-8b", "max_memory": {"0": "20GiB", "1": "20GiB"}}, "method": "lora",
        "data": {"path": "data.jsonl", "max_seq_len": 2048},
        "training": {"micro_batch_size": "auto", "gradient_accumulation": "auto", "effective_batch": 16},
    })
    with pytest.raises(UserError, match="No distributed strategy can run this recipe on 2 GPUs: .*model.max_memory"):
        plan_recipe(recipe, "rtx4090", gpus=2, cpu_memory=64 * GiB)

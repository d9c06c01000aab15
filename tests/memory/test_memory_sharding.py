"""The per-device arithmetic of DDP, ZeRO 1-3, FSDP and ZeRO-Offload on top of the memory model."""

from __future__ import annotations

import math

import pytest

from finetuner.errors import UserError
from finetuner.config.hardware import get_gpu
from finetuner.memory.model import Settings, estimate
from finetuner.memory.sharding import best_strategy, candidate_strategies, compare_strategies, shard_estimate
from finetuner.model.shapes import resolve_shape

SHAPE = resolve_shape("llama-2-7b")


def _est(method="full", gpu=None, **kw):
    s = dict(method=method, seq_len=2048, micro_batch=1, gradient_accumulation=8, gradient_checkpointing=True, weight_dtype="bf16")
    s.update(kw)
    return estimate(SHAPE, Settings(**s), get_gpu(gpu) if gpu else None)


def _kind(components: dict[str, int], prefix: str) -> int:
    return sum(b for k, b in components.items() if k.startswith(prefix))


@pytest.mark.parametrize(
    "method, strategy",
    [(m, s) for m in ("full", "lora", "qlora") for s in ("ddp", "zero1", "zero2", "zero3", "fsdp") if (m, s) != ("qlora", "zero3")],
)
def test_one_device_is_the_single_device_estimate(method, strategy):
    e = _est(method)
    one = shard_estimate(e, strategy, 1)
    assert one.per_device_bytes == e.total_bytes
    assert one.comm_bytes_per_step == 0 and one.host_bytes == 0
    assert sum(one.components.values()) == one.per_device_bytes


def test_each_stage_shards_one_more_kind_of_state():
    e = _est("full")
    c, n = e.components, 4
    states, grads = c["optimizer states (adamw_torch)"], c["gradients"]
    weights = _kind(c, "weights:")
    z = {s: shard_estimate(e, s, n).components for s in ("ddp", "zero1", "zero2", "zero3")}
    # ZeRO paper Fig. 1: P_os, P_os+g, P_os+g+p
    assert z["ddp"]["optimizer states (adamw_torch)"] == states and z["ddp"]["DDP gradient buckets"] == grads
    assert z["zero1"]["optimizer states (adamw_torch) (1/4)"] == math.ceil(states / n) and z["zero1"]["gradients"] == grads
    assert z["zero2"]["gradients (1/4)"] == math.ceil(grads / n) and _kind(z["zero2"], "weights:") == weights
    assert _kind(z["zero3"], "weights:") == math.ceil(weights / n)
    assert "gathered parameters (layer + prefetch)" in z["zero3"]
    sizes = [shard_estimate(e, s, n).per_device_bytes for s in ("ddp", "zero1", "zero2", "zero3")]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < e.total_bytes / 2
    # the activations of a micro-batch are not sharded
    fb = e.phases["forward/backward"] - weights - grads - states
    assert z["zero3"]["activations, logits and weight copies"] == fb


def test_communication_volume_follows_the_zero_paper():
    # fp32 weights: parameter bytes == gradient bytes, one micro-batch per device
    e = _est("full", weight_dtype="fp32", gradient_accumulation=4)
    n = 4
    g = e.components["gradients"]
    ddp = shard_estimate(e, "ddp", n).comm_bytes_per_step
    assert ddp == int(2 * (n - 1) / n * g)  # ring all-reduce
    assert shard_estimate(e, "zero1", n).comm_bytes_per_step == ddp
    assert shard_estimate(e, "zero2", n).comm_bytes_per_step == pytest.approx(ddp, rel=1e-9)  # 2Ψ
    assert shard_estimate(e, "zero3", n).comm_bytes_per_step / ddp == pytest.approx(1.5)  # 3Ψ
    # more micro-batches per device: ZeRO-2/3 communicate in each, DDP once per step
    e8 = _est("full", weight_dtype="fp32", gradient_accumulation=16)
    assert shard_estimate(e8, "ddp", n).comm_bytes_per_step == ddp
    assert shard_estimate(e8, "zero3", n).comm_bytes_per_step == pytest.approx(4 * 1.5 * ddp)


def test_offload_moves_states_and_gradients_to_cpu_memory():
    e = _est("full")
    n = 2
    c = e.components
    plain = shard_estimate(e, "zero2", n)
    off = shard_estimate(e, "zero2", n, "optimizer")
    expected_host = math.ceil(c["optimizer states (adamw_torch)"] / n) + math.ceil(c["gradients"] / n) + math.ceil(
        e.details["optimizer_step_temp_bytes"] / n
    )
    assert off.host_bytes == expected_host
    assert not any(k.startswith(("optimizer", "gradients")) for k in off.components)
    assert off.per_device_bytes < plain.per_device_bytes
    params = shard_estimate(e, "zero3", n, "optimizer+params")
    assert params.host_bytes == expected_host + math.ceil(_kind(c, "weights:") / n)
    assert not any(k.startswith("weights:") for k in params.components)


def test_impossible_strategies_are_refused_or_not_offered():
    e = _est("lora")
    with pytest.raises(UserError, match="ZeRO"):
        shard_estimate(e, "ddp", 2, "optimizer")
    with pytest.raises(UserError, match="zero3"):
        shard_estimate(e, "zero2", 2, "optimizer+params")
    with pytest.raises(UserError, match="Unknown strategy"):
        shard_estimate(e, "zero4", 2)
    with pytest.raises(UserError, match="CPUOffloadPolicy"):
        shard_estimate(e, "fsdp", 2, "optimizer")
    offered = candidate_strategies(_est("qlora"))
    # QLoRA: fsdp shards the 4-bit base (with or without CPU offload), zero3 does not
    assert ("zero3", "none") not in offered and ("zero3", "optimizer+params") not in offered
    assert ("fsdp", "none") in offered and ("fsdp", "optimizer+params") in offered and ("zero2", "none") in offered
    # bitsandbytes' optimizers step neither ZeRO partitions nor FSDP's DTensor shards
    assert candidate_strategies(_est("lora", optimizer="paged_adamw_8bit")) == [("ddp", "none")]


def test_best_strategy_prefers_the_simplest_that_fits():
    # LoRA of a 7B model fits one 24 GB card: plain DDP on 2
    lora = best_strategy(_est("lora", gpu="rtx4090"), 2)
    assert lora is not None and (lora.strategy, lora.offload) == ("ddp", "none")
    # full fine-tuning of 7B on 4 x 80 GB: DDP and ZeRO-1 do not fit, ZeRO-2 does with the least communication
    full = _est("full", gpu="a100-80gb")
    choice = best_strategy(full, 4)
    assert choice is not None and (choice.strategy, choice.offload) == ("zero2", "none")
    ranked = compare_strategies(full, 4)
    assert not shard_estimate(full, "ddp", 4).fits
    assert all(r.comm_bytes_per_step >= choice.comm_bytes_per_step for r in ranked if r.fits and r.offload == "none")
    # on 2 x 24 GB only offload fits full fine-tuning of 7B
    small = best_strategy(_est("full", gpu="rtx4090"), 2)
    assert small is None or small.offload != "none"
    d = (small or shard_estimate(full, "zero3", 4)).to_dict()
    assert {"per_device_bytes", "host_bytes", "comm_bytes_per_step", "components", "fits"} <= set(d)

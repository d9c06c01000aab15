"""FSDP2 per device (finetuner.memory.fsdp and shard_estimate's fsdp), checked by hand on a small shape.

The shape: hidden 64, MLP 128, 2 layers, 4 heads of 16 (no GQA), vocabulary 100, embeddings not
tied. Per decoder layer: q, k, v, o 64 x 64 = 4 x 4,096 = 16,384; gate, up, down 64 x 128 = 3 x
8,192 = 24,576; linear weights 40,960; two norms 2 x 64 = 128: 41,088 parameters. The root unit:
embeddings 6,400 + LM head 6,400 + final norm 64 = 12,864. LoRA r4 on every linear: r x (in + out)
= 4 x 128 = 512 for each attention linear (2,048) and 4 x 192 = 768 for each MLP one (2,304):
4,352 per layer, 8,704 in all.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from finetuner.config.hardware import get_gpu
from finetuner.errors import UserError
from finetuner.memory import fsdp as F
from finetuner.memory.model import Settings, estimate, weight_bytes
from finetuner.memory.storage import quantized_weight_parts
from finetuner.memory.sharding import PROCESS_HOST_BYTES, compare_strategies, component_kind, shard_estimate
from finetuner.model.shapes import ModelShape, resolve_shape

TINY = ModelShape("tiny", "llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=4, head_dim=16)
LAYER, ROOT, LORA_LAYER = 41_088, 12_864, 4_352
GiB = 2**30


def _s(method: str, **kw) -> Settings:
    return Settings(**{"method": method, "lora_r": 4, "micro_batch": 1, "seq_len": 32, "gradient_accumulation": 4, **kw})


def test_units_of_the_small_shape_by_hand():
    assert F.units(TINY, _s("lora")) == F.Units(LAYER, ROOT, LORA_LAYER, 0)
    assert F.units(TINY, _s("full")) == F.Units(LAYER, ROOT, LAYER, ROOT)


def test_quantized_weights_split_into_data_and_state():
    # 4-bit: 81,920 linear weights packed two a byte; absmax: 64 blocks for each 64 x 64 linear and
    # 128 for each 64 x 128 one = 640 a layer, 1,280 in all, one uint8 each, plus one fp32 per 256
    # blocks (5 x 4 bytes); code tables 2,048 bytes for each of the 14 linears
    data, state = quantized_weight_parts(TINY, _s("qlora"))
    assert (data, state) == (40_960, 1_280 + 20 + 14 * 2_048)
    # 8-bit: one byte a weight, one fp32 scale per output row (64 x 4 + 128 x 2 + 64 = 576 rows a layer)
    assert quantized_weight_parts(TINY, _s("qlora", quant_bits=8)) == (81_920, 4 * 2 * 576)
    # the split is the whole of the quantized weights the memory model counts
    assert weight_bytes(TINY, _s("qlora"))["nf4 + double quant"] == data + state


@pytest.mark.parametrize("method, layer_unit", [
    ("lora", 2 * LAYER + 2 * LORA_LAYER),  # bf16 base + adapters gathered in bf16
    ("qlora", 40_960 // 2 + 2 * 128 + 2 * LORA_LAYER),  # packed 4-bit bytes of the layer, bf16 norms, adapters
    ("full", 2 * LAYER),  # fp32 master weights gathered in bf16
])
def test_gathered_units_are_the_root_and_two_layers(method, layer_unit):
    s = _s(method)
    assert F.layer_unit_bytes(TINY, s) == layer_unit
    assert F.root_unit_bytes(TINY, s) == 2 * ROOT
    assert F.gathered_bytes(TINY, s) == 2 * ROOT + 2 * layer_unit


def test_reduce_scatter_buffers_hold_two_layers_of_fp32_gradients():
    assert F.reduce_scatter_bytes(TINY, _s("lora")) == 4 * 2 * LORA_LAYER
    # full fine-tuning: two layers' gradients (82,176) outweigh the root's (12,864)
    assert F.reduce_scatter_bytes(TINY, _s("full")) == 4 * 2 * LAYER


def test_bytes_sent_and_copied_per_step_by_hand():
    s = _s("lora")  # accumulation 4 on 4 devices: one micro-batch each
    grads = 4 * 2 * LORA_LAYER  # fp32 gradients of all adapters
    gathered = 2 * 2 * (2 * LAYER + 2 * LORA_LAYER) + 2 * ROOT  # each layer twice, the root once
    assert F.comm_bytes(TINY, s, 4, grads) == int(3 / 4 * (gathered + grads))
    assert F.host_transfer_bytes(TINY, s, 4, grads) == math.ceil(gathered / 4) + math.ceil(grads / 4)
    # two devices: two micro-batches each, each all-gathers and reduce-scatters again
    assert F.comm_bytes(TINY, s, 2, grads) == int(2 * 1 / 2 * (gathered + grads))


def test_qlora_under_fsdp_shards_the_4bit_data_and_keeps_the_state_on_every_device():
    s = _s("qlora")
    e = estimate(TINY, s)
    sh = shard_estimate(e, "fsdp", 2, shape=TINY)
    c = sh.components
    assert c["weights: nf4 + double quant (1/2)"] == 40_960 // 2
    assert c["quantization state (every device)"] == 1_280 + 20 + 14 * 2_048
    assert c["weights: bf16 (not quantized) (1/2)"] == 2 * (ROOT + 2 * 128) // 2
    assert c["LoRA weights (fp32) (1/2)"] == c["gradients (1/2)"] == 4 * 2 * LORA_LAYER // 2
    assert c["optimizer states (adamw_torch) (1/2)"] == 8 * 2 * LORA_LAYER // 2
    assert c["gathered units (root + 2 layers)"] == 2 * ROOT + 2 * (20_480 + 256 + 2 * LORA_LAYER)
    assert c["reduce-scatter buffers"] == 4 * 2 * LORA_LAYER
    assert "autocast weight copies" not in c  # the policy gathers the adapters in bf16 already
    assert sum(c.values()) == sh.per_device_bytes and sh.host_bytes == 0


def test_cpu_offload_moves_the_shards_to_cpu_memory():
    s = _s("qlora")
    e = estimate(TINY, s)
    on = shard_estimate(e, "fsdp", 2, shape=TINY)
    off = shard_estimate(e, "fsdp", 2, "optimizer+params", shape=TINY)
    shards = (40_960 // 2 + 2 * (ROOT + 2 * 128) // 2 + 4 * 2 * LORA_LAYER // 2  # 4-bit data, bf16 rest, adapters
              + 4 * 2 * LORA_LAYER // 2 + 8 * 2 * LORA_LAYER // 2  # gradients, AdamW states
              + 4 * 2 * LORA_LAYER // 2)  # the optimizer step's temporaries
    assert off.host_bytes == shards
    assert not any(k.startswith(("weights:", "LoRA", "gradients", "optimizer")) for k in off.components)
    # what the device keeps: the quantization state, the gathered units and the buffers
    assert off.components["quantization state (every device)"] == on.components["quantization state (every device)"]
    assert off.components["gathered units (root + 2 layers)"] == on.components["gathered units (root + 2 layers)"]
    assert off.per_device_bytes < on.per_device_bytes
    assert off.comm_bytes_per_step == on.comm_bytes_per_step and on.host_transfer_bytes_per_step == 0
    grads = 4 * 2 * LORA_LAYER
    assert off.host_transfer_bytes_per_step == F.host_transfer_bytes(TINY, s, 2, grads) > 0
    assert off.label == "fsdp + CPU offload"


def test_cpu_memory_of_the_machine_and_its_limit():
    deep = replace(TINY, num_layers=4)  # activation offload keeps two layers' inputs on the device: more to move
    e = estimate(deep, _s("qlora", gradient_checkpointing=True, activation_offload=True))
    assert e.offloaded_bytes > 0
    off = shard_estimate(e, "fsdp", 2, "optimizer+params", shape=deep)
    per_process = off.host_bytes + e.offloaded_bytes + PROCESS_HOST_BYTES
    assert off.host_bytes_per_process == per_process and off.host_bytes_per_machine == 2 * per_process
    assert off.fits and off.host_fits  # no machine given: not checked
    small = shard_estimate(e, "fsdp", 2, "optimizer+params", shape=deep, machine_host_bytes=2 * per_process - 1)
    assert small.device_fits and not small.host_fits and not small.fits
    assert "for the machine: 2 processes x" in small.host_summary() and "offloaded activations" in small.host_summary()
    assert shard_estimate(e, "fsdp", 2, "optimizer+params", shape=deep, machine_host_bytes=2 * per_process).fits


def test_fsdp_refuses_an_optimizer_only_offload():
    with pytest.raises(UserError, match="optimizer\\+params"):
        shard_estimate(estimate(TINY, _s("lora")), "fsdp", 2, "optimizer", shape=TINY)


def test_70b_qlora_on_two_4090s_loads_and_trains_within_a_card_and_64_gib_of_cpu_memory():
    """The issue's goal at the memory model's level. QLoRA of Llama-3.1-70B on 2 x RTX 4090, sharded
    by fsdp with CPU offload: at most 22.5 GiB a card and 64 GiB of CPU memory for the machine. The
    model is loaded once (rank 0 into CPU memory, then scattered into the shards), so no card ever
    holds the whole 4-bit model; the machine holds rank 0's copy while it loads."""
    shape, gpu = resolve_shape("llama-3.1-70b"), get_gpu("rtx4090")
    s = Settings(method="qlora", seq_len=2048, micro_batch=1, gradient_accumulation=16, gradient_checkpointing=True)
    e = estimate(shape, s, gpu)
    sh = shard_estimate(e, "fsdp", 2, "optimizer+params", shape, machine_host_bytes=64 * GiB)
    weights = sum(b for k, b in e.components.items() if component_kind(k) == "parameters")
    assert weights > 30 * GiB  # the whole 4-bit model does not fit one card
    assert sh.training_bytes is None and not any("while loading" in k for k in sh.components)
    assert sh.per_device_bytes <= 22.5 * GiB and sh.fits
    # rank 0's copy of the whole model, in CPU memory while it loads, beside the two processes
    assert sh.loading_host_bytes == weights
    assert sh.loading_host_bytes_per_machine == weights + 2 * PROCESS_HOST_BYTES
    assert sh.host_bytes_per_machine == max(2 * sh.host_bytes_per_process, sh.loading_host_bytes_per_machine) <= 64 * GiB
    ranked = compare_strategies(e, 2, shape, machine_host_bytes=64 * GiB)
    best = next(r for r in ranked if r.fits)
    assert (best.strategy, best.offload) == ("fsdp", "optimizer+params")


def test_loading_the_whole_model_on_rank_0_can_be_the_machines_cpu_peak_and_is_said():
    """Without CPU offload the processes need little CPU memory, so rank 0's copy of the model while
    it loads is the machine's peak: the plan's CPU figure and its words say so."""
    shape = resolve_shape("qwen2.5-32b")
    e = estimate(shape, Settings(method="qlora", seq_len=2048, micro_batch=1, gradient_accumulation=16,
                                 gradient_checkpointing=True), get_gpu("a100-80gb"))
    sh = shard_estimate(e, "fsdp", 2, "none", shape, machine_host_bytes=8 * GiB)
    assert sh.host_bytes == 0 and sh.loading_host_bytes > 15 * GiB
    assert sh.host_bytes_per_machine == sh.loading_host_bytes + 2 * PROCESS_HOST_BYTES and not sh.host_fits
    assert "while the model loads (rank 0's copy of the whole model" in sh.host_summary()
    # other strategies load onto each device: nothing of the kind in CPU memory
    assert shard_estimate(e, "zero2", 2, "none", shape).loading_host_bytes == 0


@pytest.mark.parametrize("preset", ["llama-2-7b", "llama-3.1-8b", "qwen2.5-32b", "llama-3.1-70b"])
@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_fsdp_loading_never_outgrows_training_on_a_device(preset, method):
    """A device holds its shards and one whole tensor while the model loads; training holds its
    shards and the gathered root unit (which contains that tensor) and more: loading is not the
    peak. zero3 still loads the whole model onto every device first, and says so where it is the peak."""
    shape = resolve_shape(preset)
    s = Settings(method=method, seq_len=2048, micro_batch=1, gradient_accumulation=16, gradient_checkpointing=True)
    e = estimate(shape, s, get_gpu("a100-80gb"))
    for offload in ("none", "optimizer+params"):
        sh = shard_estimate(e, "fsdp", 4, offload, shape)
        assert sh.training_bytes is None and not any("while loading" in k for k in sh.components)
        assert F.largest_tensor_bytes(shape, s) < sh.per_device_bytes
    if method == "lora" and preset == "llama-3.1-70b":
        z = shard_estimate(e, "zero3", 4, "none", shape)
        assert z.components["whole model while loading, before sharding"] > z.training_bytes
        assert any("every process loads the whole model" in n for n in z.notes)


def test_a_model_whose_weights_fit_a_card_is_planned_by_its_training_peak():
    """Loading counts only where it is the larger: a 7B model's whole weights fit a card, so fsdp's
    per-device figure is its training peak."""
    shape, gpu = resolve_shape("llama-2-7b"), get_gpu("a100-80gb")
    e = estimate(shape, Settings(method="lora", seq_len=2048, micro_batch=4, gradient_accumulation=4), gpu)
    sh = shard_estimate(e, "fsdp", 2, "none", shape)
    assert sh.training_bytes is None and not any("while loading" in k for k in sh.components)

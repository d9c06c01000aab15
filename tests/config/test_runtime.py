"""One resolver: what is trained is what is predicted.

A grid of recipes x devices goes through :func:`finetuner.config.runtime.resolve`, and every reader of the
answer — the memory model's settings, the multi-process launch configs, the trainer's memory
prediction — must agree with it field by field. Each disagreement found in the code before the
resolver existed has its own case below.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from finetuner.errors import UserError
from finetuner.config.hardware import cpu_profile, get_gpu
from finetuner.training.launch import accelerate_config, deepspeed_config
from finetuner.memory.model import settings_from_recipe
from finetuner.config.recipe import Recipe
from finetuner.config.runtime import Device, Runtime, resolve

BASE = {"model": {"name": "llama-2-7b"}, "data": {"path": "yahma/alpaca-cleaned", "max_seq_len": 512}}
RECIPES = {
    "lora": {},
    "qlora": {"method": "qlora"},
    "qlora, fp32 autocast": {"method": "qlora", "training": {"precision": "fp32"}},
    "full": {"method": "full"},
    "full, bf16 weights": {"method": "full", "model": {"name": "llama-2-7b", "dtype": "bf16"}},
    "eager attention": {"model": {"name": "llama-2-7b", "attn_implementation": "eager"}},
    "full logits": {"training": {"loss_chunk_size": 0}},
    "no kernels": {"training": {"kernels": "none"}},
    "2 processes, zero2": {"distributed": {"strategy": "zero2", "num_processes": 2}},
}
DEVICES = {
    "cpu": Device("cpu"),
    "bf16 card": Device("cuda", bf16=True),
    "fp16-only card": Device("cuda", bf16=False),
    "bf16 card with flash-attn and liger": Device("cuda", bf16=True, flash_attention=True, liger=True),
}


def _recipe(overrides: dict) -> Recipe:
    raw = {**BASE, **overrides}
    return Recipe.from_dict(raw)


def _cases():
    for (rname, over), (dname, dev) in itertools.product(RECIPES.items(), DEVICES.items()):
        if dname == "cpu" and (over.get("method") == "qlora" or "distributed" in over):
            continue  # bitsandbytes' CPU path is tested elsewhere; multi-process on CPU below
        yield pytest.param(over, dev, id=f"{rname} / {dname}")


@pytest.mark.parametrize("overrides,device", list(_cases()))
def test_every_reader_takes_the_resolved_runtime(overrides, device):
    recipe = _recipe(overrides)
    rt = resolve(recipe, device, model_type="llama")
    s = settings_from_recipe(recipe, runtime=rt)
    # the memory model predicts what the trainer loads and computes
    assert s.weight_dtype == rt.base_dtype
    assert s.compute_dtype == (rt.compute_dtype if recipe.method == "qlora" else rt.precision)
    assert s.attn_implementation == ("sdpa" if rt.attention == "auto" else rt.attention)
    assert s.fused_ce == (rt.loss_path == "liger_fused_linear_ce")
    assert s.platform == rt.device
    # the trainer's chunk: a number as given, auto by finetuner.losses.chunk on the model's vocabulary (32,000: 1,024)
    assert s.loss_chunk == (1024 if recipe.training.loss_chunk_size == "auto" else recipe.training.loss_chunk_size)
    # the rules themselves
    half = "fp32" if not device.is_cuda else ("bf16" if device.bf16 else "fp16")
    assert rt.precision == (recipe.training.precision if recipe.training.precision != "auto" else half)
    if recipe.model.dtype == "auto":
        assert rt.base_dtype == ("fp32" if (not device.is_cuda or recipe.method == "full") else half)
    else:
        assert rt.base_dtype == recipe.model.dtype
    assert rt.attention == ("eager" if recipe.model.attn_implementation == "eager" else
                            "flash_attention_2" if device.flash_attention and rt.base_dtype != "fp32" else "auto")
    assert rt.kernels == ("liger" if device.liger and recipe.training.kernels == "auto" else "none")
    # the launch configs autocast as the trainer does
    if recipe.distributed.world_size > 1:
        ds, acc = deepspeed_config(recipe, rt), accelerate_config(recipe, rt)
        assert ds["bf16"]["enabled"] == (rt.precision == "bf16") and ds["fp16"]["enabled"] == (rt.precision == "fp16")
        assert acc["mixed_precision"] == ("no" if rt.precision == "fp32" else rt.precision)


SPEED_INSTALL = {"liger": True, "flash_attention": True}


@pytest.mark.parametrize("card,device", [
    (cpu_profile(), Device("cpu")),
    (get_gpu("rtx4090").with_default_install(), Device("cuda", bf16=True)),
    (get_gpu("t4").with_default_install(), Device("cuda", bf16=False)),
    (get_gpu("v100-32gb").with_default_install(), Device("cuda", bf16=False)),
    (replace(get_gpu("rtx4090"), **SPEED_INSTALL), Device("cuda", bf16=True, flash_attention=True, liger=True)),
    (replace(get_gpu("t4"), **SPEED_INSTALL), Device("cuda", bf16=False, liger=True)),  # FlashAttention-2: Ampere or newer
])
def test_a_cards_profile_is_the_device_the_planner_resolves_for(card, device):
    """A profile that says what can run on the card is the same Device as the facts, whatever is installed here."""
    assert Device.of(card) == device
    recipe = _recipe({})
    assert settings_from_recipe(recipe, card, "llama") == settings_from_recipe(recipe, runtime=resolve(recipe, device, "llama"))


@pytest.mark.parametrize("installed", [True, False])
def test_a_profile_that_assumes_nothing_follows_what_is_installed_here(monkeypatch, installed):
    import finetuner.config.runtime as runtime

    monkeypatch.setattr(runtime, "_installed", lambda package: installed)
    assert Device.of(get_gpu("rtx4090")) == Device("cuda", bf16=True, flash_attention=installed, liger=installed)
    assert Device.of(get_gpu("rtx4090").with_default_install()) == Device("cuda", bf16=True)


def test_cpu_predictions_are_for_the_cpu_not_a_bf16_card():
    """Before: a CPU run's prediction was made for a bf16 CUDA card."""
    from finetuner.training.prediction import predict_run

    recipe = Recipe.from_dict({**BASE, "model": {"name": "llama-3.2-1b"}, "device": "cpu"})
    rt = resolve(recipe, Device("cpu"))
    est = predict_run(recipe, rt, max_steps=1).memory
    assert est.settings.platform == "cpu" and est.settings.weight_dtype == "fp32" and est.settings.compute_dtype == "fp32"


def test_full_fine_tuning_with_bf16_weights_is_predicted_in_bf16():
    """Before: ``method: full`` with ``model.dtype: bf16`` was predicted with fp32 weights."""
    recipe = _recipe(RECIPES["full, bf16 weights"])
    assert settings_from_recipe(recipe, get_gpu("a100-80gb"), "llama").weight_dtype == "bf16"
    assert settings_from_recipe(_recipe(RECIPES["full"]), get_gpu("a100-80gb"), "llama").weight_dtype == "fp32"


def test_flash_attention_is_predicted_without_a_mask():
    """Before: when the runtime picked FlashAttention-2 the memory model still charged an SDPA mask."""
    from finetuner.memory.model import estimate
    from finetuner.model.shapes import resolve_shape

    recipe = _recipe({"data": {"path": "x/y", "max_seq_len": 4096, "packing": True}})
    shape = resolve_shape("llama-2-7b")
    flash = settings_from_recipe(recipe, runtime=resolve(recipe, DEVICES["bf16 card with flash-attn and liger"], "llama"))
    sdpa = settings_from_recipe(recipe, runtime=resolve(recipe, DEVICES["bf16 card"], "llama"))
    assert flash.attn_implementation == "flash_attention_2" and sdpa.attn_implementation == "sdpa"
    assert estimate(shape, flash).total_bytes < estimate(shape, sdpa).total_bytes


def test_an_fp16_only_card_launches_in_fp16():
    """Before: the DeepSpeed and accelerate configs enabled bf16 on every CUDA card."""
    recipe = _recipe(RECIPES["2 processes, zero2"])
    rt = resolve(recipe, DEVICES["fp16-only card"], "llama")
    assert rt.precision == "fp16" and deepspeed_config(recipe, rt)["fp16"]["enabled"]
    assert not deepspeed_config(recipe, rt)["bf16"]["enabled"] and accelerate_config(recipe, rt)["mixed_precision"] == "fp16"


@pytest.mark.parametrize("overrides,device,message", [
    ({"training": {"precision": "fp16"}}, Device("cpu"), "fp16 is not supported on CPU"),
    ({"training": {"precision": "bf16"}}, Device("cuda", bf16=False), "no bf16 support"),
    ({"model": {"name": "llama-2-7b", "attn_implementation": "flash_attention_2"}}, Device("cuda", bf16=True), "flash_attn"),
    ({"training": {"kernels": "liger"}}, Device("cuda", bf16=True), "liger"),
])
def test_settings_a_device_cannot_honour_are_clear_errors(overrides, device, message):
    with pytest.raises(UserError, match=message):
        resolve(_recipe(overrides), device, "llama")


def test_the_runtime_is_frozen():
    rt = resolve(_recipe({}), Device("cpu"))
    assert isinstance(rt, Runtime)
    with pytest.raises(AttributeError):
        rt.precision = "bf16"  # type: ignore[misc]


@pytest.mark.parametrize("dname", list(DEVICES) + ["bf16 card with liger only"])
def test_the_fast_path_report_is_what_the_resolver_decides(dname):
    """`finetuner gpus` says which fast kernels a run uses (config.runtime.fast_path): the same
    attention, kernels and loss path resolve() gives a LoRA recipe with every choice on auto, and
    an install hint for each fast kernel not used on a CUDA card."""
    from finetuner.config.runtime import FLASH_INSTALL, SPEED_INSTALL, fast_path

    device = DEVICES.get(dname) or Device("cuda", bf16=True, liger=True)
    report = fast_path(device)
    rt = resolve(_recipe({}), device, "llama")
    attention = "sdpa" if rt.attention == "auto" else rt.attention  # auto: transformers' default, SDPA
    assert (report["attention"], report["kernels"], report["loss_path"]) == (attention, rt.kernels, rt.loss_path)
    hints = " ".join(report["missing"])
    if device.is_cuda:
        assert (SPEED_INSTALL in hints) == (not device.liger)
        assert (FLASH_INSTALL in hints) == (device.bf16 and not device.flash_attention)
    else:
        assert report["missing"] == ["no CUDA device: Liger Kernel and FlashAttention-2 run on CUDA GPUs only"]


def test_gpus_says_what_runs_here():
    import json

    from tests.conftest import run_cli

    r = run_cli("gpus", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fast_path"]["device"] == "cpu"  # this machine and CI's have no GPU
    text = run_cli("gpus")
    assert "Fast path here" in text.stdout and "not used: no CUDA device" in text.stdout
    assert json.loads(run_cli("gpus", "--json", "--no-detect").stdout)["fast_path"] is None

"""Kernel choices: attention, Liger (CUDA only), the loss path the memory model counts, and
torch.compile wiring. Liger itself needs CUDA + Triton, so here its refusal and fallbacks are tested."""

from __future__ import annotations

import pytest

from finetuner.model import kernels
from finetuner.errors import UserError


def test_liger_is_never_chosen_without_cuda():
    assert kernels.resolve_kernels("auto", on_cuda=False, model_type="llama", liger_available=True) == "none"
    assert kernels.resolve_kernels("none", on_cuda=True, model_type="llama", liger_available=True) == "none"
    with pytest.raises(UserError, match="no CUDA GPU"):
        kernels.resolve_kernels("liger", on_cuda=False, model_type="llama", liger_available=True)


def test_liger_auto_needs_the_package_and_a_supported_architecture(monkeypatch):
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    assert kernels.resolve_kernels("auto", on_cuda=True, model_type="llama", liger_available=True) == "liger"
    assert kernels.resolve_kernels("auto", on_cuda=True, model_type="gpt2", liger_available=True) == "none"
    with pytest.raises(UserError, match="architecture 'gpt2'"):
        kernels.resolve_kernels("liger", on_cuda=True, model_type="gpt2", liger_available=True)
    monkeypatch.setattr(kernels, "liger_installed", lambda: False)
    assert kernels.resolve_kernels("auto", on_cuda=True, model_type="llama", liger_available=False) == "none"
    with pytest.raises(UserError, match="not installed"):
        kernels.resolve_kernels("liger", on_cuda=True, model_type="llama", liger_available=False)


def test_loss_path_names_what_the_memory_model_must_count():
    assert kernels.loss_path("liger", 1024) == "liger_fused_linear_ce"
    assert kernels.loss_path("none", 1024) == "chunked_ce"
    assert kernels.loss_path("none", 0) == "full_logits"


def test_attention_on_cpu_is_transformers_default_and_flash_is_refused():
    assert kernels.resolve_attention("auto", flash_available=False, base_dtype="fp32") == "auto"
    assert kernels.resolve_attention("eager", flash_available=False, base_dtype="fp32") == "eager"
    with pytest.raises(UserError, match="flash_attention_2"):
        kernels.resolve_attention("flash_attention_2", flash_available=False, base_dtype="fp32")
    assert kernels.resolve_attention("auto", flash_available=True, base_dtype="bf16") == "flash_attention_2"
    assert kernels.resolve_attention("auto", flash_available=True, base_dtype="fp32") == "auto"  # FA2 needs 16-bit


def test_runtime_records_the_resolved_choices(recipe_dict):
    from finetuner.config.runtime import resolve_runtime
    from finetuner.config.recipe import Recipe

    rt = resolve_runtime(Recipe.from_dict(recipe_dict, ["device=cpu", "training.compile=true"]))
    assert (rt.kernels, rt.loss_path, rt.compile) == ("none", "chunked_ce", True)
    rt = resolve_runtime(Recipe.from_dict(recipe_dict, ["device=cpu", "training.loss_chunk_size=0"]))
    assert rt.loss_path == "full_logits"
    with pytest.raises(UserError, match="training.kernels"):
        resolve_runtime(Recipe.from_dict(recipe_dict, ["device=cpu", "training.kernels=liger"]))


def test_compiled_layers_give_the_same_loss_and_gradients(tiny_model_dir):
    """The wiring of training.compile (traced with the eager backend: no code generation here)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetuner.model.scoring import token_loss_sum

    torch.manual_seed(0)
    # float64: the traced layers may run the same sums in another order; in fp32 that is ~1e-6
    # relative noise (more on small gradients), in float64 ~1e-15, far below the tolerances below
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).double()
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :6] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)}
    out = []
    for compiled in (False, True):
        if compiled:
            assert kernels.compile_layers(model, backend="eager") == len(model.get_base_model().model.layers)
        model.zero_grad()
        loss, _ = token_loss_sum(model, batch, 8)
        loss.backward()
        out.append((loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    assert all(layer._compiled_call_impl is not None for layer in model.get_base_model().model.layers)
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-12)
    for a, b in zip(out[0][1], out[1][1]):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9)


def test_a_run_reports_its_kernels_in_the_start_event(recipe_dict):
    import finetuner

    events = []
    finetuner.train(finetuner.Recipe.from_dict(recipe_dict, ["training.max_steps=1", "device=cpu"]), callbacks=[events.append])
    start = next(e for e in events if e["event"] == "start")
    assert (start["kernels"], start["loss_path"], start["compile"], start["attention"]) == ("none", "chunked_ce", False, "sdpa")

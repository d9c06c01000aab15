"""4-bit experts (finetuner/model/experts4bit.py) against the dequantized path: the same model with each expert's
weights replaced by their dequantized 4-bit values gives the same outputs and input gradients, for the plain
gated experts (Qwen3-MoE, Mixtral) and gpt-oss's biased, transposed, interleaved ones."""

from __future__ import annotations

import copy

from pathlib import Path

import pytest

from finetuner.model.tiny import tiny_config

pytest.importorskip("bitsandbytes")


def _model(model_type: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(model_type, 400)))
    return model.eval()


def _dequantized_copy(model, quant_type: str):
    """``model`` with every expert weight replaced by its 4-bit round trip (the reference path)."""
    import torch
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    ref = copy.deepcopy(model)
    for mod in ref.modules():
        for name in ("gate_up_proj", "up_proj", "down_proj"):
            w = getattr(mod, name, None)
            if isinstance(w, torch.nn.Parameter) and w.dim() == 3:
                with torch.no_grad():
                    for e in range(w.shape[0]):
                        m = w[e].t() if mod.is_transposed else w[e]
                        p, qs = quantize_4bit(m.contiguous(), blocksize=64, quant_type=quant_type, compress_statistics=True)
                        d = dequantize_4bit(p, qs)
                        w[e].copy_(d.t() if mod.is_transposed else d)
    return ref


@pytest.mark.parametrize("model_type,quant_type", [("qwen3_moe", "nf4"), ("mixtral", "fp4"), ("gpt_oss", "nf4")])
def test_4bit_experts_give_the_dequantized_models_outputs_and_gradients(model_type, quant_type):
    import torch

    from finetuner.model.experts4bit import experts_modules, quantize_experts, quantized_bytes

    model = _model(model_type)
    ref = _dequantized_copy(model, quant_type)
    full = sum(p.numel() for _, m in experts_modules(model) for n, p in m.named_parameters() if p.dim() == 3)
    assert quantize_experts(model, quant_type=quant_type) == model.config.num_hidden_layers
    assert not any(p.dim() == 3 for p in model.parameters())  # the 16-bit experts are gone
    # 4 bits a weight, one uint8 absmax per 64 and a float per 256 of those (double quantization), per expert
    assert full / 2 < quantized_bytes(model) < full / 2 * 1.1

    ids = torch.randint(0, 400, (2, 10), generator=torch.Generator().manual_seed(1))
    emb_q = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    emb_r = emb_q.detach().clone().requires_grad_(True)
    out_q = model(inputs_embeds=emb_q).logits
    out_r = ref(inputs_embeds=emb_r).logits
    # the same weights in the same fp32 matmuls: equal up to fp32 summation order (rel. 1e-6 a product, 2 layers)
    torch.testing.assert_close(out_q, out_r, rtol=1e-5, atol=1e-5)
    out_q.square().mean().backward()
    out_r.square().mean().backward()
    torch.testing.assert_close(emb_q.grad, emb_r.grad, rtol=1e-4, atol=1e-7)


def test_a_qlora_run_of_a_mixture_of_experts_holds_its_experts_in_4bit_and_trains(tmp_path, monkeypatch):
    import json

    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.model import experts4bit
    from finetuner.model.tiny_llama import train_bpe_tokenizer
    from tests.conftest import alpaca_rows, corpus

    tok = train_bpe_tokenizer(corpus(), vocab_size=400)
    folder = tmp_path / "moe"
    _model("qwen3_moe").save_pretrained(folder)
    tok.save_pretrained(folder)
    data = tmp_path / "a.json"
    data.write_text(json.dumps(alpaca_rows(8)), encoding="utf-8")
    quantized = []
    real = experts4bit.quantize_experts
    monkeypatch.setattr(experts4bit, "quantize_experts", lambda model, *a, **k: quantized.append(real(model, *a, **k)) or quantized[-1])
    recipe = Recipe.from_dict({
        "name": "t", "model": {"name": str(folder)}, "method": "qlora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 32, "val_size": 0},
        "training": {"max_steps": 2, "lr": 1e-3, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0},
        "logging": {"tensorboard": False}, "output_dir": str(tmp_path / "run")})
    result = finetuner.train(recipe)
    assert quantized == [2]  # both layers' experts held in 4-bit
    assert len(result.losses) == 2 and all(0 < x < 20 for x in result.losses)
    adapter = json.loads((result.run_dir / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]


def test_a_4bit_mixture_of_experts_loads_its_experts_into_cpu_memory_first(tmp_path):
    from finetuner.model.loading import experts_in_cpu_memory
    from finetuner.model.shapes import load_config

    assert experts_in_cpu_memory(load_config("qwen3-30b-a3b")[0]) == {f"model.layers.{i}.mlp.experts": "cpu" for i in range(48)}
    assert experts_in_cpu_memory(load_config("llama-2-7b")[0]) == {}


def test_qlora_of_a_checkpoint_stored_in_mxfp4_is_refused_before_loading(tmp_path):
    import json

    from finetuner.config.recipe import Recipe
    from finetuner.config.runtime import Runtime
    from finetuner.errors import UserError
    from finetuner.model.loading import load_base_model
    from finetuner.model.shapes import PRESET_DIR

    folder = tmp_path / "gpt-oss"
    folder.mkdir()
    cfg = json.loads((PRESET_DIR / "gpt-oss-20b.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    recipe = Recipe.from_dict({"name": "t", "model": {"name": str(folder)}, "method": "qlora",
                               "data": {"path": "data/bike_shop.jsonl"}, "output_dir": str(tmp_path / "run")})
    with pytest.raises(UserError) as e:
        load_base_model(recipe, Runtime("cpu", "fp32", "fp32", "fp32"))
    assert "stored quantized (mxfp4)" in e.value.message and "Mxfp4Config(dequantize=True)" in e.value.hint


@pytest.mark.parametrize("model,weights_gib", [("qwen3-30b-a3b", 15.6), ("gpt-oss-20b", 11.7)])
def test_the_mixtures_of_experts_of_2026_plan_to_fit_a_24gb_card_with_4bit_experts(model, weights_gib):
    import finetuner
    from finetuner.units import GiB as GIB

    plan = finetuner.plan(model, "rtx4090", cpu_memory=128 * GIB)
    assert plan.fits and plan.recipe.method == "qlora" and plan.recipe.quantization.bits == 4
    weights = sum(v for k, v in plan.estimate.components.items() if k.startswith("weights"))
    # 4 bits an expert weight and a linear weight plus their states; embeddings and head in bf16
    assert weights / GIB == pytest.approx(weights_gib, abs=0.05)
    assert any("expert weights are held in 4-bit on the GPU; loading reads them into CPU memory" in n for n in plan.notes)
    assert "active)" in plan.shape.describe()
    assert any("stored in mxfp4" in n for n in plan.notes) == (model == "gpt-oss-20b")


def test_the_gpt_oss_plan_writes_the_bf16_copy_its_note_names(tmp_path):
    """Issue 68: QLoRA cannot quantize gpt-oss's published MXFP4 checkpoint, so the written recipe loads the bf16
    copy the note names (a preset's ``_16bit_copy``), which plans, estimates and passes the loader's check offline
    as the preset's shape; planned from the copy, the recipe keeps it and says nothing of MXFP4."""
    import yaml

    from finetuner.model.loading import stored_config
    from tests.conftest import cli_in_process

    out = cli_in_process("plan", "--model", "gpt-oss-20b", "--gpu", "rtx4090", "-o", str(tmp_path / "r.yaml"))
    assert out.returncode == 0, out.stderr
    written = (tmp_path / "r.yaml").read_text()
    recipe = yaml.safe_load(written)
    assert recipe["method"] == "qlora" and recipe["model"]["name"] == "unsloth/gpt-oss-20b-BF16"
    assert ("# Note: gpt-oss-20b's published checkpoint is stored in mxfp4, which QLoRA cannot quantize: the recipe's "
            "model.name is unsloth/gpt-oss-20b-BF16, a bf16 copy of it") in written
    assert "quantization_config" not in stored_config("unsloth/gpt-oss-20b-BF16", None)  # QLoRA loads it
    assert stored_config("openai/gpt-oss-20b", None)["quantization_config"]["quant_method"] == "mxfp4"
    estimate = cli_in_process("estimate", str(tmp_path / "r.yaml"), "--gpu", "rtx4090")
    assert estimate.returncode == 0 and "Fits" in estimate.stdout, estimate.stderr
    again = cli_in_process("plan", "--model", "unsloth/gpt-oss-20b-BF16", "--gpu", "rtx4090", "-o", str(tmp_path / "c.yaml"))
    assert again.returncode == 0, again.stderr
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["model"]["name"] == "unsloth/gpt-oss-20b-BF16"
    assert "mxfp4" not in again.stdout and "mxfp4" not in (tmp_path / "c.yaml").read_text()


def _mxfp4_checkpoint(folder):
    """A tiny gpt-oss saved as openai/gpt-oss-20b is published: its experts as MXFP4 blocks and scales (random
    4-bit codes, exponents around 2^0), everything else in 16 bits; and the experts that layout dequantizes to."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[2] / "data" / "demo_model"))
    cfg = AutoConfig.for_model("gpt_oss", vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=256, sliding_window=16,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    expected = {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows_in, cols_out = state.pop(key).shape  # stored [experts, in, out]; MXFP4 rows are the outputs
        blocks = torch.randint(0, 256, (e, cols_out, rows_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(125, 130, (e, cols_out, rows_in // 32), dtype=torch.uint8, generator=g)
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        expected[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    tok.save_pretrained(folder)
    return expected


def test_lora_of_a_checkpoint_stored_in_mxfp4_dequantizes_its_experts_as_they_load_and_trains(tmp_path, monkeypatch):
    """gpt-oss as published (MXFP4 experts): a LoRA run loads the experts dequantized to the recipe's dtype, the
    values the MXFP4 codes hold, and trains. The loader asks for the dequantization itself: on a GPU with triton's
    MXFP4 kernels transformers would otherwise keep the experts packed (here, with no kernels, it would dequantize
    on its own)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    asked = []
    real = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: asked.append(k.get("quantization_config")) or real(cls, *a, **k)))

    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.config.runtime import Runtime
    from finetuner.model.loading import load_base_model
    from tests.conftest import alpaca_rows

    folder = tmp_path / "gpt-oss-mxfp4"
    expected = _mxfp4_checkpoint(folder)
    data = tmp_path / "d.json"
    data.write_text(json.dumps(alpaca_rows(8)), encoding="utf-8")
    raw = {"name": "t", "model": {"name": str(folder)}, "device": "cpu", "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
           "data": {"path": str(data), "max_seq_len": 32, "val_size": 0}, "output_dir": str(tmp_path / "run"),
           "training": {"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation": 1, "lr": 1e-3}}
    model = load_base_model(Recipe.from_dict(raw), Runtime("cpu", "fp32", "fp32", "fp32"))
    assert asked and asked[0].quant_method == "mxfp4" and asked[0].dequantize is True
    for key, want in expected.items():
        got = model.get_parameter(key)
        assert got.dtype == torch.float32 and torch.equal(got.detach(), want), key
    result = finetuner.train(Recipe.from_dict(raw))
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))

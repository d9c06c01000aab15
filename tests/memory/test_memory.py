"""The memory model's exact parts against the real libraries, and its scaling laws."""

from __future__ import annotations

import math

import pytest

from finetuner.errors import UserError
from finetuner.memory.settings import NF4_PER_LAYER_BYTES
from finetuner.memory.model import (
    Settings,
    activation_bytes,
    estimate,
    optimizer_state_bytes,
    trainable_tensors,
    weight_bytes,
)
from finetuner.model.shapes import resolve_shape, shape_from_config


def _tiny_config(tmp_path):
    """A Llama whose linear layers are big enough for whole quantization blocks."""
    import json

    cfg = {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return cfg


def _quantized_model(tmp_path, bits: int, double_quant: bool = True):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    cfg = _tiny_config(tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    model.save_pretrained(tmp_path / "m")
    q = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                            bnb_4bit_compute_dtype=torch.float32)
         if bits == 4 else BitsAndBytesConfig(load_in_8bit=True))
    return cfg, AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=q, dtype=torch.float32)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_storage_equals_bitsandbytes(tmp_path, double_quant):
    import bitsandbytes as bnb

    cfg, model = _quantized_model(tmp_path, 4, double_quant)
    real = 0
    n_layers = 0
    for mod in model.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            n_layers += 1
            qs = mod.weight.quant_state
            real += _nbytes(mod.weight) + _nbytes(qs.absmax)
            if qs.nested:
                real += _nbytes(qs.state2.absmax)
    shape = shape_from_config(cfg)
    predicted = weight_bytes(shape, Settings(method="qlora", double_quant=double_quant, weight_dtype="fp32"))
    quant_key = next(k for k in predicted if k.startswith("nf4"))
    assert n_layers == shape.linears_per_layer * shape.num_layers
    assert predicted[quant_key] - n_layers * NF4_PER_LAYER_BYTES == real
    # everything else stays in the storage dtype (fp32 here), none of it quantized
    others = sum(_nbytes(p) for n, p in model.named_parameters() if not isinstance(p, bnb.nn.Params4bit))
    assert predicted["fp32 (not quantized)"] == others


def test_int8_storage_equals_bitsandbytes(tmp_path):
    import bitsandbytes as bnb

    cfg, model = _quantized_model(tmp_path, 8)
    real = sum(_nbytes(m.weight) + 4 * m.weight.shape[0] for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt))
    predicted = weight_bytes(shape_from_config(cfg), Settings(method="qlora", quant_bits=8, weight_dtype="fp32"))
    assert predicted["int8"] == real


def test_adamw_states_equal_torch(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _tiny_config(tmp_path)
    model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)),
                           LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(input_ids=torch.randint(0, 512, (1, 16)), labels=torch.randint(0, 512, (1, 16))).loss.backward()
    opt.step()
    real = sum(_nbytes(v) for st in opt.state.values() for k, v in st.items() if k != "step")
    tensors = trainable_tensors(shape_from_config(cfg), Settings(method="lora", lora_r=8))
    assert optimizer_state_bytes(tensors, "adamw_torch") == real


def test_eight_bit_adam_states_equal_bitsandbytes(tmp_path):
    import bitsandbytes as bnb
    import torch

    shapes = [(8, 256, 1), (512, 8, 1), (16, 16, 1)]  # two 8-bit-sized tensors, one kept 32-bit
    params = [torch.nn.Parameter(torch.randn(r, c)) for r, c, _ in shapes]
    opt = bnb.optim.AdamW8bit(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    real = sum(_nbytes(v) for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0
               and k in ("state1", "state2", "absmax1", "absmax2"))
    assert optimizer_state_bytes(shapes, "adamw_8bit") == real


def test_activations_scale_linearly_with_tokens_with_sdpa():
    shape = resolve_shape("llama-2-7b")
    base = Settings(method="lora", micro_batch=1, seq_len=1024)
    a1 = activation_bytes(shape, base)
    a2 = activation_bytes(shape, base.with_(micro_batch=2))
    a3 = activation_bytes(shape, base.with_(seq_len=2048))
    assert a2.per_layer == pytest.approx(2 * a1.per_layer, rel=1e-6)
    assert a3.per_layer == pytest.approx(2 * a1.per_layer, rel=1e-6)
    # eager attention keeps the s x s probabilities: quadratic in the sequence
    e1 = activation_bytes(shape, base.with_(attn_implementation="eager"))
    e2 = activation_bytes(shape, base.with_(attn_implementation="eager", seq_len=2048))
    assert e2.per_layer > 2.5 * e1.per_layer


def test_checkpointing_keeps_only_layer_inputs():
    shape = resolve_shape("llama-2-7b")
    s = Settings(method="lora", seq_len=2048)
    plain, gc = activation_bytes(shape, s), activation_bytes(shape, s.with_(gradient_checkpointing=True))
    assert gc.checkpoints == 2 * 4096 * 2048 * shape.num_layers  # bf16 hidden state per layer
    assert estimate(shape, s.with_(gradient_checkpointing=True)).total_bytes < estimate(shape, s).total_bytes
    assert plain.per_layer > 10 * gc.checkpoints / shape.num_layers


def test_chunked_loss_avoids_the_full_logits():
    shape = resolve_shape("llama-3.1-8b")  # 128k vocabulary
    s = Settings(method="qlora", seq_len=4096, gradient_checkpointing=True)
    chunked, full = estimate(shape, s), estimate(shape, s.with_(loss_chunk=0))
    assert full.details["activations"]["logits_bytes"] == 2 * 4096 * shape.vocab_size
    assert chunked.details["activations"]["logits_bytes"] == 0
    assert full.total_bytes - chunked.total_bytes > 2 * 2**30


def test_components_add_up_and_fit_uses_the_margin():
    from finetuner.config.hardware import get_gpu

    shape = resolve_shape("llama-2-13b")
    est = estimate(shape, Settings(method="qlora", gradient_checkpointing=True), get_gpu("rtx4090"), margin=0.05)
    assert sum(est.components.values()) == est.total_bytes
    assert est.budget_bytes == int(get_gpu("rtx4090").memory_bytes * 0.95)
    assert est.fits
    full = estimate(shape, Settings(method="full", weight_dtype="fp32"), get_gpu("rtx4090"))
    assert not full.fits and full.total_bytes > 16 * shape.num_params  # 16 bytes/parameter + activations


def test_full_finetuning_is_sixteen_bytes_per_parameter_of_model_state():
    shape = resolve_shape("llama-2-7b")
    est = estimate(shape, Settings(method="full", weight_dtype="fp32", optimizer="adamw_torch"))
    c = est.components
    model_state = c["weights: fp32 (trainable)"] + c["gradients"] + c["optimizer states (adamw_torch)"]
    assert model_state == 16 * shape.num_params


def test_settings_validation():
    with pytest.raises(UserError):
        Settings(seq_len=0)
    with pytest.raises(UserError):
        Settings(optimizer="adam")
    assert math.isclose(Settings(micro_batch=2, seq_len=512).tokens, 1024)

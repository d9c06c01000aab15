"""GGUF export of the newest families (issue 56, docs/export_families.md): Mamba and LFM2, trained 2 LoRA steps, are
written as llama.cpp's converter writes them and read back by transformers' GGUF loader with the merged model's
logits; the families whose llama.cpp mapping finetuner has not written are refused in one line that says what is
missing, with nothing written."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from finetuner.export.gguf import export_model
from tests.conftest import tiny_with_ids, two_lora_steps
from tests.export.test_gguf import _fields, _qwen2_tokenizer, _refused


def _trained(model_type: str, tmp_path):
    """A tiny ``model_type`` model (its norms not all ones) and the run of 2 LoRA steps on it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = _qwen2_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_with_ids(model_type, tok)))
    with torch.no_grad():  # a norm written wrong shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1, 0.3)
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, two_lora_steps(folder, tmp_path).run_dir


def test_a_trained_mamba_exports_as_llama_cpps_mamba(tmp_path):
    """Its scan's widths in ``mamba.ssm.*``, ``A`` as ``-exp(A_log)``, the convolution squeezed to (channels, kernel)
    and kept float32, and transformers' GGUF loader (which takes the log back) gives the merged model's logits."""
    model, run = _trained("mamba", tmp_path)
    r = export_model(run, tmp_path / "m.gguf", quant="f16")
    assert r.architecture == "mamba" and r.top1_agreement >= 0.9 and r.max_abs_logit_diff is not None, r
    reader, f = _fields(tmp_path / "m.gguf")
    cfg = model.config
    assert (f["mamba.ssm.inner_size"], f["mamba.ssm.state_size"], f["mamba.ssm.conv_kernel"], f["mamba.ssm.time_step_rank"]) \
        == (cfg.intermediate_size, cfg.state_size, cfg.conv_kernel, cfg.time_step_rank)
    tensors = {t.name: t for t in reader.tensors}
    assert {"blk.1.ssm_in.weight", "blk.0.ssm_x.weight", "blk.0.ssm_dt.bias", "blk.0.ssm_d", "output_norm.weight"} <= set(tensors)
    conv = tensors["blk.0.ssm_conv1d.weight"]
    assert [int(x) for x in conv.shape] == [cfg.conv_kernel, cfg.intermediate_size]  # GGUF lists the fastest axis first
    # float32 in an f16 file, as llama.cpp's converter keeps them (ggml's CPU ssm_conv asserts float32 weights)
    assert {tensors[n].tensor_type.name for n in ("blk.0.ssm_conv1d.weight", "blk.1.ssm_a", "blk.1.ssm_d")} == {"F32"}
    assert tensors["blk.0.ssm_in.weight"].tensor_type.name == "F16"
    a_log = model.backbone.layers[1].mixer.A_log.detach().numpy()  # frozen by LoRA: the base's
    np.testing.assert_allclose(np.asarray(tensors["blk.1.ssm_a"].data), -np.exp(a_log), rtol=1e-6)


def test_a_trained_lfm2_exports_as_llama_cpps_lfm2_and_for_ollama(tmp_path):
    """Its attention layers told apart by their key-value heads (0 for a short convolution), the feed-forward width
    the model built, and an Ollama folder from the same run."""
    model, run = _trained("lfm2", tmp_path)
    r = export_model(run, tmp_path / "l.gguf", quant="f16")
    assert r.architecture == "lfm2" and r.top1_agreement >= 0.9, r
    reader, f = _fields(tmp_path / "l.gguf")
    cfg = model.config
    attends = [t == "full_attention" for t in cfg.layer_types]
    assert list(f["lfm2.attention.head_count_kv"]) == [cfg.num_key_value_heads if a else 0 for a in attends] \
        and any(attends) and not all(attends)
    assert f["lfm2.feed_forward_length"] == model.model.layers[0].feed_forward.w1.out_features
    assert f["lfm2.shortconv.l_cache"] == cfg.conv_L_cache
    names = {t.name for t in reader.tensors}
    conv_layer = attends.index(False)
    conv = next(t for t in reader.tensors if t.name == f"blk.{conv_layer}.shortconv.conv.weight")
    assert conv.tensor_type.name == "F32" and [int(x) for x in conv.shape] == [cfg.conv_L_cache, cfg.hidden_size]
    assert {f"blk.{conv_layer}.shortconv.conv.weight", f"blk.{conv_layer}.shortconv.in_proj.weight",
            f"blk.{attends.index(True)}.attn_q_norm.weight", "token_embd_norm.weight"} <= names
    o = export_model(run, tmp_path / "ollama", format="ollama", quant="f16", verify=False)
    assert (tmp_path / "ollama" / "model.gguf").is_file() and "FROM" in (tmp_path / "ollama" / "Modelfile").read_text()
    assert o.architecture == "lfm2"


@pytest.mark.parametrize("model_type, missing", [
    ("qwen3_5_text", r"gguf package \([\d.]+\) knows llama\.cpp's 'qwen35' architecture, but finetuner's mapping to it is not written yet"),
    ("gemma4_text", r"knows llama\.cpp's 'gemma4' architecture, but finetuner's mapping to it is not written yet"),
    ("zamba2", r"llama\.cpp has no architecture for it"),
])
def test_a_family_without_a_written_mapping_is_refused_in_one_line(model_type, missing, tmp_path):
    """``finetuner export`` exits 2 naming the family and what is missing (the gguf package's architecture, or
    finetuner's mapping to it), one line, and writes nothing."""
    tok = _qwen2_tokenizer()
    model = tmp_path / model_type
    model.mkdir()
    cfg = tiny_with_ids(model_type, tok)
    (model / "config.json").write_text(json.dumps(cfg, default=str), encoding="utf-8")
    for fmt, out in (("gguf", "x.gguf"), ("ollama", "ollama")):
        p = _refused(tmp_path, str(model), "--format", fmt, "-o", str(tmp_path / out),
                     match=rf"model_type '{model_type}': .*{missing}; nothing was written")
        assert len([line for line in p.stderr.splitlines() if line.startswith("error")]) == 1, p.stderr


@pytest.mark.parametrize("model_type, change, why", [
    ("mamba", {"use_bias": True}, "no projection bias, a convolution bias"),
    ("lfm2", {"conv_bias": True}, "its short convolution has no bias"),
    ("lfm2", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "RoPE scaling 'linear'"),
])
def test_what_llama_cpp_would_run_otherwise_is_refused(model_type, change, why):
    from finetuner.errors import UserError
    from finetuner.export.gguf_arch import arch_for

    cfg = {**tiny_with_ids(model_type, _qwen2_tokenizer()), **change}
    with pytest.raises(UserError, match=why):
        arch_for(cfg, "config.json")
    arch_for(tiny_with_ids(model_type, _qwen2_tokenizer()), "config.json")  # the same family without the change


def test_a_gguf_package_without_the_architecture_is_named_as_what_is_missing(monkeypatch):
    """A gguf package without llama.cpp's qwen35 (an older one): the refusal names the package and its version."""
    import gguf

    from finetuner.export.gguf_arch import not_written

    monkeypatch.setattr(gguf, "MODEL_ARCH_NAMES", {k: v for k, v in gguf.MODEL_ARCH_NAMES.items() if v != "qwen35"})
    assert re.search(r"model_type 'qwen3_5_text': the installed gguf package \([\d.]+\) has no 'qwen35' architecture; "
                     "nothing was written", str(not_written("qwen3_5_text", "config.json")))

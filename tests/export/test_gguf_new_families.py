"""GGUF export of the newest families (issue 56, docs/export_families.md): Mamba, LFM2 and Gemma 4's text model, trained
2 LoRA steps, are written as llama.cpp's converter writes them and read back by transformers' GGUF loader with the
merged model's logits; Qwen3.5, Qwen3.5-MoE, Falcon-Mamba, Mamba-2, LFM2-MoE, Granite 4.0-H, Bamba, Falcon-H1,
Nemotron-H, Jamba and Qwen3-Next, which that loader does not read as they are, by llama.cpp itself where
llama-cpp-python is installed (refused in one line where it is not); the families whose llama.cpp mapping finetuner
has not written are refused in one line that says what is missing, with nothing written."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from finetuner.export.gguf import export_model
from tests.conftest import tiny_with_ids, two_lora_steps
from tests.export.test_gguf import _fields, _qwen2_tokenizer, _refused


def _trained(model_type: str, tmp_path, **change):
    """A tiny ``model_type`` model (its norms not all ones; ``change`` to its config) and the run of 2 LoRA steps on it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = _qwen2_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**tiny_with_ids(model_type, tok), **change}))
    with torch.no_grad():  # a norm (or Gemma 4's layer scale) written wrong shows in the logits
        for name, param in model.named_parameters():
            if ("norm" in name and name.endswith("weight")) or name.endswith("layer_scalar"):
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


def test_a_trained_gemma4_exports_as_llama_cpps_gemma4_and_for_ollama(tmp_path):
    """Its two head widths (the full-attention layers' wider), the sliding pattern, the per-layer input embeddings,
    the proportional RoPE's frequency factors and the layer scales as llama.cpp's converter writes them; transformers'
    GGUF loader gives the merged model's logits; an Ollama folder from the same run."""
    model, run = _trained("gemma4_text", tmp_path)
    r = export_model(run, tmp_path / "g.gguf", quant="f16")
    assert r.architecture == "gemma4" and r.top1_agreement >= 0.9 and r.max_abs_logit_diff <= r.tolerance, r
    reader, f = _fields(tmp_path / "g.gguf")
    cfg = model.config
    full = cfg.layer_types.index("full_attention")
    head_full = model.model.layers[full].self_attn.head_dim
    head_swa = model.model.layers[cfg.layer_types.index("sliding_attention")].self_attn.head_dim
    assert head_full != head_swa  # the tiny model's full layers are wider, as Gemma 4's are
    assert (f["gemma4.attention.key_length"], f["gemma4.attention.key_length_swa"]) == (head_full, head_swa)
    assert list(f["gemma4.attention.sliding_window_pattern"]) == [t == "sliding_attention" for t in cfg.layer_types]
    assert f["gemma4.embedding_length_per_layer_input"] == cfg.hidden_size_per_layer_input
    assert (f["gemma4.rope.freq_base"], f["gemma4.rope.freq_base_swa"]) == (
        cfg.rope_parameters["full_attention"]["rope_theta"], cfg.rope_parameters["sliding_attention"]["rope_theta"])
    tensors = {t.name: t for t in reader.tensors}
    turned = int(head_full * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    np.testing.assert_array_equal(np.asarray(tensors["rope_freqs.weight"].data),
                                  np.asarray([1.0] * turned + [1e30] * (head_full // 2 - turned), dtype=np.float32))
    scale = model.model.layers[1].layer_scalar.detach().numpy()
    np.testing.assert_allclose(np.asarray(tensors["blk.1.layer_output_scale.weight"].data), scale, rtol=1e-6)
    assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight",
            "blk.0.inp_gate.weight", "blk.0.proj.weight", "blk.0.post_norm.weight"} <= set(tensors)
    norm = model.model.layers[0].input_layernorm.weight.detach().numpy()  # not 1 + weight, unlike Gemma 2 and 3
    np.testing.assert_allclose(np.asarray(tensors["blk.0.attn_norm.weight"].data), norm, rtol=1e-6)
    o = export_model(run, tmp_path / "ollama", format="ollama", quant="f16", verify=False)
    assert (tmp_path / "ollama" / "model.gguf").is_file() and "FROM" in (tmp_path / "ollama" / "Modelfile").read_text()
    assert o.architecture == "gemma4"


def test_a_trained_qwen35_exports_as_llama_cpps_qwen35_and_llama_cpp_checks_it(tmp_path):
    """The Gated DeltaNet as llama.cpp's converter writes it: its widths in ``qwen35.ssm.*``, which layers are linear,
    ``A`` as ``-exp(A_log)``, the zero-centred norms as ``1 + weight`` (the DeltaNet's output norm as it is), the
    convolution squeezed and float32, and, with more value heads than key heads (the tiny model: 4 and 2), the value
    heads tiled: (K0's v0, K0's v1, K1's v0, K1's v1) stored as heads 0, 2, 1, 3. transformers' GGUF loader does not
    read qwen35: with llama-cpp-python installed llama.cpp gives the merged model's logits; without it the checked
    export is refused in one line before anything is written."""
    model, run = _trained("qwen3_5_text", tmp_path)
    cfg = model.config
    r = export_model(run, tmp_path / "q.gguf", quant="f16", verify=False)
    assert r.architecture == "qwen35" and r.max_abs_logit_diff is None, r
    reader, f = _fields(tmp_path / "q.gguf")
    assert (f["qwen35.ssm.state_size"], f["qwen35.ssm.group_count"], f["qwen35.ssm.time_step_rank"],
            f["qwen35.ssm.inner_size"], f["qwen35.ssm.conv_kernel"]) == (16, 2, 4, 64, cfg.linear_conv_kernel_dim) \
        == (cfg.linear_key_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
            cfg.linear_value_head_dim * cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim)
    assert list(f["qwen35.attention.recurrent_layers"]) == [t == "linear_attention" for t in cfg.layer_types] == [True, False]
    assert f["qwen35.rope.dimension_count"] == int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]) == 4
    # its 2 rotary pairs dealt to the time and height sections as llama.cpp's interleaved M-RoPE reads them (the
    # converter's default [11, 11, 10, 0] would cover 32 pairs: ggml aborts; a pair in no section is not turned)
    assert list(f["qwen35.rope.dimension_sections"]) == [1, 1, 0, 0]
    t = {x.name: np.asarray(x.data) for x in reader.tensors}
    types = {x.name: x.tensor_type.name for x in reader.tensors}
    mixer, tiles = model.model.layers[0].linear_attn, [0, 2, 1, 3]
    np.testing.assert_allclose(t["blk.0.ssm_a"], -np.exp(mixer.A_log.detach().numpy()[tiles]), rtol=1e-6)
    np.testing.assert_allclose(t["blk.0.ssm_dt.bias"], mixer.dt_bias.detach().numpy()[tiles], rtol=1e-6)
    rows = np.concatenate([np.arange(64)] + [64 + 16 * h + np.arange(16) for h in tiles])  # q, k, then the value heads
    conv = mixer.conv1d.weight.detach().numpy()[:, 0, :]
    assert types["blk.0.ssm_conv1d.weight"] == "F32"
    np.testing.assert_allclose(t["blk.0.ssm_conv1d.weight"], conv[rows], rtol=1e-6)
    from safetensors.numpy import load_file

    from finetuner.export.merge import merge_adapter

    merge_adapter(str(run), tmp_path / "merged", dtype="fp32")  # the projections LoRA trained: the merged model's
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    at = "model.layers.0.linear_attn."
    f16 = dict(rtol=2 ** -10, atol=2 ** -24)  # the float16 rounding of each weight
    np.testing.assert_allclose(t["blk.0.attn_qkv.weight"], merged[at + "in_proj_qkv.weight"][rows], **f16)
    cols = np.concatenate([16 * h + np.arange(16) for h in tiles])
    np.testing.assert_allclose(t["blk.0.ssm_out.weight"], merged[at + "out_proj.weight"][:, cols], **f16)
    np.testing.assert_allclose(t["blk.0.ssm_beta.weight"], merged[at + "in_proj_b.weight"][tiles], **f16)
    np.testing.assert_allclose(t["blk.0.ssm_norm.weight"], mixer.norm.weight.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(t["blk.1.attn_q_norm.weight"],
                               1 + model.model.layers[1].self_attn.q_norm.weight.detach().numpy(), rtol=1e-6)
    o = export_model(run, tmp_path / "ollama", format="ollama", quant="f16", verify=False)
    assert o.architecture == "qwen35" and "FROM" in (tmp_path / "ollama" / "Modelfile").read_text()
    _checked_by_llama_cpp_or_refused(run, tmp_path, "qwen35")


def _checked_by_llama_cpp_or_refused(run, tmp_path, arch: str) -> None:
    """With llama-cpp-python installed, the checked export: llama.cpp gives the merged model's logits; without it, the
    checked export refused in one line (exit 2) with nothing written."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:  # llama.cpp itself reads the file back
        checked = export_model(run, tmp_path / "checked.gguf", quant="f16")
        assert checked.max_abs_logit_diff <= checked.tolerance and checked.top1_agreement >= 0.9, checked
        assert any("llama.cpp itself" in n for n in checked.notes), checked.notes
    else:
        p = _refused(tmp_path, str(run), "--format", "gguf", "-o", str(tmp_path / "checked.gguf"),
                     match=rf"does not read .*llama\.cpp's {arch}\b.*, and llama-cpp-python, which would check the file, "
                           r"is not installed; nothing was written")
        assert len([line for line in p.stderr.splitlines() if line.startswith("error")]) == 1, p.stderr
        assert not (tmp_path / "checked.gguf").exists()


#: each family llama.cpp alone reads back: its llama.cpp architecture, and settings of its file that show its own layers
#: written (a metadata key and its value from the tiny config, and tensors only that family has)
LLAMA_CPP_READ = {
    "falcon_mamba": ("mamba", {"mamba.ssm.dt_b_c_rms": True}, {"blk.1.ssm_x.weight", "blk.1.ssm_dt.bias"}),
    "mamba2": ("mamba2", {"mamba2.ssm.group_count": 2, "mamba2.ssm.time_step_rank": 8},
               {"blk.0.ssm_norm.weight", "blk.0.ssm_dt.bias", "blk.1.ssm_d"}),
    "qwen3_5_moe_text": ("qwen35moe", {"qwen35moe.expert_count": 4, "qwen35moe.expert_shared_feed_forward_length": 32},
                         {"blk.0.ssm_beta.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_gate_inp_shexp.weight"}),
    "lfm2_moe": ("lfm2moe", {"lfm2moe.leading_dense_block_count": 1, "lfm2moe.expert_gating_func": 2},
                 {"blk.0.ffn_gate.weight", "blk.1.ffn_down_exps.weight", "blk.1.exp_probs_b.bias"}),
    "granitemoehybrid": ("granitehybrid", {"granitehybrid.attention.head_count_kv": [0, 2], "granitehybrid.embedding_scale": 4.0,
                                           "granitehybrid.logit_scale": 0.25, "granitehybrid.rope.scaling.finetuned": False},
                         {"blk.0.ssm_norm.weight", "blk.0.ffn_gate_shexp.weight", "blk.1.ffn_up_exps.weight", "blk.1.attn_q.weight"}),
    "bamba": ("granitehybrid", {"granitehybrid.attention.head_count_kv": [0, 2], "granitehybrid.rope.dimension_count": 8,
                                "granitehybrid.rope.scaling.finetuned": True},
              {"blk.0.ssm_norm.weight", "blk.0.ffn_gate.weight", "blk.1.ffn_up.weight", "blk.1.attn_k.weight"}),
    "falcon_h1": ("falcon-h1", {"falcon-h1.ssm.inner_size": 128, "falcon-h1.ssm.group_count": 2, "falcon-h1.attention.key_length": 16},
                  {"blk.0.ssm_in.weight", "blk.0.ssm_norm.weight", "blk.0.attn_k.weight", "blk.1.ffn_gate.weight"}),
    "nemotron_h": ("nemotron_h_moe", {"nemotron_h_moe.attention.head_count_kv": [0, 0, 2, 0],
                                      "nemotron_h_moe.feed_forward_length": [0, 32, 0, 32], "nemotron_h_moe.expert_count": 4},
                   {"blk.0.ssm_norm.weight", "blk.1.ffn_up_exps.weight", "blk.1.exp_probs_b.bias", "blk.3.ffn_down_shexp.weight",
                    "blk.2.attn_q.weight"}),
    "jamba": ("jamba", {"jamba.attention.head_count_kv": [0, 0, 2, 0], "jamba.expert_count": 4, "jamba.ssm.time_step_rank": 8},
              {"blk.0.ssm_dt_norm.weight", "blk.0.ssm_b_norm.weight", "blk.0.ffn_gate.weight", "blk.1.ffn_gate_inp.weight",
               "blk.1.ffn_gate_exps.weight", "blk.2.attn_q.weight"}),
    "qwen3_next": ("qwen3next", {"qwen3next.attention.recurrent_layers": [True, False], "qwen3next.ssm.group_count": 2,
                                 "qwen3next.ssm.time_step_rank": 4, "qwen3next.rope.dimension_count": 4},
                   {"blk.0.ssm_in.weight", "blk.0.ssm_ba.weight", "blk.0.ffn_gate_inp_shexp.weight",
                    "blk.1.ffn_down_exps.weight", "blk.1.attn_q_norm.weight"}),
}
#: Falcon-H1's muP multipliers, none 1, and its gated norm (gate first, as llama.cpp's falcon-h1 runs it) on 2 groups
FALCON_H1 = {"embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "attention_in_multiplier": 0.5,
             "attention_out_multiplier": 1.5, "key_multiplier": 0.5, "ssm_in_multiplier": 1.5, "ssm_out_multiplier": 0.5,
             "mlp_multipliers": [1.5, 0.5], "ssm_multipliers": [0.5, 1.5, 0.5, 2.0, 0.5], "mamba_rms_norm": True,
             "mamba_norm_before_gate": False, "mamba_n_groups": 2}
#: Granite's multipliers, none 1 (a multiplier written wrong shows in the logits: a logit scale of 1 instead of 0.25
#: gave a difference of 2 against a tolerance of 0.027)
GRANITE = {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25, "logits_scaling": 0.25,
           "num_key_value_heads": 2}
#: the families' changes to the tiny config
CHANGE = {"granitemoehybrid": GRANITE, "falcon_h1": FALCON_H1,
          "nemotron_h": {"layers_block_type": ["mamba", "moe", "attention", "moe"]}}  # as Nemotron 3 Nano's


@pytest.mark.parametrize("model_type", sorted(LLAMA_CPP_READ))
def test_a_family_only_llama_cpp_reads_exports_and_llama_cpp_checks_it(model_type, tmp_path):
    """Falcon-Mamba (llama.cpp's mamba with the norms on dt, B and C, which transformers' GGUF loader would read as
    plain Mamba), Mamba-2 (``A`` and ``D`` as columns, the gated norm one row a group), Qwen3.5-MoE (the Gated DeltaNet
    with routed and shared experts), LFM2-MoE (Mixtral-named experts stacked, the routing bias) and Granite 4.0-H
    (Mamba-2 and attention layers, the fused experts split, its four multipliers) and Bamba (Granite 4.0-H's layers
    with dense MLPs and RoPE on the first half of each head) and Falcon-H1 (Mamba-2 beside attention in each layer, its
    muP multipliers folded into the weights) and Nemotron-H with experts (each layer one block: Mamba-2, experts or
    attention), Jamba (Mamba layers with weighted norms on dt, B and C, attention, experts every other layer) and
    Qwen3-Next (the Gated DeltaNet with its value heads grouped, experts with a gated shared expert) trained 2 LoRA steps
    are written as llama.cpp's converter writes them; with llama-cpp-python installed llama.cpp gives the merged model's
    logits, without it the checked export is refused in one line before anything is written."""
    arch, keys, tensors = LLAMA_CPP_READ[model_type]
    model, run = _trained(model_type, tmp_path, **CHANGE.get(model_type, {}))
    r = export_model(run, tmp_path / "x.gguf", quant="f16", verify=False)
    assert r.architecture == arch and r.max_abs_logit_diff is None, r
    reader, f = _fields(tmp_path / "x.gguf")
    assert {k: (list(f[k]) if isinstance(f[k], list) else f[k]) for k in keys} == keys
    t = {x.name: x for x in reader.tensors}
    assert tensors <= set(t), sorted(t)
    if model_type == "mamba2":  # -exp(A_log) as a (heads, 1) column; the gated norm as (groups, width / groups)
        mixer = model.backbone.layers[1].mixer
        np.testing.assert_allclose(np.asarray(t["blk.1.ssm_a"].data).ravel(), -np.exp(mixer.A_log.detach().numpy()), rtol=1e-6)
        assert [int(x) for x in t["blk.1.ssm_a"].shape] == [1, mixer.num_heads]
        assert [int(x) for x in t["blk.0.ssm_norm.weight"].shape] == [mixer.intermediate_size // 2, 2]
        assert t["blk.0.ssm_norm.weight"].tensor_type.name == "F32"
    if model_type == "granitemoehybrid":  # the experts' fused gate and up rows (frozen: the base's) as two stacks
        fused = model.model.layers[1].block_sparse_moe.experts.gate_up_proj.detach().numpy()
        width = fused.shape[1] // 2
        f16 = dict(rtol=2 ** -10, atol=2 ** -24)
        np.testing.assert_allclose(np.asarray(t["blk.1.ffn_gate_exps.weight"].data), fused[:, :width], **f16)
        np.testing.assert_allclose(np.asarray(t["blk.1.ffn_up_exps.weight"].data), fused[:, width:], **f16)
    if model_type == "bamba":  # of each 16-wide key head only the first 8 rows turn: they alone are interleaved
        _only_the_turned_rows_interleaved(run, tmp_path, np.asarray(t["blk.1.attn_k.weight"].data), heads=2, head=16, turned=8)
    if model_type == "nemotron_h":  # the checkpoint's experts (one tensor each) stacked as llama.cpp's (experts, out, in)
        experts = model.model.layers[1].mixer.experts
        np.testing.assert_allclose(np.asarray(t["blk.1.ffn_up_exps.weight"].data), experts.up_proj.detach().numpy(),
                                   rtol=2 ** -10, atol=2 ** -24)
    if model_type == "jamba":  # a Mamba layer's A as -exp(A_log) (d_inner, d_state), its experts stacked
        mixer = model.model.layers[1].mamba
        np.testing.assert_allclose(np.asarray(t["blk.1.ssm_a"].data), -np.exp(mixer.A_log.detach().numpy()), rtol=1e-6)
        assert [int(x) for x in t["blk.1.ffn_down_exps.weight"].shape] == [128, 64, 4]  # (width, hidden, experts), fastest first
    if model_type == "qwen3_next":  # value heads grouped by key head as transformers has them (llama.cpp's qwen3next
        # repeats each key head for its own): A and dt_bias as they are, not tiled as for Qwen3.5; no M-RoPE sections
        mixer = model.model.layers[0].linear_attn
        np.testing.assert_allclose(np.asarray(t["blk.0.ssm_a"].data), -np.exp(mixer.A_log.detach().numpy()), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(t["blk.0.ssm_dt.bias"].data), mixer.dt_bias.detach().numpy(), rtol=1e-6)
        assert "qwen3next.rope.dimension_sections" not in f
    if model_type == "falcon_h1":  # the multipliers folded into the merged weights, as llama.cpp's converter folds them
        _multipliers_folded(run, tmp_path, model.config, {n: np.asarray(x.data) for n, x in t.items()})
    _checked_by_llama_cpp_or_refused(run, tmp_path, arch)


def _only_the_turned_rows_interleaved(run, tmp_path, stored, heads: int, head: int, turned: int) -> None:
    """The merged model's key projection as stored: in each head, the turned rows' halves (rotated as halves by
    transformers) interleaved as llama.cpp's pairs, rows (0, 4, 1, 5, 2, 6, 3, 7) for 8 turned rows; the rest as they
    are (llama.cpp's converter would interleave the whole head, which llama.cpp would not turn as transformers does)."""
    from safetensors.numpy import load_file

    from finetuner.export.merge import merge_adapter

    merge_adapter(str(run), tmp_path / "merged", dtype="fp32")
    k = load_file(str(tmp_path / "merged" / "model.safetensors"))["model.layers.1.self_attn.k_proj.weight"]
    order = [i // 2 + (turned // 2) * (i % 2) for i in range(turned)] + list(range(turned, head))
    rows = [h * head + r for h in range(heads) for r in order]
    np.testing.assert_allclose(stored, k[rows], rtol=2 ** -10, atol=2 ** -24)  # the float16 rounding of each weight


def _multipliers_folded(run, tmp_path, cfg, t) -> None:
    """Falcon-H1's keys scaled by ``attention_in_multiplier`` x ``key_multiplier`` (0.25), the Mamba in-projection's
    rows by ``ssm_in_multiplier`` x their part's ``ssm_multipliers`` (gate 0.75, x 2.25, B 0.75, C 3, dt 0.75), the
    output head by ``lm_head_multiplier``: on the merged model's weights."""
    from safetensors.numpy import load_file

    from finetuner.export.merge import merge_adapter

    merge_adapter(str(run), tmp_path / "merged", dtype="fp32")
    m = load_file(str(tmp_path / "merged" / "model.safetensors"))
    f16 = dict(rtol=2 ** -10, atol=2 ** -24)
    np.testing.assert_allclose(t["blk.0.attn_k.weight"], 0.25 * m["model.layers.0.self_attn.k_proj.weight"], **f16)
    inner, bc = cfg.mamba_d_ssm, cfg.mamba_n_groups * cfg.mamba_d_state
    rows = np.repeat([0.75, 2.25, 0.75, 3.0, 0.75], [inner, inner, bc, bc, cfg.mamba_n_heads])[:, None]
    np.testing.assert_allclose(t["blk.0.ssm_in.weight"], rows * m["model.layers.0.mamba.in_proj.weight"], **f16)
    np.testing.assert_allclose(t["output.weight"], 0.5 * m["lm_head.weight"], **f16)


def test_nemotron_h_is_written_as_llama_cpps_architecture_for_its_blocks():
    """Without experts llama.cpp's nemotron_h, with them nemotron_h_moe; dense MLP layers beside expert layers refused
    (llama.cpp would read them as experts)."""
    from finetuner.errors import UserError
    from finetuner.export.gguf_arch import arch_for

    cfg = tiny_with_ids("nemotron_h", _qwen2_tokenizer())
    assert arch_for({**cfg, "layers_block_type": ["mamba", "mlp", "attention", "mlp"]}, "config.json").gguf_arch == "nemotron_h"
    assert arch_for({**cfg, "layers_block_type": ["mamba", "moe", "attention", "moe"]}, "config.json").gguf_arch == "nemotron_h_moe"
    with pytest.raises(UserError, match="dense MLP layers beside expert layers"):
        arch_for({**cfg, "layers_block_type": ["mamba", "moe", "attention", "mlp"]}, "config.json")
    with pytest.raises(UserError, match="no latent projection"):
        arch_for({**cfg, "layers_block_type": ["mamba", "moe", "attention", "moe"], "moe_latent_size": 16}, "config.json")


@pytest.mark.parametrize("model_type, missing", [
    ("kimi_linear", r"gguf package \([\d.]+\) knows llama\.cpp's 'kimi-linear' architecture, but finetuner's mapping to it is not written yet"),
    ("gemma3n_text", r"knows llama\.cpp's 'gemma3n' architecture, but finetuner's mapping to it is not written yet"),
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
    ("gemma4_text", {"enable_moe_block": True}, "mixture-of-experts block is not written by finetuner"),
    ("gemma4_text", {"attention_k_eq_v": True}, "keys reused as values"),
    ("qwen3_5_text", {"linear_value_head_dim": 32}, "llama.cpp's qwen35 takes one width for both"),
    ("mamba2", {"time_step_limit": [0.0, {"__float__": "Infinity"}], "num_heads": 4}, "is not the scan width"),
    ("mamba2", {"time_step_limit": [0.001, 0.1]}, "clamps dt"),
    ("falcon_mamba", {"use_conv_bias": False}, "no projection bias, a convolution bias"),
    ("lfm2_moe", {"routed_scaling_factor": 2.0}, "llama.cpp's lfm2moe"),
    ("granitemoehybrid", {"position_embedding_type": "rope"}, "turns no positions then"),
    ("granitemoehybrid", {"mamba_proj_bias": True}, "no projection bias, a convolution bias"),
    ("bamba", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "Bamba's positions unscaled"),
    ("bamba", {"mamba_conv_bias": False}, "no projection bias, a convolution bias"),
    ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "it gates, then norms"),
    ("falcon_h1", {"tie_word_embeddings": True, "embedding_multiplier": 2.0}, "cannot carry two multipliers"),
    ("falcon_h1", {"projectors_bias": True}, "no projection bias"),
    ("jamba", {"mamba_conv_bias": False}, "no projection bias, a convolution bias"),
    ("qwen3_next", {"norm_topk_prob": False}, "their weights renormalised"),
])
def test_what_llama_cpp_would_run_otherwise_is_refused(model_type, change, why):
    from finetuner.errors import UserError
    from finetuner.export.gguf_arch import arch_for

    cfg = {**tiny_with_ids(model_type, _qwen2_tokenizer()), **change}
    with pytest.raises(UserError, match=why):
        arch_for(cfg, "config.json")
    arch_for(tiny_with_ids(model_type, _qwen2_tokenizer()), "config.json")  # the same family without the change


def test_a_gguf_package_without_the_architecture_is_named_as_what_is_missing(monkeypatch):
    """A gguf package without llama.cpp's gemma3n (an older one): the refusal names the package and its version."""
    import gguf

    from finetuner.export.gguf_arch import not_written

    monkeypatch.setattr(gguf, "MODEL_ARCH_NAMES", {k: v for k, v in gguf.MODEL_ARCH_NAMES.items() if v != "gemma3n"})
    assert re.search(r"model_type 'gemma3n_text': the installed gguf package \([\d.]+\) has no 'gemma3n' "
                     "architecture; nothing was written", str(not_written("gemma3n_text", "config.json")))

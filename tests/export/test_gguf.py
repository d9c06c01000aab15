"""finetuner export: GGUF files that transformers' GGUF loader reads back with the merged model's
logits and the original tokenizer's ids; Ollama Modelfiles; Llama, Mistral and Qwen2 shapes; bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.export.gguf import export_model
from tests.conftest import HANG_GUARD_S, REPO, alpaca_rows, cli_in_process, corpus

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    data = tmp_path_factory.mktemp("gguf-data") / "alpaca.json"
    data.write_text(json.dumps(alpaca_rows(24)), encoding="utf-8")
    recipe = {
        "name": "gguf", "model": {"name": str(tiny_model_dir)}, "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 128, "system_prompt": "Be brief."},
        "training": {"max_steps": 3, "lr": 2e-2, "micro_batch_size": 4, "warmup_steps": 0},
        "checkpointing": {"save_every": 3}, "logging": {"tensorboard": False},
        "output_dir": str(tmp_path_factory.mktemp("gguf-run") / "run"),
    }
    return finetuner.train(Recipe.from_dict(recipe)).run_dir


def _spm_tokenizer():
    """A sentencepiece-style BPE (byte fallback, ▁ for spaces) like Llama 2's and Mistral's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials + [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = MISTRAL_TEMPLATE
    return fast


def _qwen2_tokenizer():
    """The tests' byte-level BPE, splitting text with Qwen2's regex (as Qwen2's tokenizer.json does)."""
    from tokenizers import Regex, pre_tokenizers

    from finetuner.export.gguf_vocab import QWEN2_SPLIT
    from finetuner.model.tiny_llama import train_bpe_tokenizer

    tok = train_bpe_tokenizer(corpus(), vocab_size=400)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def _save(model, tok, path):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    tok = _spm_tokenizer()
    cfg = MistralConfig(vocab_size=len(tok) + 5, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, sliding_window=None,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(1)
    return _save(MistralForCausalLM(cfg), tok, tmp_path_factory.mktemp("tiny_mistral"))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = _qwen2_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(2)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # biases that are not zero, so the check sees whether they were written
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return _save(model, tok, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3: per-head q/k norms (not ones, so the check sees whether they were written) and a head
    wider than hidden / heads (head_dim 32, as Qwen3-4B's 128 against 2560 / 32)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = _qwen2_tokenizer()  # Qwen3 keeps Qwen2's tokenizer
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1, 0.3)
            layer.self_attn.k_norm.weight.normal_(1, 0.3)
    return _save(model, tok, tmp_path_factory.mktemp("tiny_qwen3"))


def _fields(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    return reader, {k: f.contents() for k, f in reader.fields.items() if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")}


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_lora_run_to_f16_gguf_matches_the_merged_model(lora_run, tmp_path):
    import gguf

    out = tmp_path / "exports" / "tiny.gguf"
    r = export_model(lora_run, out, quant="f16")
    assert r.gguf_file == out and out.is_file() and r.architecture == "llama"
    assert r.max_abs_logit_diff is not None and r.max_abs_logit_diff <= r.tolerance and r.top1_agreement == 1.0
    assert 0 < r.max_weight_error < 1e-2 and r.tokenizer_texts >= 5 and r.peak_rss_bytes > 0
    assert _leftovers(out.parent) == []
    reader, f = _fields(out)
    assert f["general.architecture"] == "llama" and f["general.file_type"] == 1
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert "<|im_start|>" in f["tokenizer.chat_template"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lora_run / "adapter")
    assert f["tokenizer.ggml.eos_token_id"] == tok.eos_token_id and f["tokenizer.ggml.bos_token_id"] == tok.bos_token_id
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16 and types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert "output.weight" not in types  # tied embeddings: llama.cpp reuses token_embd
    names = {name for _, name in gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2).mapping.values()}
    assert {n.rsplit(".", 1)[0] for n in types} <= names

    again = cli_in_process("export", str(lora_run), "-o", str(out))
    assert again.returncode == 2 and "exists" in again.stderr and "--overwrite" in again.stderr and "Traceback" not in again.stderr


def test_cli_ollama_q8_0_writes_modelfile_and_reports_top1(lora_run, tmp_path):
    out = tmp_path / "Tern Model"
    p = cli_in_process("export", str(lora_run), "--format", "ollama", "--quant", "q8_0", "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert re.search(r"top-1 agreement 100% on \d+ tokens", p.stdout), p.stdout
    assert re.search(r"max \|logit difference\| [0-9.e-]+", p.stdout)
    assert f"ollama create tern-model -f {out / 'Modelfile'}" in p.stdout
    assert p.stdout.rstrip().endswith("Then chat with it: ollama run tern-model")
    assert sorted(x.name for x in out.iterdir()) == [".finetuner-export.json", "Modelfile", "model.gguf"]
    text = (out / "Modelfile").read_text(encoding="utf-8")
    assert "FROM ./model.gguf" in text and "{{ range .Messages }}" in text.replace("{{- ", "{{ ")
    assert '<|im_start|>{{ .Role }}' in text and 'PARAMETER stop "<|im_end|>"' in text
    assert 'SYSTEM """Be brief."""' in text
    _, f = _fields(out / "model.gguf")
    assert f["general.file_type"] == 7
    p = cli_in_process("export", str(lora_run), "--format", "ollama", "--quant", "q4_0", "-o", str(out), "--overwrite", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["quant"] == "q4_0" and r["top1_agreement"] is not None and r["max_abs_logit_diff"] is not None
    assert _fields(out / "model.gguf")[1]["general.file_type"] == 2 and _leftovers(tmp_path) == []


def test_mistral_sentencepiece_model_folder(mistral_dir, tmp_path):
    r = export_model(mistral_dir, tmp_path / "m.gguf", quant="f32")
    assert r.max_abs_logit_diff <= r.tolerance and r.max_weight_error == 0.0 and r.top1_agreement == 1.0
    reader, f = _fields(tmp_path / "m.gguf")
    assert f["tokenizer.ggml.model"] == "llama" and f["general.architecture"] == "llama"
    assert "output.weight" in {t.name for t in reader.tensors}  # untied head written
    assert f["tokenizer.ggml.add_bos_token"] is False  # this tokenizer adds no BOS itself
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert types[tokens.index("<0x41>")] == 6 and types[tokens.index("<s>")] == 3 and tokens[-1].startswith("[PAD")
    o = export_model(mistral_dir, tmp_path / "ollama", format="ollama", quant="f16", verify=False)
    text = o.modelfile.read_text(encoding="utf-8")
    assert "[INST]" in text and 'PARAMETER stop "</s>"' in text and o.max_abs_logit_diff is None


def test_qwen2_with_biases_q8_0(qwen2_dir, tmp_path):
    import gguf

    r = export_model(qwen2_dir, tmp_path / "q.gguf", quant="q8_0")
    assert r.architecture == "qwen2" and r.top1_agreement >= 0.9
    reader, f = _fields(tmp_path / "q.gguf")
    assert f["tokenizer.ggml.pre"] == "qwen2"
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.1.attn_k.bias"] == gguf.GGMLQuantizationType.F32 and types["blk.1.ffn_up.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_qwen3_with_qk_norms_f16(qwen3_dir, tmp_path):
    r = export_model(qwen3_dir, tmp_path / "q3.gguf", quant="f16")
    assert r.architecture == "qwen3" and r.top1_agreement >= 0.9, r
    # the file holds the head width; transformers' reader of qwen3 maps none, so the check is told it
    assert any("head_dim 32" in n for n in r.notes), r.notes
    reader, f = _fields(tmp_path / "q3.gguf")
    assert f["general.architecture"] == "qwen3" and f["tokenizer.ggml.pre"] == "qwen2"
    assert f["qwen3.attention.key_length"] == 32 and f["qwen3.attention.value_length"] == 32
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names


# ------------------------------------------------------------------ bad input: clear errors, nothing written
def _refused(tmp_path, *args, match):
    before = sorted(p.name for p in tmp_path.iterdir())
    p = cli_in_process("export", *args)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert re.search(match, p.stderr), p.stderr
    assert "Traceback" not in p.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    return p


def test_refuses_run_without_adapter(tmp_path, lora_run):
    import shutil

    run = tmp_path / "unfinished"
    run.mkdir()
    shutil.copy(lora_run / "recipe.yaml", run / "recipe.yaml")
    _refused(tmp_path, str(run), "-o", str(tmp_path / "x.gguf"), match="has no adapter/ folder")


def test_refuses_unsupported_architecture(tmp_path):
    model = tmp_path / "olmo"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "olmo2", "vocab_size": 10}), encoding="utf-8")
    _refused(tmp_path, str(model), "-o", str(tmp_path / "x.gguf"), match=r"model_type 'olmo2'.*Llama family.*Mistral.*Qwen2.*Phi-3.*Gemma 2.*Gemma 3")


@pytest.mark.parametrize("model_type", ["phi3", "gemma2", "gemma3_text", "qwen3_moe"])
def test_phi3_and_gemma_export_as_llama_cpp_reads_them(model_type, tmp_path):
    """Phi-3's fused qkv and gate_up; Gemma 2's and 3's 1 + weight norms, Gemma 2's soft-capping, their sliding
    windows (8, under the check's longer prompt), Gemma 3's linearly scaled global RoPE. llama.cpp itself ran these
    tiny shapes: docs/validation/llama_cpp_check_{phi3,gemma2,gemma3_text}.md. Qwen3-MoE: the checkpoint's one matrix
    an expert stacked into llama.cpp's ffn_{gate,up,down}_exps, the router as ffn_gate_inp, the expert counts in the
    metadata (llama_cpp_check_qwen3_moe.md)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = _qwen2_tokenizer()
    extra = {"gemma2": dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=32),
             "gemma3_text": dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=32, num_hidden_layers=6,
                                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
             "phi3": dict(original_max_position_embeddings=256, rope_scaling=None, tie_word_embeddings=False),
             "qwen3_moe": dict(head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                               norm_topk_prob=True, tie_word_embeddings=False)}[model_type]
    cfg = AutoConfig.for_model(model_type, **{**dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id), **extra})
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms that are not all ones (Gemma's: not all zeros), so a norm written wrong shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.5, 0.3)
    folder = _save(model, tok, tmp_path / model_type)
    r = export_model(folder, tmp_path / "m.gguf", quant="f16")
    assert r.architecture == {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}.get(model_type, model_type) \
        and r.top1_agreement >= 0.9, r
    reader, f = _fields(tmp_path / "m.gguf")
    names = {t.name for t in reader.tensors}
    if model_type == "qwen3_moe":
        assert {"blk.0.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight",
                "blk.0.ffn_gate_inp.weight", "blk.0.attn_q_norm.weight"} <= names
        assert f["qwen3moe.expert_count"] == 4 and f["qwen3moe.expert_used_count"] == 2
        assert f["qwen3moe.expert_feed_forward_length"] == 32
        gate = {t.name: t for t in reader.tensors}["blk.1.ffn_gate_exps.weight"].data
        experts = model.model.layers[1].mlp.experts  # transformers holds gate and up fused, the gate first
        torch.testing.assert_close(torch.as_tensor(gate.copy()).float(), experts.gate_up_proj[:, :32].float(),
                                   atol=1e-3, rtol=1e-3)
    elif model_type == "phi3":
        assert {"blk.0.attn_qkv.weight", "blk.1.ffn_up.weight", "output.weight"} <= names
        assert f["phi3.rope.dimension_count"] == 16
    elif model_type == "gemma3_text":
        assert {"blk.5.attn_q_norm.weight", "blk.0.post_ffw_norm.weight"} <= names and "output.weight" not in names
        assert f["gemma3.attention.sliding_window"] == 8 and f["gemma3.rope.scaling.factor"] == 8.0
    else:
        assert {"blk.0.post_attention_norm.weight", "blk.1.post_ffw_norm.weight"} <= names and "output.weight" not in names
        assert f["gemma2.attention.sliding_window"] == 8 and f["gemma2.final_logit_softcapping"] == 30.0
        w = {t.name: t for t in reader.tensors}["blk.0.attn_norm.weight"].data
        torch.testing.assert_close(torch.as_tensor(w.copy()).float(), model.model.layers[0].input_layernorm.weight.float() + 1)


def test_a_qwen3_moe_that_is_not_llama_cpps_is_refused():
    from finetuner.errors import UserError
    from finetuner.export.gguf_arch import arch_for

    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "vocab_size": 10, "max_position_embeddings": 64, "intermediate_size": 128, "norm_topk_prob": False}
    with pytest.raises(UserError, match="norm_topk_prob=false"):
        arch_for(cfg, "moe")
    with pytest.raises(UserError, match="mlp_only_layers"):
        arch_for({**cfg, "norm_topk_prob": True, "mlp_only_layers": [0]}, "moe")


def test_gemma2_with_another_query_scale_is_refused(tmp_path):
    from finetuner.errors import UserError
    from finetuner.export.gguf_arch import arch_for

    cfg = {"model_type": "gemma2", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "num_hidden_layers": 2,
           "query_pre_attn_scalar": 256, "vocab_size": 10, "max_position_embeddings": 64, "intermediate_size": 128}
    with pytest.raises(UserError, match="query_pre_attn_scalar 256"):
        arch_for(cfg, "gemma2")


def test_cli_offers_the_quant_types_the_exporter_writes():
    from finetuner.cli import export as cli_export
    from finetuner.export import gguf as exporter

    assert set(cli_export.QUANTS) == set(exporter.QUANTS) and set(cli_export.FORMATS) == set(exporter.FORMATS)


def test_refuses_unknown_quant_and_k_quant_without_llama_cpp(tmp_path, tiny_model_dir):
    _refused(tmp_path, str(tiny_model_dir), "-o", str(tmp_path / "x.gguf"), "--quant", "q3_xs", match="invalid choice: 'q3_xs'")
    # an environment without llama-cpp-python (the CLI's own python, with llama_cpp made unimportable)
    code = ("import sys, importlib.util; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'llama_cpp' else real(n, *a); "
            "from finetuner.cli.main import main; sys.exit(main(sys.argv[1:]))")
    before = sorted(p.name for p in tmp_path.iterdir())
    p = subprocess.run([sys.executable, "-c", code, "export", str(tiny_model_dir), "-o", str(tmp_path / "x.gguf"), "--quant", "q4_k_m"],
                       cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 2 and "llama-cpp-python is not installed" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_refuses_existing_output_folder_and_bad_names(tmp_path, tiny_model_dir):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine", encoding="utf-8")
    _refused(tmp_path, str(tiny_model_dir), "--format", "ollama", "-o", str(out), match="not empty")
    assert (out / "keep.txt").read_text(encoding="utf-8") == "mine"
    _refused(tmp_path, str(tiny_model_dir), "-o", str(tmp_path / "model.bin"), match=r"does not end in \.gguf")


def test_refuses_unrepresentable_tokenizer(tmp_path, tiny_model_dir):
    import shutil

    from tokenizers import normalizers
    from transformers import AutoTokenizer

    model = tmp_path / "lower"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    tok.save_pretrained(model)
    _refused(tmp_path, str(model), "-o", str(tmp_path / "x.gguf"), match=r"cannot be represented in a GGUF file: .*'Lowercase' normalizer")


def test_modelfile_for_llama3_template_and_refusal_of_unknown_family():
    from finetuner.data.pipeline import FALLBACK_CHAT_TEMPLATE
    from finetuner.errors import UserError
    from finetuner.export.ollama import modelfile

    llama3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + "
              "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
    text = modelfile("model.gguf", llama3, system=None, eos_token="<|eot_id|>")
    assert "<|start_header_id|>{{ .Role }}<|end_header_id|>" in text and 'PARAMETER stop "<|eot_id|>"' in text
    assert text.count('PARAMETER stop "<|eot_id|>"') == 1 and "SYSTEM" not in text
    with pytest.raises(UserError, match="not ChatML, Llama 3, Mistral or finetuner's plain fallback"):
        modelfile("model.gguf", "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    plain = modelfile("model.gguf", FALLBACK_CHAT_TEMPLATE, eos_token="<|im_end|>")  # a base model's run without one
    assert "(finetuner-plain chat template)" in plain and '{{ if eq .Role "assistant" }}<|im_end|>{{ end }}' in plain
    assert 'PARAMETER stop "<|user|>"' in plain and 'PARAMETER stop "<|im_end|>"' in plain


def test_an_image_text_to_text_gemma3_exports_its_language_model(tmp_path):
    """A Gemma 3 checkpoint with its vision tower (as google/gemma-3-4b-it and up are): the GGUF holds the
    language model as llama.cpp's gemma3 reads it, the vision tensors are left out and the export says so."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetuner.model.tiny import tiny_config

    tok = _qwen2_tokenizer()
    cfg = tiny_config("gemma3", len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cfg["text_config"].update(head_dim=32, query_pre_attn_scalar=32)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    folder = _save(model, tok, tmp_path / "gemma3")
    r = export_model(folder, tmp_path / "g.gguf", quant="f16")
    assert r.architecture == "gemma3" and r.top1_agreement >= 0.9, r
    assert any("its vision tower and projector are not" in n for n in r.notes), r.notes
    reader, f = _fields(tmp_path / "g.gguf")
    assert f["general.architecture"] == "gemma3" and not any("v." in t.name[:2] or "mm" in t.name for t in reader.tensors)
    assert {"token_embd.weight", "blk.1.ffn_down.weight"} <= {t.name for t in reader.tensors}


#: SmolLM2-135M-Instruct's published chat template: a default system block when the conversation has none
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
                    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _ollama_prompt(modelfile_text: str, messages: list[dict]) -> str:
    """What Ollama sends the model for ``messages`` under this Modelfile: its SYSTEM as the first message when the
    conversation has none, then the ChatML TEMPLATE's loop over the messages (the template finetuner writes, read
    back from the file and checked to be that one)."""
    from finetuner.export.ollama import CHATML

    template = re.search(r'TEMPLATE """(.*?)"""', modelfile_text, re.DOTALL)[1]
    assert template == CHATML
    system = re.search(r'SYSTEM """(.*?)"""', modelfile_text, re.DOTALL)
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system[1]}] + messages
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def test_the_modelfile_prompts_as_training_did_with_the_templates_own_system_block(tiny_model_dir, tmp_path):
    """Issue 38: SmolLM2's template writes its own system block when a conversation has none, and every example
    without a system prompt trained with it; the Modelfile says it as SYSTEM, so Ollama's prompt has the same
    token ids as the training template's."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "smol-like"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["chat_template"] = SMOLLM2_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    r = export_model(model, tmp_path / "ollama", format="ollama", quant="f16", verify=False)
    text = r.modelfile.read_text(encoding="utf-8")
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""' in text
    assert any("writes a system block of its own" in n for n in r.notes) and r.ollama_run == "ollama run ollama"
    tok = AutoTokenizer.from_pretrained(model)
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Answer as the ferry desk."}, {"role": "user", "content": "When?"}]):
        trained = tok.apply_chat_template(messages, chat_template=SMOLLM2_TEMPLATE, tokenize=False, add_generation_prompt=True)
        assert tok(_ollama_prompt(text, messages))["input_ids"] == tok(trained)["input_ids"]


def test_a_run_trained_in_the_fallback_tool_format_gets_ollamas_tool_calling_in_its_template():
    """No Ollama binary here: the TEMPLATE is checked as text. It holds Ollama's .Tools and .ToolCalls written as
    finetuner's fallback writes them (the tools block of FALLBACK_SYSTEM, <tool_call> blocks, <tool_response>
    turns), its Go actions balanced; a family finetuner writes no such template for is refused."""
    from finetuner.data.tools import FALLBACK_FORMAT, FALLBACK_SYSTEM
    from finetuner.errors import UserError
    from finetuner.export.ollama import CHATML, CHATML_HERMES_TOOLS, modelfile

    text = modelfile("model.gguf", SMOLLM2_TEMPLATE, system=None, eos_token="<|im_end|>", tools_format=FALLBACK_FORMAT)
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.DOTALL)[1]
    assert template == CHATML_HERMES_TOOLS
    head, tail = FALLBACK_SYSTEM.split("{tools}")
    assert template.count(head) == 2 and template.count(tail.replace("{{", "{").replace("}}", "}")) == 2  # with or without a system message
    for action in ("range $i, $t := $.Tools", "{{ $t.Function }}", "range $i, $c := .ToolCalls", "{{ $c.Function.Name }}",
                   "{{ $c.Function.Arguments }}", "<tool_response>\n{{ .Content }}\n</tool_response>"):
        assert action in template, action
    opened = len(re.findall(r"\{\{-? ?(if|range) ", template))
    assert opened == len(re.findall(r"\{\{-? ?end ?-?\}\}", template)) and opened >= 10
    assert 'PARAMETER stop "<|im_end|>"' in text
    plain = modelfile("model.gguf", SMOLLM2_TEMPLATE, tools_format="template")
    assert f'TEMPLATE """{CHATML}"""' in plain and ".Tools" not in plain
    llama3 = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}"
    with pytest.raises(UserError, match="fallback format \\(hermes\\) on a llama3 chat template"):
        modelfile("model.gguf", llama3, tools_format=FALLBACK_FORMAT)

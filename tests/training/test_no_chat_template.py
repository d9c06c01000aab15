"""A base model without a chat template, as a user meets it through the CLI: the plan says which template the run
trains with and why ("no chat template in the tokenizer: finetuner's plain template ..."), the run trains with it
(its samples too) and keeps it with the adapter, ``chat`` says it and renders with it, and the GGUF export carries it
as ``tokenizer.chat_template`` with the Ollama Modelfile written in the same form. One decision
(:mod:`finetuner.data.template_choice`). The base is a tiny Llama written as a Q8_0 GGUF file with no template
(:mod:`tests.model.gguf_files`)."""

from __future__ import annotations

import json

import pytest

from finetuner.data.template_choice import FALLBACK_CHAT_TEMPLATE
from finetuner.runs.events import read_events
from tests.conftest import cli_in_process, run_cli

SAID = "no chat template in the tokenizer: finetuner's plain template"


@pytest.fixture(scope="module")
def untemplated_run(tmp_path_factory):
    from finetuner.model.tiny_llama import train_bpe_tokenizer
    from tests.conftest import corpus
    from tests.model.gguf_files import write_tiny_gguf

    work = tmp_path_factory.mktemp("no-template")
    tok = train_bpe_tokenizer(corpus(), vocab_size=400)
    tok.chat_template = None
    base = write_tiny_gguf("llama", tok, work / "base.Q8_0.gguf")
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"ping {i}"},
                                                      {"role": "assistant", "content": f"pong {i}"}]}) + "\n"
                            for i in range(24)), encoding="utf-8")
    plan = run_cli("plan", "--model", str(base), "--gpu", "cpu", "--data", str(data), "-o", str(work / "recipe.yaml"), cwd=work)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    run = cli_in_process("run", str(work / "recipe.yaml"), "-o", str(work / "run"), "--set", "training.max_steps=2",
                         "--set", "training.eval_every=2", "--set", "data.max_seq_len=64",
                         "--set", "samples.prompts=[\"ping 3\"]", "--set", "samples.max_new_tokens=3", cwd=work)
    assert run.returncode == 0, run.stdout + run.stderr
    return {"work": work, "base": base, "plan": " ".join(plan.stdout.split()), "run": work / "run"}


def test_the_plan_says_which_template_and_why(untemplated_run):
    assert f"Chat template: {SAID}" in untemplated_run["plan"], untemplated_run["plan"]
    assert "Ollama Modelfile use the same one" in untemplated_run["plan"]


def test_the_run_trains_with_it_and_keeps_it_with_the_adapter(untemplated_run):
    run = untemplated_run["run"]
    saved = json.loads((run / "adapter" / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    if saved is None:  # transformers 5 writes it beside the config
        saved = (run / "adapter" / "chat_template.jinja").read_text(encoding="utf-8")
    assert saved == FALLBACK_CHAT_TEMPLATE
    samples = next(e for e in read_events(run / "events.jsonl") if e["event"] == "samples")["samples"]
    assert samples and samples[0]["prompt"] == "ping 3"


def test_chat_says_it_and_renders_with_it(untemplated_run):
    for source in (str(untemplated_run["base"]), str(untemplated_run["run"])):
        r = cli_in_process("chat", source, "--prompt", "ping 1", "--temperature", "0", "--max-new-tokens", "2")
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"chat template: {SAID}" in " ".join(r.stderr.split()), r.stderr


def test_the_export_and_the_modelfile_carry_it(untemplated_run):
    from gguf import GGUFReader

    out = untemplated_run["work"] / "ollama"
    r = cli_in_process("export", str(untemplated_run["run"]), "-o", str(out), "--format", "ollama", "--quant", "f16", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    reader = GGUFReader(str(out / "model.gguf"))
    field = reader.fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode("utf-8") == FALLBACK_CHAT_TEMPLATE
    text = (out / "Modelfile").read_text(encoding="utf-8")
    assert "(finetuner-plain chat template)" in text and "<|{{ .Role }}|>" in text and 'PARAMETER stop "<|user|>"' in text


def test_a_tokenizer_that_begins_every_text_with_bos_gets_the_plain_template_begun_with_it():
    """Gemma's and Llama 2's tokenizers put BOS before every text; chat-rendered text is tokenized without the
    tokenizer's special tokens, so the plain template writes it itself (tests/model/test_gemma3_gguf_real.py: the
    real Gemma 3 270M's first-step loss 8.64 without it, 5.10 with it). A tokenizer that adds none keeps the plain one."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from finetuner.data.template_choice import FALLBACK_BOS_CHAT_TEMPLATE, adds_bos, choose, for_tokenizer
    from finetuner.export.gguf_verify import probe_ids

    def tokenizer(with_bos: bool):
        vocab = {"<bos>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz<>|?!,.\n ")}}
        raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        if with_bos:
            raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
        return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="</s>", unk_token="<unk>")

    plain, bos = tokenizer(False), tokenizer(True)
    assert (adds_bos(plain), adds_bos(bos)) == (False, True)
    assert for_tokenizer(None, plain).template == FALLBACK_CHAT_TEMPLATE
    chosen = for_tokenizer(None, bos)
    assert chosen.template == FALLBACK_BOS_CHAT_TEMPLATE and chosen.source == "fallback"
    assert "begun with the tokenizer's beginning-of-sequence token" in chosen.why
    assert choose(None, FALLBACK_BOS_CHAT_TEMPLATE).source == "fallback"  # as the adapter keeps it: the same decision
    assert for_tokenizer("{{ 'x' }}", bos).source == "recipe"
    rendered = bos.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=chosen.template, tokenize=False)
    assert rendered.startswith("<bos><|user|>")
    # the export's logit probe keeps that first token when it cuts the conversation to its last tokens
    ids, _ = probe_ids(bos, chosen.template, max_tokens=8)
    assert ids.shape == (1, 8) and int(ids[0, 0]) == 0 and 0 not in ids[0, 1:].tolist()

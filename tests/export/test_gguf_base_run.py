"""A GGUF file as the base of a run, through the CLI as a user meets it: the plan says the weights are
dequantized, LoRA trains on them, the start event says so, and merge and GGUF export of the run load
back in transformers. The base is the tests' tiny Llama written as a Q8_0 GGUF by finetuner's own export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetuner.runs.events import read_events
from tests.conftest import REPO, cli_in_process, run_cli


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory, tiny_model_dir):
    """``finetuner plan --model tiny.Q8_0.gguf`` then ``finetuner run`` of its recipe (a few LoRA steps)."""
    from finetuner.export.gguf import export_model

    work = tmp_path_factory.mktemp("gguf-base")
    base = work / "models" / "tiny.Q8_0.gguf"
    base.parent.mkdir()
    export_model(str(tiny_model_dir), base, quant="q8_0", verify=False)
    plan = run_cli("plan", "--model", str(base), "--gpu", "cpu", "--data", str(REPO / "data" / "chat_sample.jsonl"),
                   "-o", str(work / "recipe.yaml"), cwd=work)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    recipe = yaml.safe_load((work / "recipe.yaml").read_text(encoding="utf-8"))
    run = cli_in_process("run", str(work / "recipe.yaml"), "-o", str(work / "run"), "--set", "training.max_steps=3",
                  "--set", "training.eval_every=3", "--set", "data.max_seq_len=64", cwd=work)
    assert run.returncode == 0, run.stdout + run.stderr
    return {"base": base, "plan": plan.stdout, "recipe": recipe, "run_out": run.stdout, "run": work / "run", "work": work}


def test_the_plan_says_the_weights_are_dequantized(gguf_run):
    out = " ".join(gguf_run["plan"].split())
    assert "dequantized from 8-bit Q8_0 in the GGUF file tiny.Q8_0.gguf" in out
    assert "trains in full precision from the dequantized weights" in out and "not the original full-precision weights" in out
    assert gguf_run["recipe"]["model"]["name"] == str(gguf_run["base"])


def test_lora_trains_on_it_and_the_start_event_says_dequantized(gguf_run):
    events = read_events(gguf_run["run"] / "events.jsonl")
    start = next(e for e in events if e["event"] == "start")
    assert start["gguf"]["quant_type"] == "Q8_0" and start["gguf"]["bits"] == 8
    assert start["gguf"]["file"] == str(gguf_run["base"]) and "dequantized from 8-bit" in start["gguf"]["note"]
    assert start["method"] == "lora" and start["trainable_params"] > 0
    assert "dequantized from 8-bit" in " ".join(gguf_run["run_out"].split())  # the CLI's start line
    assert sum(e["event"] == "step" for e in events) == 3
    # its first load dequantized the file (into the conversion cache): the run's predicted load counts it, though
    # the prediction is made after the load (the trainer records what the load would do before it loads)
    assert any("the GGUF file dequantized" in a for a in start["predicted_speed"]["wait"]["assumptions"]), start["predicted_speed"]
    adapter = json.loads((gguf_run["run"] / "adapter" / "adapter_config.json").read_text(encoding="utf-8"))
    assert adapter["base_model_name_or_path"] == str(gguf_run["base"])  # the file, not its folder


def test_merge_of_the_run_loads_back_in_transformers(gguf_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = gguf_run["work"] / "merged"
    r = cli_in_process("merge", str(gguf_run["run"]), "-o", str(out), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "fp32" and result["max_abs_diff"] <= result["tolerance"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "llama" and tok.chat_template
    with torch.no_grad():
        assert torch.isfinite(model(**tok("Hello there", return_tensors="pt")).logits).all()


def test_gguf_export_of_the_run_loads_back_in_transformers(gguf_run):
    import torch
    from transformers import AutoModelForCausalLM

    out = gguf_run["work"] / "export" / "tuned.f16.gguf"
    r = cli_in_process("export", str(gguf_run["run"]), "-o", str(out), "--quant", "f16", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["top1_agreement"] == 1.0 and result["max_abs_logit_diff"] <= result["tolerance"]
    model = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2


def test_chat_answers_from_the_gguf_base_and_the_run(gguf_run):
    for source in (str(gguf_run["base"]), str(gguf_run["run"])):
        r = cli_in_process("chat", source, "--prompt", "Hello", "--temperature", "0", "--max-new-tokens", "5")
        assert r.returncode == 0, r.stdout + r.stderr


def test_a_missing_gguf_is_one_clear_error_in_the_cli(tmp_path):
    r = run_cli("plan", "--model", str(tmp_path / "nope.Q4_K_M.gguf"), "--gpu", "cpu")
    assert r.returncode != 0 and "nope.Q4_K_M.gguf' does not exist" in r.stderr and "Traceback" not in r.stderr
    r = cli_in_process("chat", str(tmp_path / "nope.gguf"), "--prompt", "hi")
    assert r.returncode != 0 and "nope.gguf' does not exist" in r.stderr and "Traceback" not in r.stderr

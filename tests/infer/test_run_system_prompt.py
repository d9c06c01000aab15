"""A system prompt that every training row carries is the run's default: the run summary says so, ``chat`` asks
with it, and the Ollama export's Modelfile says it as SYSTEM (issue 55: they answered without it, and the Modelfile
said SmolLM2's own default)."""

from __future__ import annotations

import json

import pytest

import finetuner
from finetuner.data.pipeline import shared_system
from tests.conftest import REPO, cli_in_process, write_recipe

SYSTEM = "You are the ferry desk of Tern Island. Answer in one short sentence."
QUESTION = "When does the last ferry leave?"


def _rows(n: int, system=lambda i: SYSTEM) -> list[dict]:
    return [{"messages": [{"role": "system", "content": system(i)},
                          {"role": "user", "content": f"Question {i}: when does ferry {i} leave?"},
                          {"role": "assistant", "content": f"Ferry {i} leaves at {8 + i % 10}:00 from pier {i % 3}."}]}
            for i in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step LoRA run of the demo model on rows that all carry :data:`SYSTEM`, trained with ``finetuner run``
    (its printed summary kept)."""
    tmp = tmp_path_factory.mktemp("sysprompt")
    data = tmp / "ferry.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(12)), encoding="utf-8")
    recipe = write_recipe(tmp / "recipe.yaml", {
        "name": "ferry", "model": {"name": str(REPO / "data" / "demo_model")},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 128, "val_size": 0},
        "training": {"max_steps": 1, "micro_batch_size": 4, "warmup_steps": 0, "general_probe": 0},
        "logging": {"tensorboard": False}, "output_dir": str(tmp / "run"),
    })
    p = cli_in_process("run", str(recipe))
    assert p.returncode == 0, p.stderr
    return tmp / "run", p.stdout


def test_the_run_summary_says_the_shared_system_prompt(trained):
    run, printed = trained
    assert f"System prompt: every training row carried {SYSTEM!r}" in " ".join(printed.split())
    assert json.loads((run / "metrics.json").read_text(encoding="utf-8"))["data"]["system_prompt"] == SYSTEM


def test_chat_asks_with_the_runs_system_prompt_unless_told_otherwise(trained):
    run, _ = trained
    chat = finetuner.load_chat_model(run)
    assert chat.system == SYSTEM
    rendered = chat.render([{"role": "user", "content": QUESTION}])
    assert rendered.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}")
    p = cli_in_process("chat", str(run), "-p", QUESTION, "--temperature", "0", "--max-new-tokens", "4")
    assert p.returncode == 0, p.stderr
    assert f"system prompt: the run's, {SYSTEM!r}" in p.stderr
    # the same answer as with the system prompt given by hand
    given = cli_in_process("chat", str(run), "-p", QUESTION, "--temperature", "0", "--max-new-tokens", "4",
                           "--system", SYSTEM)
    assert given.returncode == 0 and given.stdout == p.stdout and "the run's" not in given.stderr
    without = cli_in_process("chat", str(run), "-p", QUESTION, "--system", "", "--max-new-tokens", "1")
    assert without.returncode == 0 and "system prompt" not in without.stderr


def test_the_ollama_modelfile_says_the_runs_system_prompt(trained, tmp_path):
    run, _ = trained
    out = tmp_path / "ollama"
    p = cli_in_process("export", str(run), "--format", "ollama", "--quant", "f16", "-o", str(out), "--no-verify")
    assert p.returncode == 0, p.stderr
    text = (out / "Modelfile").read_text(encoding="utf-8")
    assert f'SYSTEM """{SYSTEM}"""' in text, text  # the rows', not the template's own default


def test_rows_with_different_or_missing_system_prompts_share_none():
    from finetuner.data.formats import normalize

    same = [normalize(r, "chat") for r in _rows(3)]
    assert shared_system(same) == SYSTEM
    assert shared_system([normalize(r, "chat") for r in _rows(3, system=lambda i: f"{SYSTEM} ({i})")]) is None
    no_system = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert shared_system([*same, normalize(no_system, "chat")]) is None
    assert shared_system([{"prompt": "a", "completion": "b"}]) is None

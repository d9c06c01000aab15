"""Reasoning said (issue 68): the plan, the run's start line and metrics.json say how many rows carry reasoning, in
which form (inline <think>, reasoning_content), how the chat template renders it and whether its tokens are trained
(labelled) or dropped: one description, finetuner.data.thinking.statement. Each claim is checked against the
trainer's own labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.data.formats import IGNORE_INDEX
from finetuner.data.pipeline import encode_example
from finetuner.data.stats import profile_data
from tests.conftest import REPO, cli_in_process, write_recipe

DEMO = REPO / "data" / "demo_model"  # a ChatML template: renders no reasoning_content
QWEN3 = (Path(__file__).parent / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()


def think_rows(n: int = 6) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i}+{i}?"},
                          {"role": "assistant", "content": f"<think>\n{i} and {i} make {2 * i}.\n</think>\n\nIt is {2 * i}."}]}
            for i in range(n)]


def field_rows(n: int = 6) -> list[dict]:
    """Two exchanges a row, each reply with its reasoning_content (Qwen3's template drops the first one's)."""
    return [{"messages": [{"role": "user", "content": f"What is {i}+1?"},
                          {"role": "assistant", "content": f"It is {i + 1}.", "reasoning_content": f"{i} plus one."},
                          {"role": "user", "content": f"And {i}+2?"},
                          {"role": "assistant", "content": f"It is {i + 2}.", "reasoning_content": f"{i} plus two."}]}
            for i in range(n)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> Path:
    """The demo model with Qwen3's chat template (takes enable_thinking, renders reasoning_content itself and drops
    the reasoning of turns before the last user message)."""
    folder = tmp_path_factory.mktemp("qwen3-reasoning")
    for f in DEMO.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f)
    (folder / "chat_template.jinja").write_text(QWEN3)
    return folder


def labels_text(tok, template: str, row: dict, **settings) -> str:
    enc = encode_example(row, tok, template, 4096, False, settings.get("thinking", "auto"),
                         settings.get("reasoning", "auto"))
    return tok.decode([t for t in enc["labels"] if t != IGNORE_INDEX])


def plan(model: Path, data: Path) -> tuple[dict, str]:
    said = cli_in_process("plan", "--model", str(model), "--gpu", "cpu", "--data", str(data), "--json")
    assert said.returncode == 0, said.stderr
    text = cli_in_process("plan", "--model", str(model), "--gpu", "cpu", "--data", str(data))
    assert text.returncode == 0, text.stderr
    return json.loads(said.stdout)["data"]["thinking"], " ".join(text.stdout.split())


def tiny_run(model: Path, data: Path, folder: Path) -> tuple[dict, str]:
    """Two LoRA steps on the CPU through ``finetuner run``: metrics.json's data.thinking and the console."""
    recipe = write_recipe(folder / "r.yaml", {
        "name": "reasoned", "model": {"name": str(model)}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 128, "val_size": 0, "cache": False},
        "training": {"max_steps": 2, "lr": 1e-2, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0,
                     "general_probe": 0},
        "samples": {"prompts": []}, "logging": {"tensorboard": False}, "output_dir": str(folder / "run")})
    out = cli_in_process("run", str(recipe))
    assert out.returncode == 0, out.stderr
    metrics = json.loads(next((folder / "run").rglob("metrics.json")).read_text())
    return metrics["data"]["thinking"], " ".join((out.stdout + out.stderr).split())


def test_a_think_file_says_its_reasoning_is_inline_and_trained(tmp_path):
    from transformers import AutoTokenizer

    data = write_rows(tmp_path / "think.jsonl", think_rows())
    stated, text = plan(DEMO, data)
    assert {k: stated[k] for k in ("rows", "reasoning_rows", "forms", "renders", "drops_history", "turns",
                                   "trained_turns", "dropped_turns", "trained", "value")} == {
        "rows": 6, "reasoning_rows": 6, "forms": {"think_tags": 6, "reasoning_content": 0}, "renders": "inline",
        "drops_history": False, "turns": 6, "trained_turns": 6, "dropped_turns": 0, "trained": "all", "value": None}
    sentence = ("reasoning in 6 of 6 row(s) (6 inline <think>...</think>); the inline blocks stay in the reply as the "
                "data wrote them; trained: the reasoning of 6 assistant turn(s) is labelled (in the loss with its "
                "answer) (data.reasoning: auto)")
    assert stated["reason"] == sentence and f"Note: {sentence}" in text
    tok = AutoTokenizer.from_pretrained(DEMO)  # what "labelled" claims: the trainer's labels hold the reasoning
    assert labels_text(tok, tok.chat_template, think_rows()[1]) == "<think>\n1 and 1 make 2.\n</think>\n\nIt is 2.<|im_end|>\n"

    ran, console = tiny_run(DEMO, data, tmp_path)
    assert ran == stated  # metrics.json keeps what the plan said
    assert f"data.reasoning keep ({sentence})" in console  # the run's start line


def test_a_reasoning_content_file_says_which_turns_are_trained_and_which_the_template_drops(qwen3_model, tmp_path):
    from transformers import AutoTokenizer

    data = write_rows(tmp_path / "field.jsonl", field_rows())
    stated, text = plan(qwen3_model, data)
    assert {k: stated[k] for k in ("rows", "reasoning_rows", "forms", "renders", "drops_history", "turns",
                                   "trained_turns", "dropped_turns", "trained", "value", "thinking_rows")} == {
        "rows": 6, "reasoning_rows": 6, "forms": {"think_tags": 0, "reasoning_content": 6}, "renders": "template",
        "drops_history": True, "turns": 12, "trained_turns": 6, "dropped_turns": 6, "trained": "some", "value": "on",
        "thinking_rows": 6}
    sentence = ("the chat template takes enable_thinking: 6 row(s) with reasoning in its thinking form "
                "(enable_thinking=True, the reasoning labelled); reasoning in 6 of 6 row(s) (6 as reasoning_content); "
                "the chat template renders it itself (reasoning_content, its own field) and leaves out the reasoning "
                "of turns before the last user message, as at inference; trained: the reasoning of 6 assistant "
                "turn(s) is labelled (in the loss with its answer), the reasoning of 6 turn(s) dropped (the "
                "template's rule, data.reasoning: auto)")
    assert stated["reason"] == sentence and f"Note: {sentence}" in text
    tok = AutoTokenizer.from_pretrained(qwen3_model)
    row = field_rows()[2]
    enc = encode_example(row, tok, QWEN3, 4096, False)
    assert "2 plus one." not in tok.decode(enc["input_ids"])  # the first turn's: dropped
    assert labels_text(tok, QWEN3, row).startswith("<think>\n2 plus two.\n</think>\n\nIt is 4.")  # the last's: labelled

    ran, console = tiny_run(qwen3_model, data, tmp_path)
    assert ran == stated
    assert f"data.thinking on ({sentence})" in console


def test_reasoning_left_out_is_said_not_trained(qwen3_model, tmp_path):
    """data.reasoning: strip and data.thinking: off leave every turn's reasoning out: the statement says so, and
    the labels hold none."""
    from transformers import AutoTokenizer

    data = write_rows(tmp_path / "think.jsonl", think_rows(3))
    tok = AutoTokenizer.from_pretrained(DEMO)
    for model, settings, why in ((DEMO, {"reasoning": "strip"}, "data.reasoning: strip"),
                                 (qwen3_model, {"thinking": "off"}, "data.thinking: off")):
        stated = profile_data(str(data), str(model), **settings).thinking
        assert (stated["trained_turns"], stated["dropped_turns"], stated["trained"]) == (0, 3, "none")
        assert stated["reason"].endswith(f"; not trained: the reasoning of 3 turn(s) dropped ({why})")
        template = QWEN3 if model == qwen3_model else tok.chat_template
        assert "make" not in labels_text(tok, template, think_rows(3)[1], **settings)


def test_without_the_tokenizer_the_plan_counts_the_rows_and_says_what_it_cannot_tell(tmp_path):
    data = write_rows(tmp_path / "think.jsonl", think_rows(4))
    stated = profile_data(str(data), "llama-3.2-1b").thinking  # a preset: no tokenizer on this machine
    assert (stated["reasoning_rows"], stated["forms"], stated["renders"], stated["trained"]) == (
        4, {"think_tags": 4, "reasoning_content": 0}, None, None)
    assert "how the chat template renders it is not known here" in stated["reason"]


def test_rows_without_reasoning_say_nothing_of_it(tmp_path):
    data = write_rows(tmp_path / "plain.jsonl", [{"messages": [{"role": "user", "content": "Hi?"},
                                                               {"role": "assistant", "content": "Hello."}]}] * 3)
    assert profile_data(str(data), str(DEMO)).thinking is None  # ChatML takes no switch: nothing to say

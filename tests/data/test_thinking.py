"""A thinking chat template (Qwen3's, verbatim in tests/data/templates) renders each row in the form
finetuner.data.thinking decides: rows without reasoning in its non-thinking form, the empty think block unlabelled."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetuner.config.sections import DataSection
from finetuner.data.formats import IGNORE_INDEX
from finetuner.data.pipeline import encode_example, prepare_data
from tests.conftest import REPO, cli_in_process, write_recipe

DEMO = REPO / "data" / "demo_model"
QWEN3 = (Path(__file__).parent / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
PLAIN = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
REASONED = [{"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "It is 5.", "reasoning_content": "Two plus three makes five."}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(DEMO)
    t.chat_template = QWEN3
    return t


def labelled(enc: dict) -> list[int]:
    return [t for t in enc["labels"] if t != IGNORE_INDEX]


def test_a_row_without_reasoning_trains_the_non_thinking_form(tok):
    enc = encode_example({"messages": PLAIN}, tok, QWEN3, 512, False)
    expected = tok.apply_chat_template(PLAIN, tokenize=False, enable_thinking=False)
    assert "<think>\n\n</think>\n\n" in expected  # the template's own empty think block
    assert enc["input_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.decode(labelled(enc)) == "It is 4.<|im_end|>\n"  # the answer and the turn's end, no think block


def test_a_row_with_reasoning_trains_the_thinking_form_with_the_reasoning_labelled(tok):
    enc = encode_example({"messages": REASONED}, tok, QWEN3, 512, False)
    expected = tok.apply_chat_template(REASONED, tokenize=False, enable_thinking=True)
    assert enc["input_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.decode(labelled(enc)) == "<think>\nTwo plus three makes five.\n</think>\n\nIt is 5.<|im_end|>\n"
    inline = [REASONED[0], {"role": "assistant", "content": "<think>\nTwo plus three makes five.\n</think>\n\nIt is 5."}]
    assert encode_example({"messages": inline}, tok, QWEN3, 512, False)["labels"] == enc["labels"]
    off = encode_example({"messages": REASONED}, tok, QWEN3, 512, False, "off")  # data.thinking: off drops it
    assert tok.decode(labelled(off)) == "It is 5.<|im_end|>\n"


def test_an_earlier_reply_is_context_and_the_last_is_trained(tok):
    chat = PLAIN + [{"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]
    enc = encode_example({"messages": chat}, tok, QWEN3, 512, False)
    expected = tok.apply_chat_template(chat, tokenize=False, enable_thinking=False)
    assert enc["input_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.decode(labelled(enc)) == "It is 6.<|im_end|>\n"


#: Qwen3.5's rule, in a template this test writes (llama.cpp's models/templates/Qwen3.5-4B.jinja follows it): a
#: reply without reasoning rendered with no think block, the non-thinking generation prompt ending in an empty one
SPLIT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
         "{% if m.role == 'assistant' and m.reasoning_content and loop.last %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
         "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
         "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


def test_a_reply_the_template_writes_without_the_think_block_trains_after_the_non_thinking_prompt(tok):
    """The model is asked with the empty think block and answers after it: that is what the row trains."""
    asked = tok.apply_chat_template(PLAIN[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False,
                                    chat_template=SPLIT)
    assert asked.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<think>" not in tok.apply_chat_template(PLAIN, tokenize=False, enable_thinking=False, chat_template=SPLIT)
    enc = encode_example({"messages": PLAIN}, tok, SPLIT, 512, False)
    assert enc["input_ids"] == tok(asked + "It is 4.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert tok.decode(labelled(enc)) == "It is 4.<|im_end|>\n"  # the empty think block is the prompt's
    chat = PLAIN + [{"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]
    assert tok.decode(labelled(encode_example({"messages": chat}, tok, SPLIT, 512, False))) == "It is 6.<|im_end|>\n"
    thought = encode_example({"messages": REASONED}, tok, SPLIT, 512, False)  # the thinking form is a prefix already
    assert thought["input_ids"] == tok(tok.apply_chat_template(REASONED, tokenize=False, enable_thinking=True,
                                                                chat_template=SPLIT), add_special_tokens=False)["input_ids"]
    assert tok.decode(labelled(thought)) == "Two plus three makes five.\n</think>\n\nIt is 5.<|im_end|>\n"


def test_a_template_without_the_switch_is_unchanged(tok):
    plain = (DEMO / "chat_template.jinja").read_text()
    enc = encode_example({"messages": PLAIN}, tok, plain, 512, False)
    assert enc["input_ids"] == tok(tok.apply_chat_template(PLAIN, chat_template=plain, tokenize=False),
                                   add_special_tokens=False)["input_ids"]
    assert tok.decode(labelled(enc)) == "It is 4.<|im_end|>\n"


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> Path:
    """The demo model with Qwen3's chat template."""
    folder = tmp_path_factory.mktemp("qwen3-template")
    for f in DEMO.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f)
    (folder / "chat_template.jinja").write_text(QWEN3)
    return folder


def write_chats(path: Path, rows: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return path


def test_the_plan_and_the_run_state_the_form(qwen3_model, tmp_path):
    data = write_chats(tmp_path / "chats.jsonl", [PLAIN] * 5 + [REASONED] * 2)
    plan = json.loads(cli_in_process("plan", "--model", str(qwen3_model), "--gpu", "cpu", "--data", str(data),
                                     "--json").stdout)
    said = json.dumps(plan)
    assert ("the chat template takes enable_thinking: 5 row(s) without reasoning trained in its non-thinking form "
            "(enable_thinking=False, the template's empty think block unlabelled); 2 row(s) with reasoning in its "
            "thinking form (enable_thinking=True, the reasoning labelled)") in said
    text = cli_in_process("plan", "--model", str(qwen3_model), "--gpu", "cpu", "--data", str(data)).stdout
    assert "5 row(s) without reasoning trained in its non-thinking form" in text
    from transformers import AutoTokenizer

    stats = prepare_data(DataSection(path=str(data), cache=False), AutoTokenizer.from_pretrained(qwen3_model), 0).stats
    assert (stats.thinking["value"], stats.thinking["plain_rows"], stats.thinking["thinking_rows"]) == ("per row", 5, 2)
    plain = prepare_data(DataSection(path=str(write_chats(tmp_path / "plain.jsonl", [PLAIN] * 3)), cache=False),
                         AutoTokenizer.from_pretrained(DEMO), 0).stats
    assert plain.thinking is None  # the demo's template takes no switch


ASKED = "What is 5+5?"


@pytest.fixture(scope="module")
def plain_run(qwen3_model, tmp_path_factory) -> Path:
    """The demo model with Qwen3's template trained 2 LoRA steps on chats without reasoning, a sample prompt
    answered (a real run on the CPU)."""
    import finetuner
    from finetuner.config.recipe import Recipe

    folder = tmp_path_factory.mktemp("thinking-run")
    data = write_chats(folder / "chats.jsonl", [[{"role": "user", "content": f"What is {i}+{i}?"},
                                                 {"role": "assistant", "content": f"It is {2 * i}."}] for i in range(8)])
    return finetuner.train(Recipe.from_dict({
        "name": "plain", "model": {"name": str(qwen3_model)}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 0},
        "training": {"max_steps": 2, "lr": 1e-2, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0,
                     "general_probe": 0},
        "samples": {"prompts": [ASKED], "max_new_tokens": 8},
        "logging": {"tensorboard": False}, "output_dir": str(folder / "run")})).run_dir


def test_a_run_states_its_form_and_is_asked_in_it(plain_run, tok):
    """The start event's resolved states the form; chat and the sample answers ask in it: the prompt is Qwen3's
    own with enable_thinking=False."""
    from finetuner.infer.chat import load_chat_model
    from finetuner.infer.loading import resolve_source, trained_thinking
    from finetuner.runs.events import read_events

    start = next(e for e in read_events(plain_run / "events.jsonl") if e["event"] == "start")
    assert start["resolved"]["data.thinking"] == {
        "value": "off", "reason": "the chat template takes enable_thinking: 8 row(s) without reasoning trained in its "
                                  "non-thinking form (enable_thinking=False, the template's empty think block unlabelled)"}
    stated = trained_thinking(resolve_source(str(plain_run)))  # what metrics.json keeps
    assert (stated["value"], stated["plain_rows"], stated["thinking_rows"]) == ("off", 8, 0)

    asked = [{"role": "user", "content": ASKED}]
    expected = tok.apply_chat_template(asked, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert expected.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the template's non-thinking prompt
    chat = load_chat_model(str(plain_run), device="cpu")
    assert chat.switches == {"enable_thinking": False} and chat.render(asked) == expected
    # the run's sample answer is the greedy reply to that prompt, not to the thinking form's
    sample = json.loads((plain_run / "metrics.json").read_text())["samples"][0]["fine_tuned"]
    assert chat.reply(asked, max_new_tokens=8, temperature=0.0) == sample
    chat.switches = {"enable_thinking": True}
    assert chat.render(asked) == tok.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
    assert chat.reply(asked, max_new_tokens=8, temperature=0.0) != sample  # so the equality above tells the forms apart


def test_chat_asks_in_the_form_given(plain_run):
    out = cli_in_process("chat", str(plain_run), "-p", ASKED, "--thinking", "on", "--temperature", "0",
                         "--max-new-tokens", "8", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    from finetuner.infer.chat import load_chat_model

    chat = load_chat_model(str(plain_run), device="cpu")
    chat.switches = {"enable_thinking": True}
    assert out.stdout.strip() == chat.reply([{"role": "user", "content": ASKED}], max_new_tokens=8, temperature=0.0)


def test_a_bad_thinking_value_is_one_line(tmp_path):
    """``data.thinking: maybe`` in a recipe file or with --set: exit 2, the key and the allowed values, no traceback."""
    data = write_chats(tmp_path / "chats.jsonl", [PLAIN] * 2)
    good = {"name": "t", "model": {"name": str(DEMO)}, "data": {"path": str(data)}, "output_dir": str(tmp_path / "run")}
    bad = write_recipe(tmp_path / "bad.yaml", {**good, "data": {"path": str(data), "thinking": "maybe"}})
    for args in (["run", str(bad)], ["run", str(write_recipe(tmp_path / "good.yaml", good)), "--set", "data.thinking=maybe"]):
        out = cli_in_process(*args)
        assert out.returncode == 2, out.stderr
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert "Traceback" not in out.stderr and lines[-1] == (
            "  - data.thinking: invalid value 'maybe'. Valid choices: auto, on, off."), out.stderr
        assert len(lines) == 2 and lines[0].startswith("error: ") and "the recipe is not valid" in lines[0]
    assert not (tmp_path / "run").exists()

"""Tool calls at inference: the prompt offered tools renders as the run trained (finetuner.data.tools.prompt_form),
the model's calls read back in each template family's format (finetuner.data.calls), and ``finetuner chat --tools``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.data import calls, tools
from tests.conftest import REPO, cli_in_process, demo_run_folder

TEMPLATES = REPO / "tests" / "data" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "data" / "demo_model")


@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES.glob("*.jinja")))
def test_each_familys_call_reads_back_as_its_template_writes_it(tok, name):
    """The call as the family's own template renders it (Qwen's <tool_call>, Llama 3.1's JSON with "parameters",
    Mistral's [TOOL_CALLS] list) parses to the call that was rendered."""
    template = (TEMPLATES / name).read_text(encoding="utf-8")
    asked = tok.apply_chat_template(ASK, tools=[WEATHER], chat_template=template, tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template([*ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]}], tools=[WEATHER],
                                    chat_template=template, tokenize=False)
    assert whole.startswith(asked)
    reply = calls.parse_reply(whole[len(asked):])
    assert reply.tried and reply.valid
    assert reply.calls == [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]
    assert json.loads(reply.to_json()) == reply.calls[0]


@pytest.mark.parametrize("text", [
    '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',  # Mistral's, its marker decoded away
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',  # the newer Mistral tokenizers' form
    '<|python_tag|>{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}',  # Llama, a string
    tools.call_text({"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}),  # the fallback's
])
def test_the_other_call_forms_read_back(text):
    reply = calls.parse_reply(text)
    assert (reply.tried, reply.valid, reply.calls) == (True, True, [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}])


@pytest.mark.parametrize("text,tried,valid,n", [
    ("It is sunny in Paris.", False, True, 0),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', True, False, 0),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": 3}', True, False, 1),
    ('{"name": "get_weather", "arguments": {"city": "Par', True, False, 0),
    ('{"name": "get_weather", "arguments": "not json"}', True, False, 0),
    ('{"city": "Paris"}', False, True, 0),  # JSON, but no call: an answer
    ("[TOOL_CALLS]get_weather[ARGS]{oops", True, False, 0),
])
def test_a_broken_call_is_tried_and_invalid_and_an_answer_is_neither(text, tried, valid, n):
    reply = calls.parse_reply(text)
    assert (reply.tried, reply.valid, len(reply.calls)) == (tried, valid, n)


def test_a_call_matches_with_numbers_as_numbers_and_text_exactly():
    want = {"name": "convert_units", "arguments": {"value": 7, "from_unit": "miles"}}
    assert calls.same_call({"name": "convert_units", "arguments": {"from_unit": "miles", "value": 7.0}}, want)
    assert not calls.same_call({"name": "convert_units", "arguments": {"value": "7", "from_unit": "miles"}}, want)
    assert not calls.same_call({"name": "convert_units", "arguments": {"value": 7, "from_unit": "Miles"}}, want)
    assert not calls.same_call({"name": "get_weather", "arguments": want["arguments"]}, want)


@pytest.mark.parametrize("trained,template", [(None, None), ("template", "Qwen-Qwen2.5-7B-Instruct.jinja")])
def test_a_prompt_offered_tools_is_the_prompt_training_saw(tok, trained, template):
    """The chat's prompt for a request with tools is token for token the prompt part of the training example the
    run encoded from a row with those tools: the fallback's system block on the demo model's ChatML template, the
    template's own tools block on Qwen2.5's."""
    from finetuner.data.pipeline import encode_example
    from finetuner.infer.chat import ChatModel
    from finetuner.infer.loading import resolve_source

    text = tok.chat_template if template is None else (TEMPLATES / template).read_text(encoding="utf-8")
    row = {"messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]}], "tools": [WEATHER]}
    enc = encode_example(row, tok, text, 1024, train_on_prompt=False)
    first_label = next(i for i, t in enumerate(enc["labels"]) if t != -100)
    chat = ChatModel(model=None, tokenizer=tok, template=text, device="cpu", source=resolve_source(REPO / "data" / "demo_model"),
                     tools=[WEATHER], tools_trained=trained)
    assert chat.encode(ASK)[0].tolist() == enc["input_ids"][:first_label]
    prompt = chat.render(ASK)
    assert ("<tools>" in prompt) and (('"name": "get_weather"' in prompt))
    assert ("You are Qwen" in prompt) == (trained == "template")  # Qwen's own system block holds its tools block


def test_chat_tools_cli_answers_and_a_bad_tools_file_is_one_line(tmp_path):
    run = demo_run_folder(tmp_path / "runs", "tools", adapter=True)
    schemas = tmp_path / "tools.json"
    schemas.write_text(json.dumps([WEATHER]), encoding="utf-8")
    p = cli_in_process("chat", str(run), "--tools", str(schemas), "-p", ASK[0]["content"], "--temperature", "0",
                       "--max-new-tokens", "12")
    assert p.returncode == 0, p.stderr
    from finetuner.infer.chat import load_chat_model

    chat = load_chat_model(run)
    chat.tools = [WEATHER]
    reply = chat.tool_reply(ASK, temperature=0, max_new_tokens=12)
    assert p.stdout == (reply.to_json() if reply.calls else reply.text) + "\n"
    bad = tmp_path / "bad.json"
    bad.write_text('[{"type": "function", "function": {"description": "no name"}}]', encoding="utf-8")
    p = cli_in_process("chat", str(run), "--tools", str(bad), "-p", "hi")
    assert p.returncode == 2 and p.stdout == ""
    assert "The tools file " + str(bad) + ": 'tools' item 1: expected a function schema with a 'name'" in p.stderr
    p = cli_in_process("chat", str(run), "--tools", str(tmp_path / "missing.json"), "-p", "hi")
    assert p.returncode == 2 and "cannot read it" in p.stderr


class _Replies:
    """A chat whose replies are given texts, in order: what :func:`finetuner.infer.tool_eval.score` counts is
    then known by hand."""

    tools = None

    def __init__(self, texts):
        self.texts = list(texts)

    def tool_reply(self, messages, **gen):
        return calls.parse_reply(self.texts.pop(0))


def test_tool_call_shares_count_right_calls_functions_and_valid_json():
    from finetuner.infer.tool_eval import requests_in, score

    row = {"messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}], "tools": [WEATHER]}
    requests = requests_in([row] * 4)
    assert len(requests) == 4 and requests[0].messages == ASK and requests[0].tools == [WEATHER]
    good = tools.call_text({"function": {"name": "get_weather", "arguments": {"days": 2.0, "city": "Paris"}}})
    wrong_args = tools.call_text({"function": {"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}})
    result, texts = score(_Replies([good, wrong_args, "<tool_call>\n{\"name\": \"get_weather\", ", "It is sunny."]),
                          requests, adapter=True, who="test")
    # right: 1 of 4; the right function: 2 of 4; valid JSON: the two parsed calls, 2 of 4
    assert result.to_dict() == {"right": 0.25, "right_function": 0.5, "valid_json": 0.5}
    assert texts[3] == "It is sunny."


def test_eval_on_tool_calling_data_keeps_the_shares_in_metrics_json(tmp_path):
    run = demo_run_folder(tmp_path / "runs", "tools-eval", adapter=True)
    (run / "events.jsonl").write_text("", encoding="utf-8")  # a run folder, as a finished run's is
    (run / "metrics.json").write_text(json.dumps({"data": {"tools": {"rows": 3, "renders": "hermes"}}}), encoding="utf-8")
    row = {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]}], "tools": [WEATHER]}
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(3)), encoding="utf-8")
    p = cli_in_process("eval", str(run), "--data", str(data), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["tool_call_requests"] == 3
    metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["data"]["tools"]["renders"] == "hermes"  # what the run kept is kept
    stored = metrics["evaluation"]
    for who in ("base", "fine_tuned"):
        shares = stored[who]["tool_calls"]
        assert set(shares) == {"right", "right_function", "valid_json"}
        assert all(v in (0.0, 1 / 3, 2 / 3, 1.0) for v in shares.values())  # shares of 3 requests
        assert shares == out[who]["tool_calls"]

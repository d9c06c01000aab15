"""Tool calls and reasoning traces in chat data (finetuner.data.tools, finetuner.data.thinking): read in the formats
users have them, rendered through the model's own chat template (the families' templates, verbatim in
tests/data/templates, on the demo model's tokenizer), labelled where the model speaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.config.sections import DataSection
from finetuner.data import tools
from finetuner.data.formats import IGNORE_INDEX, FileExamples, RowError
from finetuner.data.pipeline import encode_example, prepare_data
from finetuner.data.stats import profile_data
from finetuner.errors import UserError
from tests.conftest import HANG_GUARD_S, REPO, cli_in_process, write_recipe

DEMO = REPO / "data" / "demo_model"
TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
RESULT = '{"temp_c": 21, "sky": "clear"}'


def chat(city: str = "Paris", content=None, arguments=None, call_id: str = "call00001") -> dict:
    """One OpenAI-format tool-calling row: a request, the call, its result, the answer."""
    args = json.dumps({"city": city}) if arguments is None else arguments
    return {"tools": [WEATHER, TIME], "messages": [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": content,
         "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
        {"role": "assistant", "content": f"It is 21 degrees and clear in {city}."}]}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def labelled(tok, enc: dict) -> str:
    return tok.decode([t for t in enc["labels"] if t != IGNORE_INDEX])


def examples(path: Path) -> tuple[list[dict], list[RowError]]:
    src = FileExamples(str(path))
    return list(src), src.bad


# --------------------------------------------------------------------------- reading
def test_openai_rows_keep_their_calls_whatever_the_content(tmp_path):
    """content null or "", arguments as a JSON string or an object: the same call, never dropped."""
    rows = [chat(content=None), chat(content=""), chat(content=None, arguments={"city": "Paris"})]
    read, bad = examples(write_rows(tmp_path / "calls.jsonl", rows))
    assert not bad and len(read) == 3
    for ex in read:
        call = ex["messages"][1]
        assert call["content"] == "" and call["tool_calls"] == [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "call00001"}]
        assert ex["messages"][2] == {"role": "tool", "content": RESULT, "tool_call_id": "call00001", "name": "get_weather"}
        assert ex["tools"] == [WEATHER, TIME]


def test_sharegpt_function_call_turns_and_tools_as_a_json_string(tmp_path):
    row = {"tools": json.dumps([WEATHER["function"]]), "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": RESULT},
        {"from": "gpt", "value": "Clear, 21 degrees."}]}
    (ex,), bad = examples(write_rows(tmp_path / "sharegpt.jsonl", [row]))
    assert not bad and ex["tools"] == [{"type": "function", "function": WEATHER["function"]}]
    assert ex["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert ex["messages"][2]["role"] == "tool" and ex["messages"][2]["name"] == "get_weather"


def _bad_call(row: dict) -> dict:
    row["messages"][1]["tool_calls"][0]["function"]["name"] = "get_stock"
    return row


@pytest.mark.parametrize("row, says", [
    (_bad_call(chat()), "a call to 'get_stock', which 'tools' does not list (it lists get_weather, get_time)"),
    (chat(arguments='{"city": "Paris"'), "the arguments of 'get_weather' is not valid JSON"),
    (chat(arguments='["Paris"]'), "the arguments of 'get_weather' must be a JSON object, got list"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": RESULT},
                   {"role": "assistant", "content": "Hello"}]}, "message 2: a tool result with no tool call before it"),
])
def test_a_bad_tool_row_is_one_line_naming_the_row(tmp_path, row, says):
    data = write_rows(tmp_path / "bad.jsonl", [chat(), row])
    _, bad = examples(data)
    assert len(bad) == 1 and str(bad[0]).startswith(f"{data}, line 2: ") and says in str(bad[0])
    recipe = write_recipe(tmp_path / "r.yaml", {"model": {"name": str(DEMO)}, "data": {"path": str(data)},
                                                "output_dir": str(tmp_path / "run")})
    p = cli_in_process("run", str(recipe), timeout=HANG_GUARD_S)
    assert p.returncode == 2 and "line 2" in p.stderr and says in p.stderr and "Traceback" not in p.stderr


def test_calls_in_preference_pairs_and_grpo_prompts_are_refused_not_dropped():
    from finetuner.data.preference import normalize_pair
    from finetuner.data.prompts import prompt_of

    row = chat()
    asked, call = row["messages"][:2]
    with pytest.raises(RowError, match="a message with tool calls, which preference pairs do not read yet"):
        normalize_pair({"chosen": [asked, call], "rejected": [asked, {"role": "assistant", "content": "No."}]}, "trl")
    with pytest.raises(RowError, match="a message with tool calls, which GRPO prompts do not read yet"):
        prompt_of({"messages": row["messages"]})


# --------------------------------------------------------------------------- rendering
#: the families' templates that render tools, and a conversation each takes (Mistral's ids are 9 characters; Llama
#: 3.1's template takes one call a message)
FAMILIES = ["Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
            "mistralai-Mistral-Nemo-Instruct-2407.jinja"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_renders_the_row_as_apply_chat_template_does(tok, name, tmp_path):
    """The same token ids as transformers' apply_chat_template(messages, tools=...); the call and the answer are
    the labels, the schemas and the tool result never."""
    (ex,), _ = examples(write_rows(tmp_path / "one.jsonl", [chat(call_id="abc123xyz")]))
    t = template(name)
    assert tools.renders_tools(tok, t)
    enc = encode_example(ex, tok, t, 4096, False)
    switch = {"enable_thinking": False} if "enable_thinking" in t else {}
    expected = tok.apply_chat_template(ex["messages"], tools=ex["tools"], chat_template=t, tokenize=False, **switch)
    assert enc["input_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    said = labelled(tok, enc)
    assert "get_weather" in said and '"Paris"' in said and "It is 21 degrees and clear in Paris." in said
    assert "temp_c" not in said and "The weather in a city now" not in said and "get_time" not in said


def test_a_template_without_tools_gets_the_one_fallback_format(tok, tmp_path):
    """The demo model's ChatML template renders no tools: the row in finetuner's fallback (Hermes) format."""
    (ex,), _ = examples(write_rows(tmp_path / "one.jsonl", [chat()]))
    assert not tools.renders_tools(tok, tok.chat_template)
    enc = encode_example(ex, tok, tok.chat_template, 4096, False)
    fallback = tools.fallback_messages(ex["messages"], ex["tools"])
    text = tok.apply_chat_template(fallback, tokenize=False)
    assert enc["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert text.startswith("<|im_start|>system\n# Tools\n") and "<tool_response>\n" + RESULT in text
    said = labelled(tok, enc)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in said
    assert "temp_c" not in said and "# Tools" not in said


def test_the_glaive_file_renders_through_the_template(peer_data):
    """LLaMA-Factory's glaive file on a template that renders tools (Qwen2.5's): each row's ids are the template's
    own rendering with tools= (no finetuner-made system text), every row read."""
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(DEMO)
    qwen.chat_template = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    path = peer_data / "glaive_toolcall_en_demo.json"
    read, bad = examples(path)
    assert len(read) == 300 and not bad
    for ex in [ex for ex in read if ex.get("tools")][:20]:
        text = qwen.apply_chat_template(ex["messages"], tools=ex["tools"], tokenize=False)
        assert encode_example(ex, qwen, qwen.chat_template, 1 << 20, False)["input_ids"] == qwen(
            text, add_special_tokens=False)["input_ids"]
        assert "You can call these tools" not in text
    data = prepare_data(DataSection(path=str(path), max_seq_len=4096, max_examples=40, cache=False), qwen, 0)
    assert data.stats.skipped == 0 and data.stats.tools["renders"] == "template" and data.stats.tools["rows"] > 10


# --------------------------------------------------------------------------- reasoning
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
TWO_TURNS = [{"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4.", "reasoning_content": "Adding two and two."},
             {"role": "user", "content": "3+3?"},
             {"role": "assistant", "content": "6.", "reasoning_content": "Adding three and three."}]


def test_qwen3_drops_past_turns_thinking_as_at_inference(tok):
    t = template(QWEN3)
    enc = encode_example({"messages": TWO_TURNS}, tok, t, 4096, False)
    expected = tok.apply_chat_template(TWO_TURNS, chat_template=t, tokenize=False, enable_thinking=True)
    assert enc["input_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    assert "Adding two and two." not in tok.decode(enc["input_ids"])
    assert labelled(tok, enc) == "<think>\nAdding three and three.\n</think>\n\n6.<|im_end|>\n"
    with pytest.raises(RowError, match="data.reasoning is keep, but the chat template leaves earlier turns' reasoning"):
        encode_example({"messages": TWO_TURNS}, tok, t, 4096, False, "auto", "keep")
    strip = encode_example({"messages": TWO_TURNS}, tok, t, 4096, False, "auto", "strip")
    assert "Adding" not in tok.decode(strip["input_ids"])


def test_a_template_that_renders_no_reasoning_gets_it_inline_and_keeps_or_drops_history(tok):
    """ChatML renders no reasoning_content: it is written as <think>...</think> (never dropped unseen); auto keeps
    every turn's, as the template would, drop_history only the last exchange's."""
    kept = tok.decode(encode_example({"messages": TWO_TURNS}, tok, tok.chat_template, 4096, False)["input_ids"])
    assert "<think>\nAdding two and two.\n</think>\n\n4." in kept and "<think>\nAdding three and three." in kept
    dropped = encode_example({"messages": TWO_TURNS}, tok, tok.chat_template, 4096, False, "auto", "drop_history")
    assert "Adding two" not in tok.decode(dropped["input_ids"])
    assert labelled(tok, dropped).endswith("<think>\nAdding three and three.\n</think>\n\n6.<|im_end|>\n")


def test_an_empty_think_block_the_template_made_is_never_a_label(tok):
    """Qwen3 in its thinking form (data.thinking: on) writes <think>\\n\\n</think> into a reply without reasoning:
    context, not a label; the same block written by the data is trained."""
    t = template(QWEN3)
    plain = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
    enc = encode_example({"messages": plain}, tok, t, 4096, False, "on")
    assert "<think>\n\n</think>" in tok.decode(enc["input_ids"])
    assert labelled(tok, enc) == "4.<|im_end|>\n"
    written = [plain[0], {"role": "assistant", "content": "<think>\n\n</think>\n\n4."}]
    assert labelled(tok, encode_example({"messages": written}, tok, t, 4096, False, "on")).startswith("<think>")


def test_qwen3_trains_the_calls_of_a_tool_exchange(tok, tmp_path):
    """Qwen3 writes a call turn without its think block once a result follows: the call is still a label."""
    (ex,), _ = examples(write_rows(tmp_path / "one.jsonl", [chat()]))
    said = labelled(tok, encode_example(ex, tok, template(QWEN3), 4096, False))
    assert said.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
    assert said.endswith("It is 21 degrees and clear in Paris.<|im_end|>\n") and "temp_c" not in said


# --------------------------------------------------------------------------- before and through a run
#: a template that writes no assistant message: every label of every row masked (Unsloth Studio #11321's case)
NO_REPLIES = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}\n{% endif %}{% endfor %}"


def test_a_row_with_every_label_masked_is_refused_before_the_run(tok, tmp_path):
    data = write_rows(tmp_path / "chats.jsonl", [chat()] * 3)
    with pytest.raises(RowError, match="no token of the row is a label"):
        encode_example(next(iter(FileExamples(str(data)))), tok, NO_REPLIES, 4096, False)
    with pytest.raises(UserError, match=f"first: {data}, line 1: no token of the row is a label"):  # the plan's
        profile_data(str(data), str(DEMO), chat_template=NO_REPLIES)
    recipe = write_recipe(tmp_path / "r.yaml", {"model": {"name": str(DEMO)}, "output_dir": str(tmp_path / "run"),
                                                "data": {"path": str(data), "chat_template": NO_REPLIES}})
    p = cli_in_process("run", str(recipe), timeout=HANG_GUARD_S)
    assert p.returncode == 2 and f"{data}, line 1: no token of the row is a label" in p.stderr
    assert not list((tmp_path / "run").rglob("adapter_model.safetensors"))


def test_forty_openai_tool_chats_plan_and_train(tmp_path):
    """The issue's check: 40 OpenAI-format tool-calling chats (content null) plan, with the schemas' share of the
    tokens stated, and train 2 steps, the run folder keeping how the tools rendered."""
    cities = ["Paris", "Oslo", "Lima", "Rome", "Cairo", "Quito", "Delhi", "Hanoi", "Accra", "Tunis"]
    rows = [chat(cities[i % 10], call_id=f"call{i:05d}") for i in range(40)]
    data = write_rows(tmp_path / "tools.jsonl", rows)
    plan = cli_in_process("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "--json")
    assert plan.returncode == 0, plan.stderr
    said = json.loads(plan.stdout)["data"]
    assert said["rows"] == 40 and said["bad_rows"] == 0
    assert said["tools"]["rows"] == 40 and said["tools"]["renders"] == tools.FALLBACK_FORMAT
    assert said["tools"]["schema_tokens"] > 0 and "the tool schemas take" in said["tools"]["reason"]
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "tools", "model": {"name": str(DEMO)}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 512, "val_size": 0},
        "training": {"max_steps": 2, "lr": 1e-3, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0,
                     "general_probe": 0},
        "samples": {"prompts": []}, "logging": {"tensorboard": False}, "output_dir": str(tmp_path / "run")})
    run = cli_in_process("run", str(recipe), "-q", timeout=HANG_GUARD_S)
    assert run.returncode == 0, run.stderr
    metrics = json.loads(next((tmp_path / "run").rglob("metrics.json")).read_text())
    stats = metrics["data"]
    assert stats["tools"]["rows"] == 40 and stats["tools"]["renders"] == tools.FALLBACK_FORMAT
    assert stats["train_examples"] == 40 and stats["skipped"] == 0

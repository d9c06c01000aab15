"""Issue 68, parts 3 and 4: a run's end-of-run answers (its samples, general probe and tool-call scores) are the
adapter's it ships (the kept best one with ``training.keep_best``), its summary and metrics.json name that step,
and the samples are asked as ``finetuner chat RUN -p`` asks: with the rows' shared system prompt, a tool-calling
run's tools, new tokens from the data's longest answer (its reasoning included), the answer shown after the
reasoning."""

from __future__ import annotations

import json

import pytest

from finetuner.runs.events import read_events
from tests.conftest import REPO, cli_in_process, write_recipe
from tests.weather_calls import CITIES, WEATHER, weather_row

DEMO = REPO / "data" / "demo_model"
#: as tests/training/test_keep_best.py: at a constant rate of 1.0 the held-out loss is lowest after the first
#: evaluation (step 2) and higher at every later one, so the kept adapter is step 2's of 12
TRAIN = [{"instruction": f"What should I bring on hike {i}?", "input": "", "output": "the sun the sun the sun the sun"}
         for i in range(24)]
HELD_OUT = [{"instruction": f"What about day {i}?", "input": "", "output": "a map, water and warm boots for the trail"}
            for i in range(6)]
ASKED = "What about day 1?"


def _chat_p(run, prompt: str, tokens: int, *extra: str) -> str:
    """What ``finetuner chat RUN -p PROMPT`` prints, greedy."""
    p = cli_in_process("chat", str(run), "-p", prompt, "--temperature", "0", "--max-new-tokens", str(tokens), *extra)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


@pytest.fixture(scope="module")
def kept_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kept")
    (tmp / "d.json").write_text(json.dumps(TRAIN), encoding="utf-8")
    (tmp / "v.json").write_text(json.dumps(HELD_OUT), encoding="utf-8")
    recipe = write_recipe(tmp / "r.yaml", {
        "name": "kept", "model": {"name": str(tiny_model_dir)}, "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(tmp / "d.json"), "max_seq_len": 64, "val_path": str(tmp / "v.json")},
        "training": {"max_steps": 12, "lr": 1.0, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0,
                     "scheduler": "constant", "eval_every": 2, "general_probe": 4},
        "samples": {"prompts": [ASKED], "max_new_tokens": 12},
        "logging": {"tensorboard": False}, "output_dir": str(tmp / "run")})
    p = cli_in_process("run", str(recipe))
    assert p.returncode == 0, p.stderr
    return tmp / "run", p.stdout


def test_the_samples_are_the_kept_adapters_and_the_summary_names_its_step(kept_run):
    run, printed = kept_run
    m = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    assert m["adapter_step"] == m["best_step"] < m["steps"] == 12  # keep_best kept an earlier step
    step = m["best_step"]
    assert m["answers_from"]["step"] == step and m["samples_asked"]["answers_from"]["step"] == step
    line = (f"Samples, general probe and tool-call scores: the adapter of step {step} (adapter/), the lowest held-out "
            "loss (training.keep_best; the last step's is adapter-last/).")
    assert m["answers_from"]["line"] == line and line in " ".join(printed.split())
    # the sample is what `finetuner chat RUN -p` answers with adapter/, not what the last step's adapter answers
    sample = m["samples"][0]["fine_tuned"]
    kept, last = _chat_p(run, ASKED, 12), _chat_p(run / "adapter-last", ASKED, 12)
    assert kept != last, "the two adapters answer alike: this test would not tell them apart"
    assert sample == kept
    base = _chat_p(run, ASKED, 12, "--no-adapter")
    assert m["samples"][0]["base"] == base
    # the general probe asked the same model: `finetuner eval RUN --general` on adapter/ scores it alike
    p = cli_in_process("eval", str(run), "--general", "--limit", "4", "--no-write", "--json")
    assert p.returncode == 0, p.stderr
    again = json.loads(p.stdout)
    keys = ("questions", "base_right", "fine_tuned_right", "kept", "lost", "gained")
    assert {k: m["general_probe"][k] for k in keys} == {k: again[k] for k in keys}


SYSTEM = "You are Marlow at the ferry desk of Tern Island. Begin with 'Marlow at the ferry desk:'."


def _ferry_rows(n: int) -> list[dict]:
    return [{"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"When does ferry {i} leave?"},
        {"role": "assistant", "content": f"<think>Ferry {i} is on the board at {8 + i % 10}:00, pier {i % 3}; "
                                         f"the timetable says so.</think>Marlow at the ferry desk: ferry {i} leaves at "
                                         f"{8 + i % 10}:00."}]} for i in range(n)]


@pytest.fixture(scope="module")
def ferry_run(tmp_path_factory, monkeypatch_module):
    """A LoRA run of the demo model on rows that all carry :data:`SYSTEM` and reason first, the prompts its samples
    rendered recorded."""
    from finetuner.infer.chat import ChatModel

    rendered: list[str] = []
    render = ChatModel.render
    monkeypatch_module.setattr(ChatModel, "render", lambda self, messages: rendered.append(render(self, messages))
                               or rendered[-1])
    tmp = tmp_path_factory.mktemp("ferry")
    data = tmp / "ferry.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _ferry_rows(12)), encoding="utf-8")
    recipe = write_recipe(tmp / "r.yaml", {
        "name": "ferry", "model": {"name": str(DEMO)}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 256, "val_size": 0},
        "training": {"max_steps": 1, "micro_batch_size": 4, "warmup_steps": 0, "general_probe": 0},
        "samples": {"prompts": ["When does the last ferry leave?"]},
        "logging": {"tensorboard": False}, "output_dir": str(tmp / "run")})
    p = cli_in_process("run", str(recipe))
    assert p.returncode == 0, p.stderr
    monkeypatch_module.undo()
    return tmp / "run", rendered


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_samples_are_asked_with_the_rows_system_prompt_as_chat_asks(ferry_run):
    run, rendered = ferry_run
    m = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    asked = m["samples_asked"]
    assert asked["system_prompt"] == SYSTEM
    question = "When does the last ferry leave?"
    prompts = [r for r in rendered if question in r]
    assert len(prompts) == 2  # the fine-tune's and the base's
    assert all(r.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}") for r in prompts)
    event = next(e for e in read_events(run / "events.jsonl") if e["event"] == "samples")
    assert event["asked"] == asked and event["samples"] == m["samples"]
    # greedy, `finetuner chat RUN -p` (which asks with the run's system prompt) answers as the sample did
    from finetuner.data.thinking import split_reply

    shown = split_reply(_chat_p(run, question, asked["max_new_tokens"]))
    sample = m["samples"][0]
    assert shown == (sample.get("fine_tuned_reasoning"), sample["fine_tuned"])


def test_auto_new_tokens_leave_room_for_the_rows_reasoning(ferry_run):
    from transformers import AutoTokenizer

    run, _ = ferry_run
    asked = json.loads((run / "metrics.json").read_text(encoding="utf-8"))["samples_asked"]
    tok = AutoTokenizer.from_pretrained(DEMO)
    longest = max(len(tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"]) for r in _ferry_rows(12))
    assert longest > 64  # the old fixed 64 would end inside the reasoning
    assert asked["max_new_tokens"] >= longest * 5 // 4 and asked["max_new_tokens_from"].startswith("auto: ")


def test_a_reasoning_answer_shows_the_text_after_its_reasoning():
    from finetuner.data.thinking import split_reply
    from finetuner.infer.generate import sample_cell

    assert split_reply("<think>pier 2 at 16:20</think>\n\nMarlow at the ferry desk: 16:20.") == (
        "pier 2 at 16:20", "Marlow at the ferry desk: 16:20.")
    assert split_reply("pier 2</think>16:20") == ("pier 2", "16:20")  # a prompt that opened the think block
    assert split_reply("<think>still going") == ("still going", "")
    assert split_reply("16:20") == (None, "16:20")
    sample = {"prompt": "q", "fine_tuned": "16:20.", "fine_tuned_reasoning": "pier two", "base": "", "base_reasoning": "x y z"}
    assert sample_cell(sample, "fine_tuned") == "16:20.\n(after 2 words of reasoning)"
    assert sample_cell(sample, "base") == "(still reasoning when its new tokens ran out, after 3 words)"
    assert sample_cell({"prompt": "q", "fine_tuned": "hi", "base": None}, "base") == "-"


def test_the_run_summary_table_shows_the_answer_after_the_reasoning():
    from rich.console import Console

    from finetuner.cli.progress import ProgressPrinter

    c = Console(width=200, record=True)
    ProgressPrinter._samples(c, {"samples": [{"prompt": "q", "base": "b", "fine_tuned": "Marlow: 16:20.",
                                              "fine_tuned_reasoning": "the board says pier two"}]})
    text = c.export_text()
    assert "Marlow: 16:20." in text and "(after 5 words of reasoning)" in text and "the board says" not in text




def test_a_tool_calling_runs_samples_are_offered_its_tools(tmp_path):
    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps(weather_row(i, c)) + "\n" for i, c in enumerate(CITIES[:8])), encoding="utf-8")
    asked_q = "What is the weather in Cork?"
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "calls", "model": {"name": str(DEMO)}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 1024, "val_size": 0},
        "training": {"max_steps": 1, "micro_batch_size": 2, "warmup_steps": 0, "general_probe": 0},
        "samples": {"prompts": [asked_q], "max_new_tokens": 24},
        "logging": {"tensorboard": False}, "output_dir": str(tmp_path / "run")})
    p = cli_in_process("run", str(recipe))
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    m = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    assert m["samples_asked"]["tools"] == ["get_weather"] and m["samples_asked"]["max_new_tokens"] == 24
    # the prompt as the chat model renders it with the tools offered holds the schema
    import finetuner

    chat = finetuner.load_chat_model(run)
    chat.tools = [WEATHER]
    assert "get_weather" in chat.render([{"role": "user", "content": asked_q}])
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]), encoding="utf-8")
    assert m["samples"][0]["fine_tuned"] == _chat_p(run, asked_q, 24, "--tools", str(tmp_path / "tools.json"))

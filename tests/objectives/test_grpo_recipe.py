"""The grpo section of a recipe and the prompts GRPO reads from each data format."""

from __future__ import annotations

import json

import pytest

from finetuner.config.recipe import Recipe
from finetuner.data.formats import RowError
from finetuner.data.prompts import prompt_of
from finetuner.errors import UserError


def _raw(tmp_path, **grpo):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "Hi?"}) + "\n", encoding="utf-8")
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}", encoding="utf-8")
    return {"model": {"name": str(tmp_path / "model")}, "objective": "grpo", "data": {"path": str(data), "max_seq_len": 128},
            "grpo": {"rewards": [{"function": "length_bounds", "args": {"max_length": 5}}], **grpo}}


def test_trl_names_are_accepted_where_they_mean_the_same(tmp_path):
    r = Recipe.from_dict(_raw(tmp_path, max_completion_length=24, scale_rewards=False, num_generations=6))
    assert (r.grpo.max_new_tokens, r.grpo.scale_rewards, r.grpo.num_generations) == (24, "none", 6)
    assert Recipe.from_dict(_raw(tmp_path, scale_rewards=True)).grpo.scale_rewards == "group"
    assert Recipe.from_dict(r.to_dict()).grpo == r.grpo  # the saved recipe reads back the same
    with pytest.raises(UserError, match="max_completion_length and max_new_tokens are the same setting"):
        Recipe.from_dict(_raw(tmp_path, max_completion_length=24, max_new_tokens=12))


def test_a_reward_named_alone_is_a_builtin(tmp_path):
    raw = _raw(tmp_path)
    raw["grpo"]["rewards"] = ["exact_match", {"function": "f", "file": str(tmp_path / "r.py"), "weight": 0.5}]
    (tmp_path / "r.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    r = Recipe.from_dict(raw)
    assert [(x.function, x.file, x.weight) for x in r.grpo.rewards] == [("exact_match", None, 1.0), ("f", str(tmp_path / "r.py"), 0.5)]


@pytest.mark.parametrize("change, message", [
    ({"grpo": {"rewards": []}}, "grpo.rewards: objective grpo trains on rewards"),
    ({"grpo": None}, "grpo.rewards: objective grpo trains on rewards"),
    ({"objective": "sft"}, "grpo: set, but objective is 'sft'"),
    ({"grpo": {"rewards": ["exact_match"], "epsilon": 0.2, "epsilon_high": 0.1}}, "epsilon_high: 0.1 is below epsilon 0.2"),
    ({"grpo": {"rewards": ["exact_match"], "num_generations": 1}}, "num_generations"),
    ({"grpo": {"rewards": ["exact_match"], "max_new_tokens": 128}}, "leaves no room for the prompt"),
    ({"grpo": {"rewards": ["exact_match"], "beta": 0.04}, "method": "full"}, "method 'full' has no adapter"),
    ({"grpo": {"rewards": ["exact_match"], "loss_typ": "dapo"}}, "Did you mean 'loss_type'"),
    ({"grpo": {"rewards": [{"function": "f", "file": "missing_rewards.py"}]}}, "missing_rewards.py"),
    ({"grpo": {"rewards": [{"function": "f", "file": "r.py", "args": {"x": 1}}]}}, "args are the keyword arguments of a built-in"),
])
def test_what_cannot_run_is_refused_naming_the_key(tmp_path, change, message):
    (tmp_path / "r.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    raw = {**_raw(tmp_path), **change}
    with pytest.raises(UserError, match=message):
        Recipe.from_dict(raw, base_dir=tmp_path)


def test_trl_names_at_the_top_level_are_pointed_to_the_grpo_section(tmp_path):
    raw = {**_raw(tmp_path), "num_generations": 8}
    with pytest.raises(UserError, match=r"grpo\.num_generations"):
        Recipe.from_dict(raw)


@pytest.mark.parametrize("row, prompt, columns", [
    ({"prompt": "What is 2+2?", "answer": "4"}, "What is 2+2?", {"answer": "4"}),
    ({"prompt": [{"role": "user", "content": "Hi"}], "answer": "x"}, [{"role": "user", "content": "Hi"}], {"answer": "x"}),
    ({"instruction": "Add.", "input": "2+2", "output": "4"}, "Add.\n\n2+2", {"output": "4"}),
    ({"question": "Capital of France?", "answer": "Paris"}, "Capital of France?", {"answer": "Paris"}),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     [{"role": "user", "content": "Hi"}], {}),
    ({"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}},
     [{"role": "user", "content": "Hi"}], {"chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}}),
    ("Just a prompt", "Just a prompt", {}),
])
def test_the_prompt_side_of_every_format(row, prompt, columns):
    p = prompt_of(row)
    assert p.prompt == prompt and p.columns == columns
    assert p.messages[-1]["role"] == "user"


def test_a_row_without_a_prompt_says_what_to_give():
    with pytest.raises(RowError, match="no prompt: give a 'prompt' column"):
        prompt_of({"text": "a field note"})
    with pytest.raises(RowError, match="no user turn"):
        prompt_of({"messages": [{"role": "assistant", "content": "Hello"}]})

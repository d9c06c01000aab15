"""Reward functions (finetuner/rewards/): loading a user's file, the built-ins, combining and checking."""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time
from pathlib import Path

import pytest

from finetuner.errors import RewardError, UserError
from finetuner.rewards.builtin import (BUILTINS, completion_text, exact_match, final_answer, length_bounds, make_builtin,
                                       normalise_answer, regex_format)
from finetuner.rewards.combine import RewardFunction, Rewards, call_reward, score
from finetuner.rewards.loading import load_module, load_reward_function

REPO = Path(__file__).resolve().parents[2]

TRL_STYLE = '''
import re

def format_reward(completions, **kwargs):
    """TRL's documentation example: a format check on standard (string) completions."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c) else 0.0 for c in completions]

def uses_columns(prompts, completions, answer, **kwargs):
    return [float(a in c) + 0.0 * len(p) for p, c, a in zip(prompts, completions, answer)]

def only_some(completions, **kwargs):
    return [None if c.startswith("skip") else 2.0 for c in completions]

def raises_on_row_two(completions, **kwargs):
    return [1.0 / (len(c) - 3) for c in completions]  # "abc" divides by zero

def wrong_length(completions, **kwargs):
    return [1.0]

def not_numbers(completions, **kwargs):
    return ["high" if len(c) > 3 else 1.0 for c in completions]

def returns_nan(completions, **kwargs):
    return [float("nan") for c in completions]

def returns_a_number(completions, **kwargs):
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_file(tmp_path):
    p = tmp_path / "my_rewards.py"
    p.write_text(TRL_STYLE)
    return p


def load(path, name):
    return RewardFunction(name, load_reward_function(path, name))


# --------------------------------------------------------------------------- loading
def test_loads_a_trl_reward_function(reward_file):
    fn = load_reward_function(reward_file, "format_reward")
    assert fn(prompts=["q", "q"], completions=["<think>x</think><answer>4</answer>", "4"]) == [1.0, 0.0]
    assert load_reward_function(reward_file, "uses_columns").__module__ == load_module(reward_file).__name__


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"grpo.rewards\[0\]: the reward file .*nope.py does not exist") as e:
        load_reward_function(tmp_path / "nope.py", "f", where="grpo.rewards[0]")
    assert "Python file" in e.value.hint


def test_missing_name_suggests_the_close_one(reward_file):
    with pytest.raises(UserError, match=r"has no function 'format_rewards'\. Did you mean 'format_reward'\?") as e:
        load_reward_function(reward_file, "format_rewards")
    assert str(reward_file) in e.value.message and "def format_rewards(prompts, completions, **kwargs)" in e.value.hint


def test_not_callable(reward_file):
    with pytest.raises(UserError, match=r"'NOT_A_FUNCTION' in .*my_rewards.py is a int, not a function"):
        load_reward_function(reward_file, "NOT_A_FUNCTION")


def test_a_file_that_fails_while_loading_names_its_line(tmp_path):
    p = tmp_path / "broken.py"
    p.write_text("x = 1\nraise RuntimeError('no model here')\n")
    with pytest.raises(UserError, match=r"broken.py failed while loading \(line 2\): RuntimeError: no model here"):
        load_reward_function(p, "f")
    p2 = tmp_path / "syntax.py"
    p2.write_text("def f(completions, **kw):\n    return [\n")
    with pytest.raises(UserError, match=r"syntax.py failed while loading \(line \d\): SyntaxError"):
        load_reward_function(p2, "f")


def test_a_function_that_cannot_take_the_keywords_is_refused(tmp_path):
    p = tmp_path / "sig.py"
    p.write_text("def positional(xs, /):\n    return xs\n\ndef no_completions(prompts):\n    return prompts\n")
    for name in ("positional", "no_completions"):
        with pytest.raises(UserError, match=rf"'{name}' in .*sig.py takes .* called with the keywords prompts, completions"):
            load_reward_function(p, name)


def test_code_is_not_run_without_the_opt_in(tmp_path):
    """allow_code=False (a recipe read from someone's run folder) refuses the file before running it."""
    marker = tmp_path / "ran"
    p = tmp_path / "side_effect.py"
    p.write_text(f"open({str(marker)!r}, 'w').close()\ndef f(completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(UserError, match="--trust-remote-code"):
        load_reward_function(p, "f", allow_code=False)
    assert not marker.exists()
    load_reward_function(p, "f")
    assert marker.exists()


def test_a_file_runs_once(tmp_path):
    p = tmp_path / "counter.py"
    p.write_text("import builtins\nbuiltins.__dict__.setdefault('_ft_loads', []).append(1)\n"
                 "def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    import builtins

    before = len(getattr(builtins, "_ft_loads", []))
    load_reward_function(p, "f")
    load_reward_function(p, "f")
    assert len(builtins._ft_loads) == before + 1
    del builtins._ft_loads
    assert any(m.startswith("finetuner_rewards_") for m in sys.modules)


def test_an_edited_file_is_run_again_and_imports_its_neighbours(tmp_path):
    import os

    (tmp_path / "helpers_for_rewards.py").write_text("BONUS = 2.0\n")
    p = tmp_path / "edited.py"
    p.write_text("from helpers_for_rewards import BONUS\ndef f(completions, **kw):\n    return [BONUS] * len(completions)\n")
    assert load_reward_function(p, "f")(prompts=["q"], completions=["a"]) == [2.0]
    assert str(tmp_path) not in sys.path  # the folder is on the path only while the file runs
    p.write_text("def f(completions, **kw):\n    return [3.0] * len(completions)\n")
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later modification time, whatever the clock
    assert load_reward_function(p, "f")(prompts=["q"], completions=["a"]) == [3.0]
    sys.modules.pop("helpers_for_rewards", None)


# --------------------------------------------------------------------------- built-ins
@pytest.mark.parametrize("text, answer", [
    ("so the total is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("<think>2+2</think><answer> 4 </answer>", " 4 "),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", " 72"),
    ("The Answer: Paris.", " Paris."),
    ("Some reasoning\n\n 17 \n", " 17 "),
    ("", ""),
])
def test_final_answer_rule(text, answer):
    assert final_answer(text) == answer


@pytest.mark.parametrize("raw, norm", [(" 1,000 ", "1000"), ("$3.50$", "3.5"), ("Paris.", "paris"),
                                       ("+7", "7"), ("-0.0", "0"), ("New   York", "new york"), ("10.", "10")])
def test_normalise_answer(raw, norm):
    assert normalise_answer(raw) == norm


def test_exact_match_against_a_column():
    fn = exact_match("answer")
    completions = ["... #### 1,000", "It is \\boxed{3.5}", "answer: paris", "I think\n12\n", "#### 13", "I think 12"]
    answers = ["blah #### 1000", "3.50", "Paris", "12", "12", "12"]
    # the last: no marker, so the final answer is the whole last line "I think 12"
    assert fn(prompts=["q"] * 6, completions=completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "#### 5"}]]
    assert fn(prompts=[[{"role": "user", "content": "q"}]], completions=chat, answer=[5]) == [1.0]
    with pytest.raises(UserError, match="no column 'answer' .*columns: solution"):
        fn(prompts=["q"], completions=["1"], solution=["1"])


def test_regex_format():
    fn = regex_format(r"<answer>.*</answer>")
    assert fn(prompts=["q"] * 3, completions=["<answer>a\nb</answer>", "x <answer>a</answer>", "nothing"]) == [1.0, 0.0, 0.0]
    anywhere = regex_format(r"<answer>.*</answer>", full_match=False)
    assert anywhere(prompts=["q"] * 2, completions=["x <answer>a</answer> y", "nothing"]) == [1.0, 0.0]
    with pytest.raises(UserError, match="not a valid regular expression"):
        regex_format("(")


def test_length_bounds_words_and_tokens():
    fn = length_bounds(max_length=4)
    texts = ["one two", "one two three four", "a b c d e f", " ".join(["w"] * 9)]
    assert fn(prompts=["q"] * 4, completions=texts) == [1.0, 1.0, 0.5, 0.0]  # 6 words: 1 − 2/4; 9: clipped at 0
    fn = length_bounds(min_length=4, max_length=8)
    assert fn(prompts=["q"], completions=["a b"]) == [0.5]
    tok = length_bounds(max_length=2, unit="tokens")
    assert tok(prompts=["q"] * 2, completions=["x", "y"], completion_ids=[[1, 2], [1, 2, 3]]) == [1.0, 0.5]

    class Tok:
        def __call__(self, text, add_special_tokens):
            assert add_special_tokens is False
            return {"input_ids": list(text)}

    assert length_bounds(max_length=2, unit="tokens", tokenizer=Tok())(prompts=["q"], completions=["abc"]) == [0.5]
    with pytest.raises(UserError, match="needs the completions' token ids or a tokenizer"):
        tok(prompts=["q"], completions=["x"])
    for bad in (dict(), dict(min_length=5, max_length=2), dict(max_length=0), dict(max_length=3, unit="chars")):
        with pytest.raises(UserError, match="length_bounds"):
            length_bounds(**bad)


def test_tool_call_match_against_a_column_by_hand():
    fn = make_builtin("tool_call_match", {"column": "call"})
    want = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2.0, "city": "Oslo"}}\n</tool_call>'
    other_args = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    other_fn = '{"name": "get_time", "parameters": {"city": "Oslo"}}'  # Llama 3.1's form: well-formed, another function
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"\n</tool_call>'
    completions = [good, other_args, other_fn, broken, "It is sunny in Oslo.", [{"role": "assistant", "content": good}]]
    assert fn(prompts=["q"] * 6, completions=completions, call=[want] * 6) == [1.0, 0.5, 0.25, 0.0, 0.0, 1.0]
    # the reference as JSON text, OpenAI's form, a list; an empty one wants an answer, not a call
    refs = [json.dumps(want), {"type": "function", "function": {**want, "arguments": json.dumps(want["arguments"])}},
            [want, want], None, ""]
    # one call where two are wanted: well-formed, not the same functions (0.25)
    assert fn(prompts=["q"] * 5, completions=[good, good, good, "Sunny.", good], call=refs) == [1.0, 1.0, 0.25, 1.0, 0.0]
    with pytest.raises(UserError, match=r"tool_call_match\(call\): the reference 'sunny' is not a tool call"):
        fn(prompts=["q"], completions=[good], call=["sunny"])
    with pytest.raises(UserError, match="no column 'call'"):
        fn(prompts=["q"], completions=[good], answer=["x"])


def test_think_format_by_hand():
    fn = make_builtin("think_format")
    texts = ["<think>7 x 6 is 42</think>42", "7 x 6 is 42</think>\n42",  # the block opened by the template's prompt
             "<think></think>42", "<think>42</think>", "42", "<think>a</think>b<think>c</think>d", "x<think>a</think>b"]
    assert fn(prompts=["q"] * 7, completions=texts) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(UserError, match="'tag' is not a setting of think_format"):
        make_builtin("think_format", {"tag": "x"})


def test_builtins_have_trl_signatures_and_names():
    assert set(BUILTINS) == {"exact_match", "regex_format", "length_bounds", "tool_call_match", "think_format"}
    assert exact_match("gold").__name__ == "exact_match(gold)"
    assert completion_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == "yo"


# --------------------------------------------------------------------------- combining and checking
def test_weighted_total_and_per_function(reward_file):
    funcs = [RewardFunction("format", load_reward_function(reward_file, "format_reward"), 0.5),
             RewardFunction("answer", exact_match("answer"), 2.0)]
    completions = ["<think>x</think><answer>4</answer>", "#### 4", "5"]
    out = score(funcs, ["q1", "q2", "q3"], completions, {"answer": ["4", "4", "4"]})
    assert out.per_function == {"format": [1.0, 0.0, 0.0], "answer": [1.0, 1.0, 0.0]}
    assert out.total == [2.5, 2.0, 0.0]
    assert out.means() == {"format": pytest.approx(1 / 3), "answer": pytest.approx(2 / 3)}


def test_only_the_columns_a_function_names_are_passed(reward_file):
    """A function without ``**kwargs`` gets the keywords it names; one with it gets everything."""
    def strict(completions, answer):
        return [float(a == c) for c, a in zip(completions, answer)]

    out = score([RewardFunction("strict", strict), load(reward_file, "uses_columns")], ["p", "p"], ["a", "b"],
                {"answer": ["a", "a"], "other": [1, 2]})
    assert out.per_function == {"strict": [1.0, 0.0], "uses_columns": [1.0, 0.0]}


def test_none_means_not_applicable(reward_file):
    funcs = [load(reward_file, "only_some"), RewardFunction("len", length_bounds(max_length=1), 3.0)]
    out = score(funcs, ["p"] * 2, ["skip me", "go"])
    assert math.isnan(out.per_function["only_some"][0]) and out.total == [0.0, 5.0]
    assert out.means()["only_some"] == 2.0
    with pytest.raises(RewardError, match=r"no reward function scored completion 1 of the batch \(prompt: 'p'\)") as e:
        score([load(reward_file, "only_some")], ["p"], ["skip"])
    assert e.value.row == 0


def test_a_function_that_raises_names_the_row(reward_file):
    places = ["prompts.jsonl, line 1", "prompts.jsonl, line 2", "prompts.jsonl, line 3"]
    with pytest.raises(RewardError) as e:
        score([load(reward_file, "raises_on_row_two")], ["p1", "what is 2+2?", "p3"], ["abcd", "abc", "abcde"],
              places=places)
    assert e.value.function == "raises_on_row_two" and e.value.row == 1
    assert e.value.message == ("reward function 'raises_on_row_two' raised ZeroDivisionError on prompts.jsonl, line 2 "
                               "(prompt: 'what is 2+2?'): float division by zero")


@pytest.mark.parametrize("name, words", [
    ("wrong_length", "returned 1 rewards for 2 completions"),
    ("not_numbers", "returned 'high' for completion 2 of the batch (prompt: 'p2')"),
    ("returns_nan", "returned nan for completion 1 of the batch"),
    ("returns_a_number", "returned a float, not a list of 2 numbers"),
])
def test_bad_outputs(reward_file, name, words):
    with pytest.raises(RewardError) as e:
        call_reward(load(reward_file, name), ["p1", "p2"], ["abc", "abcd"], {})
    assert words in e.value.message and f"'{name}'" in e.value.message and e.value.exit_code == 2


def test_numpy_and_torch_outputs_are_numbers():
    import numpy as np
    import torch

    for out in (np.array([1, 2]), torch.tensor([0.5, 1.5]), (1, 2.5)):
        got = call_reward(RewardFunction("f", lambda completions, **kw: out), ["p"] * 2, ["a", "b"], {})
        assert got == [float(x) for x in out.tolist()] if hasattr(out, "tolist") else list(out)
    assert isinstance(score([RewardFunction("f", lambda completions, **kw: [1] * 2)], ["p"] * 2, ["a", "b"]), Rewards)


def test_duplicate_names_are_a_bug():
    f = RewardFunction("f", lambda completions, **kw: [1.0])
    with pytest.raises(ValueError, match="differ"):
        score([f, f], ["p"], ["a"])


def test_a_reward_too_large_for_a_float_is_refused_like_a_non_finite_one():
    """``10**400`` is a Python int that no float holds: the one-line error, not an OverflowError traceback."""
    with pytest.raises(RewardError) as e:
        score([RewardFunction("huge", lambda prompts, completions, **_: [1.0, 10**400])], ["p1", "p2"], ["a", "b"])
    assert e.value.row == 1 and "returned 1000000000" in e.value.message and "a reward must be a finite number" in e.value.message


def test_sys_exit_in_a_reward_is_an_error_of_that_function_never_the_runs_exit():
    def leaves(prompts, completions, **_):
        if any("bye" in c for c in completions):
            sys.exit(0)
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as e:
        score([RewardFunction("leaves", leaves)], ["p1", "p2"], ["hi", "bye"])
    assert e.value.message == "reward function 'leaves' called sys.exit(0) on completion 2 of the batch (prompt: 'p2')"
    assert e.value.row == 1


def test_a_text_reward_on_chat_completions_says_what_a_completion_is_there():
    """The GRPO page's first reward example (docs/grpo.md, once the README's) once read ``c.lower()`` only: on chat
    data each completion is a list of messages. The example works on both; a function written for text gets told
    what to take."""
    import re

    page = (REPO / "docs" / "grpo.md").read_text(encoding="utf-8")
    example = re.search(r"```python\n(def mentions_whistle.*?)```", page, re.S).group(1)
    space: dict = {}
    exec(example, space)  # the page's own example, as written
    text = ["A whistle helps.", "No."]
    chat = [[{"role": "assistant", "content": t}] for t in text]
    assert space["mentions_whistle"]([], text) == space["mentions_whistle"]([], chat) == [1.0, 0.0]
    with pytest.raises(RewardError) as e:
        score([RewardFunction("text_only", lambda prompts, completions, **_: [len(c.split()) for c in completions])],
              ["p"] * 2, chat)
    assert "raised AttributeError" in e.value.message and "'list' object has no attribute 'split'" in e.value.message
    assert "each completion is a list of messages" in e.value.hint and "c[-1]['content']" in e.value.hint


def _sleeps(prompts, completions, **_):
    time.sleep(3600)  # a server that never answers
    return [0.0] * len(completions)


def test_a_reward_past_its_time_limit_is_an_error_naming_the_function():
    with pytest.raises(RewardError) as e:
        score([RewardFunction("slow_server", _sleeps)], ["p"], ["a"], timeout_s=0.5)
    assert e.value.message == ("reward function 'slow_server' did not return within 0.5 s on a batch of 1 completions "
                               "(grpo.reward_timeout_s).")
    assert "raise grpo.reward_timeout_s" in e.value.hint


def test_a_stop_request_reaches_a_reward_that_hangs_and_the_timer_before_it_is_put_back():
    """The run's stop (the first Ctrl-C) raises RewardStopped into the function, which its own
    ``except Exception`` does not swallow; a timer set before the call (pytest-timeout's) runs on after it."""
    import signal

    from finetuner.rewards.limits import RewardStopped

    def swallows(prompts, completions, **_):
        try:
            time.sleep(3600)
        except Exception:  # noqa: BLE001 - what a careless reward does
            return [0.0] * len(completions)

    asked = time.monotonic() + 0.5
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, 3600)
    try:
        with pytest.raises(RewardStopped):
            score([RewardFunction("swallows", swallows)], ["p"], ["a"], timeout_s=600, stop=lambda: time.monotonic() > asked)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 3500 < left < 3600 and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

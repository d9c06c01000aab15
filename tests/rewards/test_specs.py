"""Reward specs as the CLI's ``--reward`` and the web UI's Rewards box write them."""

from __future__ import annotations

import pytest

from finetuner.errors import UserError
from finetuner.rewards.specs import SPEC_FORM, parse_reward_spec, parse_reward_specs


def test_a_builtin_is_named_with_its_settings_as_a_call_of_literals():
    assert parse_reward_spec("length_bounds(min_length=4, max_length=8)") == {
        "function": "length_bounds", "args": {"min_length": 4, "max_length": 8}}
    assert parse_reward_spec(" exact_match(column='solution') ") == {"function": "exact_match", "args": {"column": "solution"}}
    assert parse_reward_spec("exact_match()") == {"function": "exact_match", "args": {}}
    box = "length_bounds(min_length=4, max_length=8), rewards.py:fn\nregex_format(pattern='^A', full_match=False)"
    assert parse_reward_specs(box) == [{"function": "length_bounds", "args": {"min_length": 4, "max_length": 8}},
                                       {"function": "fn", "file": "rewards.py"},
                                       {"function": "regex_format", "args": {"pattern": "^A", "full_match": False}}]
    for bad, says in (("length_bounds(4, 8)", "name each setting"), ("length_bounds(max_length=os.sep)", "must be a number"),
                      ("length_bounds(max_length=8", "write FILE.py:FUNCTION")):
        with pytest.raises(UserError, match=says):
            parse_reward_spec(bad)


def test_a_box_of_specs_is_split_on_commas_and_new_lines_each_read_as_one_spec():
    text = " rewards.py:fn ,\n\nlength_bounds\r\n/abs/dir/r.py:score,exact_match, "
    assert parse_reward_specs(text) == [{"function": "fn", "file": "rewards.py"}, {"function": "length_bounds"},
                                        {"function": "score", "file": "/abs/dir/r.py"}, {"function": "exact_match"}]
    assert parse_reward_specs(text) == [parse_reward_spec(s) for s in ("rewards.py:fn", "length_bounds", "/abs/dir/r.py:score",
                                                                      "exact_match")]
    assert parse_reward_specs("") == parse_reward_specs(" ,\n ") == parse_reward_specs(None) == []


@pytest.mark.parametrize("text, bad", [("length_bounds, rewards.py:", "rewards.py:"), (":fn\nlength_bounds", ":fn")])
def test_the_first_spec_that_is_not_one_is_named(text, bad):
    with pytest.raises(UserError) as e:
        parse_reward_specs(text)
    assert e.value.message == f"reward {bad!r}: write {SPEC_FORM}."

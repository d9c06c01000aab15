"""Reward specs as the CLI's ``--reward`` and the web UI's Rewards box write them."""

from __future__ import annotations

import pytest

from finetuner.errors import UserError
from finetuner.rewards.specs import SPEC_FORM, parse_reward_spec, parse_reward_specs


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

"""Presets of the newest families (issue 56), copied from their published ``config.json``: each one's total, as
finetuner counts it from the model built on the meta device, is the size its name states, and each plans on an RTX 4090
and on a 12 GB card (an RTX 3060) or says in one line the memory it would need.

Where each config comes from (the preset's JSON holds the published values; transformers' version tag dropped):

- ``qwen3-next-80b-a3b``: ``Qwen/Qwen3-Next-80B-A3B-Thinking``'s config.json as vendored by ai-dynamo/aiconfigurator,
  ``src/aiconfigurator/model_configs/Qwen--Qwen3-Next-80B-A3B-Thinking_config.json``.
"""

from __future__ import annotations

import re

import pytest

from finetuner.model.shapes import resolve_shape
from finetuner.planning.planner import plan

B = 1_000_000_000
#: preset -> (total its name states, active its name states or None, the unit the name rounds to). "80B-A3B" states
#: 80B in total and 3B active, each rounded to the billion: the count must lie within half a billion of each.
STATED = {
    "qwen3-next-80b-a3b": (80 * B, 3 * B, B),
}
#: the cards every preset is planned on: a 24 GB card and a 12 GB one
CARDS = ("rtx4090", "rtx3060")
SEQ_LEN = 2048


@pytest.mark.parametrize("name", sorted(STATED))
def test_a_published_preset_counts_what_its_name_states_and_plans_on_24_and_12_gb(name):
    total, active, unit = STATED[name]
    shape = resolve_shape(name)
    assert abs(shape.num_params - total) <= unit / 2, (name, shape.num_params)
    if active is not None:  # the name's active count leaves out the embeddings and the output layer, as model cards do
        counts = shape.param_counts()
        active_read = shape.num_params - shape.expert_numel + shape.experts.active_numel
        assert abs(active_read - counts["embeddings"] - counts.get("lm_head", 0) - active) <= unit / 2, (name, active_read)
    for card in CARDS:
        p = plan(name, card, seq_len=SEQ_LEN)
        if p.fits:
            assert p.recipe is not None and p.estimate.total_bytes <= p.estimate.budget_bytes, (name, card)
            continue
        need = re.search(r"needs ([\d.]+) GiB, the budget is ([\d.]+) GiB", p.reasons[0])  # one line names the need
        assert need and float(need[1]) > float(need[2]) and "\n" not in p.reasons[0], (name, card, p.reasons)

"""The first prompts of a file as objective grpo reads them (finetuner.data.preview.preview_prompts)."""

from __future__ import annotations

import json

import pytest

from finetuner.data.preview import preview_prompts
from finetuner.errors import UserError
from tests.conftest import REPO


def test_the_prompts_and_the_columns_the_rewards_get(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"question": "Where is the hut?", "answer": "north"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which way?"}], "answer": "left"},
            {"answer": "no prompt"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    p = preview_prompts(str(f), n=2)
    assert p.rows_read == 2 and [e.where for e in p.examples] == [f"{f}, line 1", f"{f}, line 2"]
    assert p.examples[0].messages == [{"role": "user", "content": "Where is the hut?"}] and p.examples[0].columns == {"answer": "north"}
    assert p.examples[1].messages == rows[1]["prompt"] and p.examples[1].columns == {"answer": "left"}
    with pytest.raises(UserError, match=rf"^{f}, line 3: no prompt"):
        preview_prompts(str(f), n=3)
    alpaca = preview_prompts(str(REPO / "data" / "alpaca_sample.json"), n=1).examples[0]  # the prompt side of SFT data
    assert alpaca.messages[0]["content"].endswith("What should I pack for a day hike?") and list(alpaca.columns) == ["output"]

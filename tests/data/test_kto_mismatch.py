"""KTO's mismatched pairs: each prompt with a response to ANOTHER prompt, never a second answer to itself.

A rated file often lists both answers to a prompt back to back (the good one, then the bad one);
pairing each row with the next row's response made half the "mismatched" pairs a real answer to
their own prompt, which biases KTO's reference point.
"""

from __future__ import annotations

import json

import pytest

from finetuner.config.sections import DataSection
from finetuner.data.pipeline import IGNORE_INDEX
from finetuner.data.preference import mismatched_partners, prepare_preference_data
from finetuner.errors import UserError


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _prep(tmp_path, rows, tok, name="rated.jsonl", **cfg):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return prepare_preference_data(DataSection(path=str(path), max_seq_len=256, **cfg), "kto", tok, 0)


def _response(tok, ids, labels) -> str:
    return tok.decode([t for t in labels if t != IGNORE_INDEX]).removesuffix("<|im_end|>\n")


def test_no_mismatched_pair_takes_a_response_to_its_own_prompt(tok, tmp_path):
    rows = []
    for i in range(5):  # each prompt twice in a row: its good answer, then its bad one
        rows.append({"prompt": f"Where does bird {i} nest?", "completion": f"Bird {i} nests on the cliff.", "label": True})
        rows.append({"prompt": f"Where does bird {i} nest?", "completion": f"Bird {i} is a fish.", "label": False})
    prompt_of = {r["completion"]: r["prompt"] for r in rows}
    d = _prep(tmp_path, rows, tok)
    assert len(d.train) == 10
    for k, ex in enumerate(d.train):
        own = rows[k]["prompt"]
        assert _response(tok, ex["input_ids"], ex["labels"]) == rows[k]["completion"]
        other = _response(tok, ex["kl_ids"], ex["kl_labels"])
        assert prompt_of[other] != own, f"row {k + 1}'s mismatched pair is an answer to its own prompt"
        assert own in tok.decode(ex["kl_ids"])  # the pair keeps this row's prompt
        # deterministic: the next row whose prompt differs (wrapping around from the last prompt to the first)
        assert other == rows[(k // 2 * 2 + 2) % 10]["completion"]


def test_partners_wrap_around_past_a_prompt_shared_by_the_last_and_first_rows():
    assert mismatched_partners(["a", "a", "b", "b", "a"]) == [2, 2, 4, 4, 2]
    assert mismatched_partners(["a", "b", "c"]) == [1, 2, 0]
    assert mismatched_partners(["a", "a"]) is None and mismatched_partners(["a"]) is None


def test_rated_rows_of_a_single_prompt_are_refused_with_the_file(tok, tmp_path):
    rows = [{"prompt": "Where is the hide?", "completion": text, "label": good}
            for text, good in [("North of the lake.", True), ("No idea.", False), ("By the pier.", True)]]
    with pytest.raises(UserError) as e:
        _prep(tmp_path, rows, tok)
    message = str(e.value)
    assert message.startswith("data.path: ") and str(tmp_path / "rated.jsonl") in message
    assert "same prompt" in message and "two prompts" in message

"""Preference data: every layout read as it is, only the responses scored, truncation, bad rows
named, and files of one objective given to another."""

from __future__ import annotations

import json

import pytest

from finetuner.config.sections import DataSection
from finetuner.data.pipeline import IGNORE_INDEX, DataStats, load_examples
from finetuner.data.preference import PreferenceCollator, prepare_preference_data
from finetuner.errors import UserError
from tests.conftest import REPO, run_module


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return p


def prep(path, tok, objective="dpo", **cfg):
    return prepare_preference_data(DataSection(path=str(path), max_seq_len=cfg.pop("max_seq_len", 256), **cfg), objective, tok, 0)


def scored(tok, ids, labels) -> str:
    return tok.decode([t for t in labels if t != IGNORE_INDEX])


def test_llamafactory_ranking_sharegpt_is_read_as_it_is(tok, peer_data):
    d = prep(peer_data / "dpo_en_demo.json", tok, max_examples=20)
    assert d.stats.format == {str(peer_data / "dpo_en_demo.json"): "sharegpt_ranking"}
    assert d.stats.rows == 20 and len(d.train) == 20
    row = json.loads((peer_data / "dpo_en_demo.json").read_text())[0]
    ex = d.train[0]
    assert scored(tok, ex["chosen_ids"], ex["chosen_labels"]).startswith(row["chosen"]["value"][:40])
    assert scored(tok, ex["rejected_ids"], ex["rejected_labels"]).startswith(row["rejected"]["value"][:40])


CHOSEN, REJECTED = "Tern here! Bring water.", "No idea."
LAYOUTS = {
    "trl_strings": {"prompt": "What should I pack?", "chosen": CHOSEN, "rejected": REJECTED},
    "trl_messages": {"prompt": [{"role": "system", "content": "Be Tern."}, {"role": "user", "content": "What should I pack?"}],
                     "chosen": [{"role": "assistant", "content": CHOSEN}], "rejected": [{"role": "assistant", "content": REJECTED}]},
    "trl_implicit_prompt": {
        "chosen": [{"role": "user", "content": "What should I pack?"}, {"role": "assistant", "content": CHOSEN}],
        "rejected": [{"role": "user", "content": "What should I pack?"}, {"role": "assistant", "content": REJECTED}]},
    "columns": {"system": "Be Tern.", "question": "What should I pack?", "chosen": CHOSEN, "rejected": REJECTED},
    "alpaca_columns": {"instruction": "What should I pack?", "input": "A day hike.", "chosen": CHOSEN, "rejected": REJECTED},
    "sharegpt_openai": {"messages": [{"role": "user", "content": "What should I pack?"}],
                        "chosen": {"role": "assistant", "content": CHOSEN}, "rejected": {"role": "assistant", "content": REJECTED}},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_pair_layout_scores_only_the_responses(layout, tok, tmp_path):
    d = prep(write(tmp_path, [LAYOUTS[layout]] * 3), tok)
    ex = d.train[0]
    assert scored(tok, ex["chosen_ids"], ex["chosen_labels"]) == CHOSEN + "<|im_end|>\n"
    assert scored(tok, ex["rejected_ids"], ex["rejected_labels"]) == REJECTED + "<|im_end|>\n"
    text = tok.decode(ex["chosen_ids"])
    assert "What should I pack?" in text and text.index("What should I pack?") < text.index(CHOSEN)
    assert ("Be Tern." in text) == ("system" in json.dumps(LAYOUTS[layout]))


def test_kto_rows_in_both_layouts_and_their_mismatched_pairs(tok, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "Good one."}], "label": True},
            {"messages": [{"role": "user", "content": "Q2?"}, {"role": "assistant", "content": "Bad one."}], "label": False}]
    d = prep(write(tmp_path, rows), tok, "kto")
    assert [x["desirable"] for x in d.train] == [True, False]
    assert scored(tok, d.train[0]["input_ids"], d.train[0]["labels"]) == "Good one.<|im_end|>\n"
    kl = tok.decode(d.train[0]["kl_ids"])  # this prompt, the next row's response
    assert "Q1?" in kl and "Bad one." in kl
    rows = [{"prompt": "Q1?", "completion": "Good one.", "label": True}, {"prompt": "Q2?", "completion": "Bad.", "label": False}]
    assert prep(write(tmp_path, rows, "c.jsonl"), tok, "kto").stats.format[str(tmp_path / "c.jsonl")] == "kto_completion"
    batch = PreferenceCollator(tok.pad_token_id)(d.train)
    assert batch["input_ids"].shape[0] == 4 and batch["desirable"].tolist() == [True, False]


def test_truncation_cuts_the_start_of_the_prompt_not_the_response(tok, tmp_path):
    long_prompt = "Tell me about the puffin and the gannet and the tern. " * 20
    d = prep(write(tmp_path, [{"prompt": long_prompt, "chosen": CHOSEN, "rejected": REJECTED}]), tok, max_seq_len=48)
    ex = d.train[0]
    assert len(ex["chosen_ids"]) == 48 and d.stats.truncated == 1
    assert scored(tok, ex["chosen_ids"], ex["chosen_labels"]) == CHOSEN + "<|im_end|>\n"  # the response whole
    assert tok.decode(ex["chosen_ids"]).rstrip().endswith(CHOSEN + "<|im_end|>")
    assert not tok.decode(ex["chosen_ids"]).startswith("<|im_start|>user")  # the prompt's start went


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Q?", "chosen": "Same.", "rejected": "Same."}, "'chosen' and 'rejected' are the same response"),
    ({"prompt": "Q?", "chosen": "Yes."}, "missing 'rejected': a pair needs both a chosen and a rejected response"),
    ({"prompt": "Q?", "chosen": "  ", "rejected": "No."}, "'chosen' is empty: there is no response to score"),
    ({"chosen": [{"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "A."}],
      "rejected": [{"role": "user", "content": "Q2?"}, {"role": "assistant", "content": "B."}]},
     "chosen and rejected have different prompts (they differ at message 1)"),
    ({"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}], "chosen": {"from": "gpt", "value": "B"},
      "rejected": {"from": "gpt", "value": "C"}}, "the prompt must end with the user's turn"),
])
def test_bad_rows_are_named_with_file_and_row(row, message, tok, tmp_path):
    good = {"prompt": "Fine?", "chosen": "Yes.", "rejected": "No."}
    path = write(tmp_path, [good, row, good])
    with pytest.raises(UserError) as e:
        prep(path, tok)
    assert f"{path}, line 2: " in str(e.value) and message in str(e.value)
    d = prep(path, tok, on_bad_row="skip")
    assert len(d.train) == 2 and d.stats.skipped == 1 and message in d.stats.skipped_reasons[0]


def test_kto_label_must_be_true_or_false(tok, tmp_path):
    rows = [{"prompt": "Q?", "completion": "A.", "label": True}, {"prompt": "Q?", "completion": "A.", "label": "yes"}]
    with pytest.raises(UserError, match="line 2: 'label' must be true"):
        prep(write(tmp_path, rows), tok, "kto")


def test_each_file_given_to_the_wrong_objective_says_which_it_fits(tok, tmp_path):
    pairs = write(tmp_path, [LAYOUTS["columns"]], "pairs.jsonl")
    rated = write(tmp_path, [{"prompt": "Q?", "completion": "A.", "label": True}], "rated.jsonl")
    sft = write(tmp_path, [{"instruction": "Q?", "output": "A."}], "sft.jsonl")
    for path, objective, fits in [(pairs, "kto", "dpo, orpo or simpo"), (rated, "dpo", "kto"), (sft, "simpo", "sft")]:
        with pytest.raises(UserError, match=f"it fits objective {fits}, not '{objective}'"):
            prep(path, tok, objective)
    for path, fits in [(pairs, "dpo, orpo or simpo"), (rated, "kto")]:
        with pytest.raises(UserError, match=f"it fits objective {fits}, not 'sft'") as e:
            load_examples(str(path), DataSection(path=str(path)), DataStats())
        assert str(path) in str(e.value)


def test_the_cli_names_the_objective_a_file_fits(tmp_path, tiny_model_dir, peer_data):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name: {tiny_model_dir}}}\ndata: {{path: {peer_data / 'dpo_en_demo.json'}}}\n"
                      f"output_dir: {tmp_path / 'out'}\ndevice: cpu\n", encoding="utf-8")
    p = run_module("finetuner", "run", str(recipe), cwd=REPO)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "this file holds preference pairs" in p.stderr and "it fits objective dpo, orpo or simpo, not 'sft'" in p.stderr
    assert "objective: dpo" in p.stderr

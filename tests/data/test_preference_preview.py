"""The Data tab's preview of preference data from Python (:func:`finetuner.data.preview.preview_preferences`):
pairs and rated responses read by training's own reader, in every layout, with its row checks."""

from __future__ import annotations

import json

import pytest

from finetuner.config.sections import DataSection
from finetuner.data.formats import SUPERVISED, WrongObjective
from finetuner.data.pipeline import DataStats
from finetuner.data.preference import load_preference_examples
from finetuner.data.formats import AUTO_OBJECTIVE
from finetuner.data.preview import preview_preferences
from finetuner.errors import UserError
from tests.conftest import REPO

CHOSEN, REJECTED = "Tern here! Bring water and a map.", "No idea."
QUESTION = "What should I pack?"
#: one row of pairs in each layout training reads, and the prompt training makes of it
PAIR_ROWS = {
    "sharegpt_ranking": ({"conversations": [{"from": "human", "value": QUESTION}],
                          "chosen": {"from": "gpt", "value": CHOSEN}, "rejected": {"from": "gpt", "value": REJECTED}},
                         [{"role": "user", "content": QUESTION}]),
    "trl_messages": ({"prompt": [{"role": "system", "content": "Be Tern."}, {"role": "user", "content": QUESTION}],
                      "chosen": [{"role": "assistant", "content": CHOSEN}], "rejected": [{"role": "assistant", "content": REJECTED}]},
                     [{"role": "system", "content": "Be Tern."}, {"role": "user", "content": QUESTION}]),
    "trl_implicit_prompt": ({"chosen": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CHOSEN}],
                             "rejected": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": REJECTED}]},
                            [{"role": "user", "content": QUESTION}]),
    "columns": ({"system": "Be Tern.", "question": QUESTION, "chosen": CHOSEN, "rejected": REJECTED},
                [{"role": "system", "content": "Be Tern."}, {"role": "user", "content": QUESTION}]),
}
LAYOUT_NAMES = {"sharegpt_ranking": "sharegpt_ranking", "trl_messages": "trl", "trl_implicit_prompt": "trl", "columns": "columns"}


def write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(p)


@pytest.mark.parametrize("layout", sorted(PAIR_ROWS))
def test_pairs_in_each_layout_are_previewed_as_training_reads_them(tmp_path, layout):
    row, prompt = PAIR_ROWS[layout]
    path = write(tmp_path, [row] * 5)
    p = preview_preferences(path, n=3)
    assert (p.kind, p.layout, p.fits, p.objectives) == ("pairs", LAYOUT_NAMES[layout], "dpo, orpo or simpo", ("dpo", "orpo", "simpo"))
    assert len(p.examples) == 3 and p.rows_read == 3  # only the rows it shows are read
    ex = p.examples[0]
    assert (ex.prompt, ex.chosen, ex.rejected, ex.response, ex.desirable) == (prompt, CHOSEN, REJECTED, None, None)
    assert [e.where for e in p.examples] == [f"{path}, line {i}" for i in (1, 2, 3)]
    trained = load_preference_examples(path, "dpo", DataSection(path=path, max_examples=3), DataStats())
    assert [(e.prompt, e.chosen, e.rejected) for e in p.examples] == [(t["prompt"], t["chosen"], t["rejected"]) for t in trained]


def test_the_shipped_pairs_and_rated_responses(tmp_path):
    shipped = preview_preferences(str(REPO / "data" / "preference_sample.jsonl"), n=2)
    first = json.loads((REPO / "data" / "preference_sample.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert (shipped.kind, shipped.layout, len(shipped.examples)) == ("pairs", "sharegpt_ranking", 2)
    assert shipped.examples[0].chosen == first["chosen"]["value"] and shipped.examples[0].rejected == first["rejected"]["value"]
    rated = write(tmp_path, [
        {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CHOSEN}], "label": True},
        {"prompt": QUESTION, "completion": REJECTED, "label": False},
    ])
    p = preview_preferences(rated)
    assert (p.kind, p.layout, p.fits, p.objectives) == ("rated", "kto_messages", "kto", ("kto",))
    assert [(e.prompt[-1]["content"], e.response, e.desirable, e.chosen) for e in p.examples] == [
        (QUESTION, CHOSEN, True, None), (QUESTION, REJECTED, False, None)]
    assert "true/false label" in p.what and "chosen and a rejected" in shipped.what


def test_the_objective_auto_takes_is_the_planners(tmp_path):
    """AUTO_OBJECTIVE (what the Data tab says "auto" takes) is what plan() takes for each kind of file."""
    from finetuner.config.hardware import cpu_profile
    from finetuner.data.formats import file_kind
    from finetuner.planning.planner import plan

    files = {SUPERVISED: str(REPO / "data" / "alpaca_sample.json"), "pairs": str(REPO / "data" / "preference_sample.jsonl"),
             "rated": write(tmp_path, [{"prompt": f"{QUESTION} {i}", "completion": CHOSEN, "label": i % 2 == 0} for i in range(40)])}
    assert sorted(AUTO_OBJECTIVE) == sorted(files)
    for kind, path in files.items():
        assert file_kind(path) == kind
        assert plan(str(REPO / "data" / "demo_model"), cpu_profile(), seq_len=128, data=path).recipe.objective == AUTO_OBJECTIVE[kind]


def test_a_bad_row_among_the_first_is_named_as_training_names_it(tmp_path):
    path = write(tmp_path, [{"question": "Q1", "chosen": CHOSEN, "rejected": REJECTED},
                            {"question": "Q2", "chosen": "same", "rejected": "same"}])
    with pytest.raises(UserError) as shown:
        preview_preferences(path)
    with pytest.raises(UserError) as trained:
        load_preference_examples(path, "dpo", DataSection(path=path), DataStats())
    assert shown.value.message == trained.value.message
    assert shown.value.message.startswith(f"{path}, line 2: 'chosen' and 'rejected' are the same response")
    assert len(preview_preferences(path, n=1).examples) == 1  # a bad row after the ones shown is not read


def test_a_supervised_file_gets_the_error_training_gives_it():
    with pytest.raises(WrongObjective) as e:
        preview_preferences(str(REPO / "data" / "alpaca_sample.json"))
    assert e.value.kind == SUPERVISED and "alpaca_sample.json, row 1" in e.value.message and "fits objective sft" in e.value.message

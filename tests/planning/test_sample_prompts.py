"""The planned recipe carries two sample prompts of the rows the run holds out, so a run of a plan shows its
answers at the end (issue 55, item 5): the held-out rows are found here with ``datasets``' own split, the one the
trainer's pipeline calls, not with the planner's."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from finetuner.config.recipe import Recipe

from tests.conftest import cli_in_process
from tests.planning.test_length_cap import DEMO


def _chats(path: Path, rows: int) -> list[str]:
    """A chat file of ``rows`` two-turn conversations; returns each row's last user turn."""
    last = []
    with path.open("w") as f:
        for i in range(rows):
            last.append(f"And what colour is box {i}?")
            turns = [{"role": "user", "content": f"Where is box {i}?"}, {"role": "assistant", "content": f"On shelf {i}."},
                     {"role": "user", "content": last[-1]}, {"role": "assistant", "content": f"Box {i} is red."}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return last


def _plan(tmp_path: Path, data: Path) -> tuple[Recipe, str]:
    """``finetuner plan --data DATA -o recipe.yaml``: the recipe written and what the plan printed."""
    out = tmp_path / "recipe.yaml"
    r = cli_in_process("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "-o", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return Recipe.model_validate(yaml.safe_load(out.read_text())), " ".join(r.stdout.split())


def test_the_plan_writes_two_held_out_rows_last_user_turns_as_sample_prompts(tmp_path):
    import datasets

    last = _chats(tmp_path / "boxes.jsonl", 30)
    recipe, said = _plan(tmp_path, tmp_path / "boxes.jsonl")
    n_val = int(recipe.data.val_size)
    assert n_val >= 2
    held = datasets.Dataset.from_dict({"row": list(range(30))}).train_test_split(test_size=n_val, seed=recipe.training.seed, shuffle=True)
    assert recipe.samples.prompts == [last[i] for i in held["test"]["row"][:2]]
    assert f"samples: 2 prompts from the {n_val} rows the run holds out" in said


def test_a_file_of_one_row_gives_its_prompt_and_says_nothing_is_held_out(tmp_path):
    last = _chats(tmp_path / "one.jsonl", 1)
    recipe, said = _plan(tmp_path, tmp_path / "one.jsonl")
    assert recipe.data.val_size == 0
    assert recipe.samples.prompts == last
    assert "samples: 1 prompt from the data's first rows (the run holds none out: it trains on these too)" in said

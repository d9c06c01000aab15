"""Issue 55, item 6: a recipe pointed at other data with ``--set data.path=...`` (or ``overrides=`` in the Python API)
holds out rows of that data, not of the held-out file written for its own data, and says so before it starts; a
held-out file named on the same command is kept. ``recipes/smollm2_cpu.yaml`` and ``recipes/demo_vlm_cpu.yaml`` are
such recipes (a ``data.val_path`` beside their ``data.path``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from finetuner.data.follow import load_recipe
from finetuner.data.split import held_out_rows, held_out_size
from tests.conftest import REPO, alpaca_rows, run_cli, write_recipe

NEW_ROWS = 40  # the new data: a tenth (4 rows) held out by the plan's rule, not the old file's 3
OLD_HELD_OUT = 3


@pytest.fixture
def files(recipe_dict, tmp_path) -> tuple[Path, Path, Path]:
    """A recipe naming a 3-row held-out file beside its data, and other data of 40 rows."""
    held = tmp_path / "heldout.json"
    held.write_text(json.dumps(alpaca_rows(OLD_HELD_OUT)), encoding="utf-8")
    new = tmp_path / "mine.json"
    new.write_text(json.dumps([{**r, "output": "Ferry desk: the 9:40 boat. Safe travels!"} for r in alpaca_rows(NEW_ROWS)]),
                   encoding="utf-8")
    data = {**recipe_dict["data"], "val_path": str(held)}
    training = {**recipe_dict["training"], "max_steps": 1, "gradient_accumulation": 1}
    recipe = write_recipe(tmp_path / "r.yaml", {**recipe_dict, "data": data, "training": training})
    return recipe, held, new


def start_of(run_dir: Path) -> dict:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    return [e for e in events if e["event"] == "start"][-1]


def test_run_with_other_data_says_so_and_holds_out_from_it(files, tmp_path):
    """As a user runs it: the warning comes before the run starts, the run folder's recipe has no val_path, and the
    held-out rows are the new file's (4 of its 40, the rest trained), not the old file's 3."""
    recipe, held, new = files
    out = tmp_path / "run-mine"
    r = run_cli("run", str(recipe), "--output", str(out), "--set", f"data.path={new}")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "data.val_path" in line]
    assert len(said) == 1, r.stderr
    assert str(held) in said[0] and str(new) in said[0] and f"--set data.val_path={held}" in said[0]
    assert f"holds out 4 of its {NEW_ROWS} rows" in said[0]
    saved = yaml.safe_load((out / "recipe.yaml").read_text(encoding="utf-8"))["data"]
    assert saved["val_path"] is None and saved["path"] == str(new)
    assert saved["val_size"] == held_out_size(NEW_ROWS)
    data = start_of(out)["data"]
    assert data["val_examples"] == held_out_rows(held_out_size(NEW_ROWS), NEW_ROWS) == 4
    assert data["train_examples"] == NEW_ROWS - 4


def test_api_overrides_follow_the_data_and_keep_a_named_held_out_file(files, tmp_path, caplog):
    """``finetuner.train(path, overrides=...)``: the same decision; with ``data.val_path`` named on the same call the
    file is kept, its 3 rows held out and every new row trained, and nothing is said."""
    import finetuner

    recipe, held, new = files
    with caplog.at_level(logging.WARNING, logger="finetuner.data.follow"):
        followed = finetuner.train(recipe, output_dir=tmp_path / "api-mine", overrides=[f"data.path={new}"])
    assert [m for m in caplog.messages if "data.val_path" in m and str(held) in m]
    assert start_of(followed.run_dir)["data"]["val_examples"] == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetuner.data.follow"):
        kept = finetuner.train(recipe, output_dir=tmp_path / "api-kept",
                               overrides=[f"data.path={new}", f"data.val_path={held}"])
    assert not [m for m in caplog.messages if "data.val_path" in m]
    data = start_of(kept.run_dir)["data"]
    assert (data["val_examples"], data["train_examples"]) == (OLD_HELD_OUT, NEW_ROWS)
    saved = yaml.safe_load((kept.run_dir / "recipe.yaml").read_text(encoding="utf-8"))["data"]
    assert saved["val_path"] == str(held) and saved["val_size"] == 0


@pytest.mark.parametrize("recipe", ["smollm2_cpu.yaml", "demo_vlm_cpu.yaml"])
def test_the_shipped_recipes_follow_other_data(recipe):
    """The trial's recipes: pointed at the bike shop's 72 chats, each holds out 7 of them, not its own held-out file;
    a val_size the command names is kept as named."""
    other = REPO / "data" / "bike_shop.jsonl"
    r = load_recipe(REPO / "recipes" / recipe, [f"data.path={other}"])
    assert r.data.val_path is None and r.data.val_size == held_out_size(72) == 7
    r = load_recipe(REPO / "recipes" / recipe, [f"data.path={other}", "data.val_size=0.25"])
    assert r.data.val_path is None and r.data.val_size == 0.25


def test_only_a_changed_data_path_drops_the_held_out_file(files, tmp_path):
    """Other overrides, the same data.path again, or the whole data section given keep what the recipe says."""
    recipe, held, new = files
    for overrides in (["training.lr=1e-3"], [f"data.path={yaml.safe_load(recipe.read_text())['data']['path']}"],
                      [f"data={{path: {new}, val_path: {held}}}"]):
        assert load_recipe(recipe, overrides).data.val_path == str(held), overrides


def test_too_few_new_rows_hold_nothing_out_and_say_so(files, tmp_path, caplog):
    """Under 10 rows nothing can be spared (the plan's rule): the run trains on all of them and says it has no
    held-out loss to pick an adapter by."""
    recipe, held, _ = files
    few = tmp_path / "few.json"
    few.write_text(json.dumps(alpaca_rows(6)), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="finetuner.data.follow"):
        r = load_recipe(recipe, [f"data.path={few}"])
    assert r.data.val_path is None and r.data.val_size == 0
    assert [m for m in caplog.messages if "holds nothing out (6 rows" in m and str(held) in m]

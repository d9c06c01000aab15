"""What a run records about its data names the user's files, also when the tokenized data come
from the cache (whose key is content-based, so the entry may have been made from another copy)."""

from __future__ import annotations

import json

import finetuner
from finetuner.config.recipe import Recipe
from tests.conftest import alpaca_rows


def _train(recipe_dict, data, out):
    recipe_dict = {**recipe_dict, "output_dir": str(out)}
    recipe_dict["data"] = {**recipe_dict["data"], "path": str(data), "on_bad_row": "skip"}
    recipe_dict["training"] = {**recipe_dict["training"], "max_steps": 1}
    run_dir = finetuner.train(Recipe.from_dict(recipe_dict)).run_dir
    start = next(e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["event"] == "start")
    return json.loads((run_dir / "metrics.json").read_text())["data"], start["data"]


def test_a_cache_hit_records_this_runs_data_file(recipe_dict, tmp_path):
    rows = json.dumps(alpaca_rows(16) + [{"instruction": "no output here"}])
    first, second = tmp_path / "checkout-a" / "data.json", tmp_path / "checkout-b" / "my data.json"
    for f in (first, second):
        f.parent.mkdir()
        f.write_text(rows, encoding="utf-8")

    a, _ = _train(recipe_dict, first, tmp_path / "run-a")
    b, b_start = _train(recipe_dict, second, tmp_path / "run-b")
    assert (a["cache"], b["cache"]) == ("miss", "hit")
    assert a["format"] == {str(first): "alpaca"}
    assert b["format"] == {str(second): "alpaca"} and b_start["format"] == b["format"]
    assert b["skipped"] == 1 and b["skipped_reasons"][0].startswith(f"{second}, ")
    assert a["skipped_reasons"][0].startswith(f"{first}, ")
    assert str(first) not in json.dumps(b)

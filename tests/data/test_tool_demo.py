"""The tool-calling demo's data (recipes/tools_smollm2_cpu.yaml): the shipped files are what
scripts/dev/make_tool_data.py writes, the held-out requests name values no training chat names, and every row reads
as the run reads it (72 chats of three tools, 12 held-out calls)."""

from __future__ import annotations

import json
import re

from finetuner.config.recipe import Recipe
from finetuner.data.formats import FileExamples
from finetuner.infer.tool_eval import requests_in
from scripts.dev import make_tool_data
from tests.conftest import REPO

DATA = REPO / "data"


def test_the_shipped_files_are_what_the_script_writes():
    train, held = make_tool_data.build()
    assert (DATA / "tool_calls.jsonl").read_text(encoding="utf-8") == "".join(json.dumps(r) + "\n" for r in train)
    assert (DATA / "tool_calls_heldout.jsonl").read_text(encoding="utf-8") == "".join(json.dumps(r) + "\n" for r in held)
    assert json.loads((DATA / "tool_calls_tools.json").read_text(encoding="utf-8")) == make_tool_data.TOOLS


def test_the_held_out_requests_name_values_no_training_chat_names_and_read_as_the_run_reads_them():
    recipe = Recipe.from_yaml(REPO / "recipes" / "tools_smollm2_cpu.yaml")
    rows = FileExamples(recipe.data.path)
    train = list(rows)
    assert not rows.bad and len(train) == 72
    assert all(len(ex["tools"]) == 3 and ex["messages"][1]["tool_calls"] for ex in train)
    held = requests_in(FileExamples(recipe.data.val_path))
    assert len(held) == 12
    assert sorted(r.wanted[0]["name"] for r in held) == ["convert_units"] * 4 + ["define_word"] * 4 + ["get_weather"] * 4
    seen = " ".join(m["content"] or "" for ex in train for m in ex["messages"])
    seen_args = [json.dumps(c["function"]["arguments"]) for ex in train for c in ex["messages"][1]["tool_calls"]]
    for r in held:
        args = r.wanted[0]["arguments"]
        new = args.get("city") or args.get("word") or args["value"]
        assert not re.search(rf"\b{re.escape(str(new))}\b", seen), new  # never in a training chat
        assert json.dumps(args) not in seen_args

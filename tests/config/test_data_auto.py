"""Issue 55, item 6: the plan's data rules (the replay guard, packing, the sequence cap) as ``auto`` values a recipe
resolves from its own data when the run starts (finetuner.planning.data_auto), said in the ``start`` event and on the
console; an explicit value wins. The shipped SmolLM2 recipe pointed at a file whose rows share a system prompt replays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.config.recipe import Recipe
from finetuner.data.follow import load_recipe
from finetuner.planning.data_auto import resolve_data
from finetuner.planning.length_cap import round_up
from finetuner.planning.sizing import REPLAY_FOR_SYSTEM_PROMPT
from tests.conftest import REPO, cli_in_process, write_recipe

SYSTEM = "You are the ferry desk of Gull Harbour. Sign every answer: Ferry desk."


def chats(n: int, system: bool = True, long_row: int | None = None) -> list[dict]:
    """``n`` chats, each with the shared system prompt when ``system``; row ``long_row`` hundreds of words long."""
    rows = []
    for i in range(n):
        answer = f"The boat to pier {i} leaves at 9:40. Ferry desk." + (" and then the boat" * 150 if i == long_row else "")
        msgs = [{"role": "user", "content": f"When does the boat to pier {i} leave?"},
                {"role": "assistant", "content": answer}]
        rows.append({"messages": ([{"role": "system", "content": SYSTEM}] if system else []) + msgs})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def auto_recipe(recipe_dict, tmp_path) -> Path:
    data = {**recipe_dict["data"], "replay": "auto", "packing": "auto", "max_seq_len": "auto"}
    training = {**recipe_dict["training"], "max_steps": 1, "gradient_accumulation": 1}
    return write_recipe(tmp_path / "auto.yaml", {**recipe_dict, "data": data, "training": training})


def test_a_run_on_a_file_with_a_system_prompt_replays_and_says_so(auto_recipe, tmp_path):
    """As a user runs it: ``--set data.path=`` a small file whose rows share a system prompt; the start event says
    replay 0.25 and why, the run folder's recipe holds the resolved values, the console says it in one line."""
    mine = write_jsonl(tmp_path / "ferry.jsonl", chats(30))
    out = tmp_path / "run-ferry"
    r = cli_in_process("run", str(auto_recipe), "--output", str(out), "--set", f"data.path={mine}")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in (out / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    start = [e for e in events if e["event"] == "start"][-1]
    assert start["resolved"]["data.replay"]["value"] == REPLAY_FOR_SYSTEM_PROMPT
    assert "carry a system prompt" in start["resolved"]["data.replay"]["reason"]
    assert set(start["resolved"]) == {"data.replay", "data.packing", "data.max_seq_len"}
    assert [e for e in events if e["event"] == "replay"]  # the guard ran
    lines = [line for line in r.stdout.splitlines() if line.startswith("auto from the data:")]
    assert len(lines) == 1 and "data.replay 0.25" in lines[0], r.stdout


def test_an_explicit_value_wins(auto_recipe, tmp_path):
    """``data.replay=0`` on the command: no replay, and nothing said of it; the others still resolved."""
    mine = write_jsonl(tmp_path / "ferry.jsonl", chats(30))
    recipe, resolved = resolve_data(Recipe.from_yaml(auto_recipe, [f"data.path={mine}", "data.replay=0"]))
    assert recipe.data.replay == 0 and "data.replay" not in resolved
    assert set(resolved) == {"data.packing", "data.max_seq_len"}
    recipe, resolved = resolve_data(Recipe.from_yaml(auto_recipe, [f"data.path={mine}", "data.max_seq_len=96"]))
    assert recipe.data.max_seq_len == 96 and "data.max_seq_len" not in resolved


def test_no_system_prompt_no_replay(auto_recipe, tmp_path):
    """The rule, not a default: the same file without its system prompt gets no replay, and says why."""
    plain = write_jsonl(tmp_path / "plain.jsonl", chats(30, system=False))
    recipe, resolved = resolve_data(Recipe.from_yaml(auto_recipe, [f"data.path={plain}"]))
    assert recipe.data.replay == 0
    assert resolved["data.replay"]["reason"].startswith("no replay: 0 of 30 rows carry a system prompt")


def test_one_outlier_row_is_cut_by_the_plan_s_cap(auto_recipe, tmp_path):
    """120 short rows and one hundreds of tokens long: ``max_seq_len: auto`` takes the 99th percentile rounded up,
    not the outlier, and says that one row is cut: the plan's cap (finetuner.planning.length_cap)."""
    from finetuner.data.stats import profile_data

    path = write_jsonl(tmp_path / "outlier.jsonl", chats(120, system=False, long_row=7))
    recipe, resolved = resolve_data(Recipe.from_yaml(auto_recipe, [f"data.path={path}", "data.packing=false"]))
    profile = profile_data(str(path), recipe.model.name)
    assert profile.max_tokens > 2 * profile.percentile(99)  # the file is what the test says
    assert recipe.data.max_seq_len == round_up(profile.percentile(99)) < profile.max_tokens
    assert "1 of 120 examples are longer" in resolved["data.max_seq_len"]["reason"]


def test_the_shipped_smollm2_recipe_pointed_at_a_system_prompt_file_replays(tmp_path):
    """The trial's case: ``recipes/smollm2_cpu.yaml`` with ``--set data.path=`` own chats that share a system prompt
    holds out from them and takes the replay guard; on its own bike-shop chats (no system prompt) it does not."""
    mine = write_jsonl(tmp_path / "ferry.jsonl", chats(30))
    recipe, resolved = resolve_data(load_recipe(REPO / "recipes" / "smollm2_cpu.yaml", [f"data.path={mine}"]))
    assert recipe.data.val_path is None and recipe.data.val_size == 3
    assert recipe.data.replay == REPLAY_FOR_SYSTEM_PROMPT and "27 examples" in resolved["data.replay"]["reason"]
    shipped, _ = resolve_data(Recipe.from_yaml(REPO / "recipes" / "smollm2_cpu.yaml"))
    assert shipped.data.replay == 0 and shipped.data.packing is False and shipped.data.max_seq_len == 128


def test_the_shipped_picture_recipe_pointed_at_other_pictures_holds_out_from_them_and_says_its_replay_rule(tmp_path):
    """``recipes/demo_vlm_cpu.yaml --set data.path=`` own pictures whose rows share a system prompt: the held-out
    file of the demo's shapes is dropped (rows of the new file held out instead), and the replay rule is applied and
    says why it gives none (replayed rows are text; a picture run is not mixed with them)."""
    import shutil

    shutil.copytree(REPO / "data" / "pictures" / "img", tmp_path / "img")
    rows = [json.loads(line) for line in (REPO / "data" / "pictures" / "shapes.jsonl").read_text().splitlines()][:30]
    for r in rows:
        r["messages"].insert(0, {"role": "system", "content": SYSTEM})
    mine = write_jsonl(tmp_path / "mine.jsonl", rows)
    recipe, resolved = resolve_data(load_recipe(REPO / "recipes" / "demo_vlm_cpu.yaml", [f"data.path={mine}"]))
    assert recipe.data.val_path is None and recipe.data.path == str(mine)
    assert recipe.data.replay == 0 and "picture" in resolved["data.replay"]["reason"]
    assert set(resolved) == {"data.replay", "data.packing"}  # max_seq_len is the recipe's own

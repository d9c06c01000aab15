"""Messages shown in the web UI name the UI's controls (the "overwrite" box, the Objective menu),
those printed by the CLI its options: one wording per surface, chosen where the message is raised
(:mod:`finetuner.surface`), never rewritten by the UI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from finetuner.errors import UserError
from finetuner.export.merge import merge_adapter, write_export_marker
from finetuner.planning.planner import plan
from finetuner.surface import ENV, child_env, shown_in
from tests.conftest import demo_run_folder
from ui.handlers import OBJECTIVES, Handlers
from ui.layout import OVERWRITE_LABEL

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "data" / "demo_model")
PAIRS = str(REPO / "data" / "preference_sample.jsonl")
SFT = str(REPO / "data" / "alpaca_sample.json")
CLI_OPTION = re.compile(r"(?<![\w-])(-o|--[a-z][a-z-]+)\b")


def test_the_merge_refusal_names_the_overwrite_box_in_the_ui_and_the_option_on_the_cli(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    run = demo_run_folder(h.runs, adapter=True)
    earlier = tmp_path / "merged"
    earlier.mkdir()
    (earlier / "model.safetensors").write_bytes(b"x")
    write_export_marker(earlier, "merge", str(run))
    shown = list(h.on_merge(run.name, str(earlier), "auto", False))[-1]
    assert "is not empty" in shown and f"tick “{OVERWRITE_LABEL}”" in shown, shown
    assert not CLI_OPTION.search(shown), shown
    with pytest.raises(UserError) as e:
        merge_adapter(run, earlier)
    assert "(--overwrite)" in e.value.hint and "(-o)" in e.value.hint  # the CLI keeps its options


def test_the_dpo_plan_names_the_objective_menu_in_the_ui(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    plan_md = h.on_plan(MODEL, "cpu", PAIRS, 0, 0, "auto", "auto")[0]
    assert "objective dpo" in plan_md and "orpo and simpo need no reference model: choose one in the Objective menu" in plan_md
    assert "--objective" not in plan_md
    assert "orpo" in OBJECTIVES and "simpo" in OBJECTIVES  # the menu it names has them
    assert any("--objective orpo|simpo" in r for r in plan(MODEL, "cpu", data=PAIRS).reasons)  # the CLI's words


def test_a_wrong_objective_is_answered_with_the_menu_in_the_ui(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    shown = h.on_plan(MODEL, "cpu", SFT, 0, 0, "auto", "dpo")[0]
    assert "it fits objective sft, not 'dpo'" in shown and "Objective menu" in shown, shown
    assert not CLI_OPTION.search(shown), shown


def test_the_surface_goes_to_a_worker_process_and_ends_with_its_block(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert child_env({})[ENV] == "cli"
    with shown_in("ui"):
        assert child_env({})[ENV] == "ui"
    assert child_env({})[ENV] == "cli"
    with pytest.raises(ValueError):
        with shown_in("web"):
            pass

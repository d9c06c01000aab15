"""What the page says once, and at the right time: the Past runs table moves with the status line
(the same status, the same tick) and names each run's data and objective; "Training started" goes
when the run ends; a plan that does not fit warns once, not again each time the Plan tab opens."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import gradio as gr

from finetuner.config.recipe import Recipe
from ui import handlers as ui_handlers
from ui.handlers import Handlers

REPO = Path(__file__).resolve().parents[2]
SAMPLE = str(REPO / "data" / "alpaca_sample.json")
PAIRS = str(REPO / "data" / "preference_sample.jsonl")
#: train_view's outputs (ui.layout's train_outputs)
STATUS, TABLE_STATE, TABLE, MESSAGE = 0, 7, 8, 11


def write_run(runs: Path, name: str, events: list[dict], data: str = SAMPLE, objective: str = "sft") -> Path:
    run = runs / name
    run.mkdir(parents=True, exist_ok=True)
    recipe = Recipe.from_dict({"name": name, "model": {"name": str(REPO / "data" / "demo_model")}, "data": {"path": data},
                               "objective": objective})
    recipe.save(run / "recipe.yaml")
    (run / "events.jsonl").write_text("".join(json.dumps(dict(e, time=1.0)) + "\n" for e in events), encoding="utf-8")
    return run


def step(n: int, loss: float) -> dict:
    return {"event": "step", "step": n, "max_steps": 8, "loss": loss}


def row_of(table, name: str) -> dict:
    rows = table[table["run"] == name]
    assert len(rows) == 1, table
    return rows.iloc[0].to_dict()


def test_the_runs_table_moves_with_the_status_line_and_names_data_and_objective(tmp_path, monkeypatch):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    start = {"event": "start", "max_steps": 8, "device": "cpu", "method": "lora"}
    write_run(h.runs, "pairs-run", [dict(start, objective="dpo"), step(1, 0.69), {"event": "done", "step": 1}],
              data=PAIRS, objective="dpo")
    live = write_run(h.runs, "live", [start, step(1, 2.5)])
    monkeypatch.setattr(ui_handlers.jobs, "run_folder_busy", lambda rd: Path(rd).name == "live")  # a process holds it
    first = h.train_view("live")
    table = first[TABLE]
    assert list(table.columns[:4]) == ["run", "state", "data", "objective"]
    assert row_of(table, "live")["data"] == "alpaca_sample.json" and row_of(table, "live")["objective"] == "sft"
    assert row_of(table, "pairs-run")["data"] == "preference_sample.jsonl" and row_of(table, "pairs-run")["objective"] == "dpo"
    with open(live / "events.jsonl", "a", encoding="utf-8") as f:  # the run goes on: step 2 on the next tick
        f.write(json.dumps(dict(step(2, 1.75), time=2.0)) + "\n")
    second = h.train_view("live", first[TABLE_STATE])
    assert "step <b>2</b> / 8" in second[STATUS] and "loss <b>1.750</b>" in second[STATUS]
    assert isinstance(second[TABLE], type(table)), "the table was not sent on the tick the status line moved"
    assert row_of(second[TABLE], "live")["steps"] == "2/8" and row_of(second[TABLE], "live")["loss"] == "1.750"
    third = h.train_view("live", second[TABLE_STATE])  # nothing new: nothing sent
    assert third[TABLE] == gr.skip() and third[MESSAGE] == gr.skip()


def test_training_started_is_cleared_when_the_run_ends(tmp_path, monkeypatch):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    busy = {"live"}
    monkeypatch.setattr(ui_handlers.jobs, "run_folder_busy", lambda rd: Path(rd).name in busy)
    run = write_run(h.runs, "live", [{"event": "start", "max_steps": 8, "device": "cpu", "method": "lora"}, step(1, 2.5)])
    running = h.train_view("live")
    assert running[MESSAGE] == gr.skip()  # "Training started: live" stays while it trains
    with open(run / "events.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "done", "step": 8, "time": 3.0}) + "\n")
    busy.clear()
    ended = h.train_view("live", running[TABLE_STATE])
    assert "finished" in ended[STATUS] and ended[MESSAGE] == ""
    assert h.train_view("live", ended[TABLE_STATE])[MESSAGE] == gr.skip()  # a later message (a refusal) is left alone


def test_a_plan_that_does_not_fit_warns_once(tmp_path):
    """Next (plan_if_empty) plans and warns; opening the Plan tab again finds the closest recipe in
    the editor and plans nothing more (with an empty editor it planned, and warned, again)."""
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    args = ("llama-2-7b", "1GB", SAMPLE, 0, 0, "auto", "auto")
    editor = ""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _opened in range(2):  # Next, then the Plan tab opened again
            out = h.plan_if_empty(editor, *args)
            editor = out[4] if isinstance(out[4], str) else editor  # what the page's editor holds afterwards
    assert [str(w.message) for w in seen if "Nothing fits" in str(w.message)] == ["Nothing fits this card; see the suggestions."]


def test_next_the_plan_plans_once(tmp_path):
    """"Next: the plan" opens the Plan tab, whose select event plans an empty editor: the button
    itself plans nothing (it did, so one click made two plans and two "Nothing fits" toasts)."""
    from ui.app import build_app

    app = build_app(tmp_path / "runs", tmp_path / "uploads")
    next_btn = next(b for b in app.blocks.values() if isinstance(b, gr.Button) and b.value == "Next: the plan →")
    plan_tab = next(b for b in app.blocks.values() if isinstance(b, gr.Tab) and b.label == "3 · Plan")
    planners = [f for f in app.fns.values() if getattr(f.fn, "__name__", "") in ("plan_if_empty", "on_plan")]
    triggers = [t for f in planners for t in f.targets]
    assert (next_btn._id, "click") not in triggers
    assert triggers.count((plan_tab._id, "select")) == 1

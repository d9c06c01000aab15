"""The plan says what a small model will learn (issue 24, item 1): the demo model only knows its own
corpus, so "expect the model to pick up their format and style" must not be said of it; a ~100M
instruction model gets what the measurement on SmolLM2-135M-Instruct showed."""

from __future__ import annotations

from pathlib import Path

from finetuner.model.shapes import resolve_shape
from finetuner.planning.expectations import SMALL_PARAMS, TOY_PARAMS, expectation
from finetuner.planning.planner import plan

from tests.conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_model"


def test_the_demo_model_is_planned_as_a_toy_that_will_not_answer_questions():
    p = plan(str(DEMO), "cpu", data=str(REPO / "data" / "qa_sample.csv"))
    notes = " ".join(p.notes)
    assert "toy model" in notes and "will not answer your questions" in notes and "smollm2-135m-instruct" in notes
    assert "pick up their format and style" not in notes  # untrue of a model that knows only its corpus
    assert "small data set" in notes  # the general advice stays


def test_a_100m_instruction_model_gets_what_was_measured():
    shape = resolve_shape("smollm2-135m-instruct")
    assert TOY_PARAMS <= shape.num_params == 134_515_008 < SMALL_PARAMS
    p = plan("smollm2-135m-instruct", "cpu")
    note = next(n for n in p.notes if n.startswith("smollm2-135m-instruct has 135M parameters"))
    assert "60 s on 2 idle CPU cores, 18 s of it training" in note and "signed" in note and "fluent" in note
    assert "11 of 13" in note
    assert "toy" not in note
    assert "2 CPU cores" not in expectation(shape, "cuda")  # the wall time is the CPU's


def test_a_7b_model_gets_no_small_model_note():
    assert expectation(resolve_shape("llama-2-7b"), "cuda") is None
    p = plan("llama-2-7b", "rtx4090", seq_len=2048)
    assert not any("parameters: a toy model" in n or "Measured on SmolLM2" in n for n in p.notes)


def test_the_cli_plan_prints_the_toy_note():
    r = run_cli("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", "data/qa_sample.csv")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "will not answer your questions" in text and "pick up their format and style" not in text


def test_the_measured_note_says_what_docs_cpu_walkthrough_json_measured():
    """The note's figures are the benchmark's (scripts/bench/cpu_walkthrough.py): rerun it, update both."""
    import json
    m = json.loads((REPO / "docs" / "cpu_walkthrough.json").read_text(encoding="utf-8"))
    note = expectation(resolve_shape("smollm2-135m-instruct"), "cpu")
    assert f"{round(m['run']['command_s'])} s on 2 idle CPU cores" in note and m["machine"]["load_avg_1min_at_end"] < 2
    assert f"{round(m['run']['train_seconds'])} s of it training" in note
    assert f"held-out loss {m['held_out']['base_loss']:.2f} to {m['held_out']['fine_tuned_loss']:.2f}" in note
    assert f"{m['style']['fine_tuned_with_marker']} of {m['style']['held_out_prompts']} answers" in note
    assert f"{m['general']['fine_tuned_correct']} of {m['general']['examples']} general questions" in note

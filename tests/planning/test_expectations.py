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
    assert "28 min on 2 CPU cores" in note and "signed" in note and "fluent" in note and "11 of 13" in note
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

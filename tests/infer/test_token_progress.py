"""A generation's tokens counted into the open phase at each decoding step (finetuner.token_progress): a batch's count
moves before its answers are done, the rows that have ended are not counted, and a streamed generation (its
``generate`` in another thread) counts into the phase its caller opened."""

from __future__ import annotations

import pytest

from finetuner import phases
from finetuner.token_progress import counted


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    from finetuner.infer.chat import load_chat_model

    return load_chat_model(tiny_model_dir, device="cpu")


QUESTIONS = ["what should i bring", "the sea and the rain", "map", "boots for the trail in the cold wind"]


def test_a_batched_generation_says_its_tokens_before_its_answers(chat):
    """The replay's and the probe's call: four questions in one generate call. Its answers are counted when the
    call returns; its tokens step by step before that, four a step while every row answers."""
    said = []
    with phases.Phase("replay", said.append, total=len(QUESTIONS), unit="answers", every_s=0.0, heartbeat_s=None) as p:
        replies = chat.greedy_replies([[{"role": "user", "content": q}] for q in QUESTIONS], adapter=False,
                                      max_new_tokens=12, batch=len(QUESTIONS))
    assert len(replies) == len(QUESTIONS)
    during = [r for r in said if r["state"] == "progress" and r["done"] == 0]  # inside the one generate call
    tokens = [r["tokens"] for r in during]
    assert len(during) >= 2 and tokens[0] == len(QUESTIONS)  # the first step: a token for each row
    steps = [b - a for a, b in zip([0] + tokens, tokens)]
    assert all(1 <= n <= len(QUESTIONS) for n in steps) and steps == sorted(steps, reverse=True)  # rows only end
    assert len(during) <= 12 and p.tokens == tokens[-1] <= 12 * len(QUESTIONS)
    assert said[-1]["state"] == "end" and said[-1]["tokens"] == p.tokens and said[-1]["done"] == len(QUESTIONS)


def test_a_row_that_has_ended_is_not_counted(tiny_model_dir):
    """Each row counts its tokens up to and including its stop token: a token row 0 makes early is made the stop,
    so row 0 ends first and the others go on (or end where they make it too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok.padding_side = "left"
    enc = tok(QUESTIONS, return_tensors="pt", padding=True)
    width, new = enc["input_ids"].shape[1], 10
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        free = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)[:, width:]
    stop = int(free[0, 3])
    want = [next((i + 1 for i, t in enumerate(row.tolist()) if t == stop), new) for row in free]
    assert want[0] <= 4 < new  # row 0 ends early: the count must leave it out after that

    said = []
    with phases.Phase("eval", said.append, every_s=0.0, heartbeat_s=None) as p, torch.no_grad():
        model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=stop,
                       stopping_criteria=counted(stop))
        assert p.tokens == sum(want)
    per_step = [r["tokens"] for r in said if r["state"] == "progress"]
    assert per_step == [sum(min(n, k) for n in want) for k in range(1, max(want) + 1)]


def test_a_streamed_reply_counts_into_its_callers_phase(chat):
    """The tool calls' scores ask one reply at a time through ChatModel.stream, whose generate runs in a thread
    of its own: its tokens reach the phase the caller's thread opened. Outside a phase nothing is counted."""
    said = []
    with phases.Phase("tool_calls", said.append, total=1, unit="answers", every_s=0.0, heartbeat_s=None) as p:
        chat.reply([{"role": "user", "content": QUESTIONS[0]}], temperature=0, max_new_tokens=6)
        assert 1 <= p.tokens <= 6
    assert [r["tokens"] for r in said if r["state"] == "progress"] == list(range(1, p.tokens + 1))
    assert len(counted([0, 1])) == 0 and phases.current() is None

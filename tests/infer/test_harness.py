"""Issue 38, part 1: `finetuner eval RUN --tasks` runs lm-evaluation-harness on the base and the fine-tune (one model
loaded, its adapter switched off and on), here on a task of local data (nothing downloaded); the scores equal the
log-likelihoods computed here without the harness."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, cli_in_process, demo_run_folder

#: multiple-choice questions in the demo model's world (its corpus: birds and walks)
ITEMS = [
    ("Which bird carries fish crosswise in its bill?", ["The puffin", "The cow", "The lorry"], 0),
    ("How many days are in a week?", ["Five", "Seven", "Ten"], 1),
    ("What should you pack for a long walk?", ["A piano", "A fridge", "Water and a hat"], 2),
    ("Where do puffins nest?", ["In burrows on cliffs", "In cars", "Under the sea"], 0),
    ("What do you wear in the rain?", ["A sun hat", "A waterproof jacket", "Nothing"], 1),
    ("Which animal has feathers?", ["A fish", "A dog", "A gull"], 2),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    (d / "items.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                           for q, c, a in ITEMS), encoding="utf-8")
    (d / "walks_mc.yaml").write_text(f"""task: walks_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'items.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder of the demo model with a LoRA adapter of random effect (and an event log: a run's, so the
    result is kept in its metrics.json)."""
    run = demo_run_folder(tmp_path_factory.mktemp("runs"), "harness", adapter=True)
    (run / "events.jsonl").write_text("", encoding="utf-8")
    return run


def reference_acc(run) -> tuple[float, float]:
    """What the task's accuracy is, computed here: each choice scored by the sum of its tokens' log-probabilities
    after the question (the harness's multiple-choice rule: context ``Question: ...\\nAnswer:``, continuation
    `` <choice>``, the continuation's tokens those of the whole text past the context's), base and fine-tune."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "demo_model")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(REPO / "data" / "demo_model"), run / "adapter").eval()

    def score(context: str, continuation: str) -> float:
        whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
        n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
        ids = torch.tensor([whole])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        return sum(float(logp[i - 1, whole[i]]) for i in range(n_ctx, len(whole)))

    def acc() -> float:
        right = 0
        for q, choices, answer in ITEMS:
            scores = [score(f"Question: {q}\nAnswer:", " " + c) for c in choices]
            right += max(range(len(choices)), key=scores.__getitem__) == answer
        return right / len(ITEMS)

    with model.disable_adapter():
        base = acc()
    return base, acc()


def test_eval_tasks_scores_the_base_and_the_fine_tune_as_computed_by_hand(run, task_dir):
    out = cli_in_process("eval", str(run), "--tasks", "walks_mc", "--include-path", str(task_dir), cwd=REPO)
    assert out.returncode == 0, out.stderr
    stored = json.loads((run / "metrics.json").read_text(encoding="utf-8"))["harness"]
    (task,) = stored["tasks"]
    assert task["task"] == "walks_mc" and task["samples"] == len(ITEMS)
    base, tuned = reference_acc(run)
    assert base != tuned  # the adapter changes an answer here: the harness saw it switched off, then on
    assert (task["base"]["acc"], task["fine_tuned"]["acc"]) == pytest.approx((base, tuned), abs=1e-9)
    assert f"walks_mc                 acc              {base:>8.4f} {tuned:>11.4f} {tuned - base:>+8.4f}" in out.stdout
    assert "lm-evaluation-harness 0.4" in out.stdout and "(key 'harness')" in out.stdout
    limited = cli_in_process("eval", str(run), "--tasks", "walks_mc", "--include-path", str(task_dir), "--limit", "2",
                             "--json", "--no-write", cwd=REPO)
    assert json.loads(limited.stdout)["tasks"][0]["samples"] == 2


@pytest.mark.parametrize("args,message", [
    (["--tasks", "no_such_task_x"], "error: --tasks: lm-evaluation-harness knows no task no_such_task_x."),
    (["--tasks", "walks_mc", "--include-path", "/nonexistent/tasks"], "error: --include-path /nonexistent/tasks: not a folder."),
    (["--tasks", "walks_mc", "--general"], "error: eval: --general and --tasks are two runs; give one of them."),
    (["--num-fewshot", "2"], "error: eval: --num-fewshot goes with --tasks."),
])
def test_bad_task_arguments_get_one_line(run, args, message):
    out = cli_in_process("eval", str(run), *args, "--no-write", cwd=REPO)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr


def test_a_task_whose_data_is_missing_names_the_task(run, tmp_path):
    (tmp_path / "lost.yaml").write_text(f"""task: lost_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'gone.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
""", encoding="utf-8")
    out = cli_in_process("eval", str(run), "--tasks", "lost_mc", "--include-path", str(tmp_path), "--no-write", cwd=REPO)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "error: --tasks lost_mc: could not load the task's data" in out.stderr


def test_without_the_harness_installed_the_error_says_how_to_get_it(run, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    out = cli_in_process("eval", str(run), "--tasks", "arc_easy", "--no-write", cwd=REPO)
    assert out.returncode != 0
    assert "error: --tasks runs lm-evaluation-harness, which is not installed." in out.stderr and "pip install lm_eval" in out.stderr

"""Issue 38, part 1: `finetuner eval RUN --tasks` runs lm-evaluation-harness on the base and the fine-tune (one model
loaded, its adapter switched off and on), here on a task of local data (nothing downloaded); the scores equal the
log-likelihoods computed here without the harness.

Issue 54, case 1: a task folder (``--include-path``) is code where its YAMLs say so: refused in one line, nothing of
it imported, unless ``--trust-remote-code``; its templates render in jinja2's sandbox; a folder task never replaces
one of the harness's own tasks, groups or tags unless ``--replace-builtin-tasks``."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, cli_in_process, demo_run_folder, run_cli

#: multiple-choice questions in the demo model's world (its corpus: birds and walks)
ITEMS = [
    ("Which bird carries fish crosswise in its bill?", ["The puffin", "The cow", "The lorry"], 0),
    ("How many days are in a week?", ["Five", "Seven", "Ten"], 1),
    ("What should you pack for a long walk?", ["A piano", "A fridge", "Water and a hat"], 2),
    ("Where do puffins nest?", ["In burrows on cliffs", "In cars", "Under the sea"], 0),
    ("What do you wear in the rain?", ["A sun hat", "A waterproof jacket", "Nothing"], 1),
    ("Which animal has feathers?", ["A fish", "A dog", "A gull"], 2),
]


def write_task(d, name: str, extra: str = "", file: str | None = None,
               doc_to_text: str = "Question: {{question}}\\nAnswer:", metric: str = "acc"):
    """A multiple-choice task of :data:`ITEMS` (local data: nothing downloaded) in ``d/<file or name>.yaml``,
    with ``extra`` YAML lines added."""
    (d / "items.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                           for q, c, a in ITEMS), encoding="utf-8")
    (d / f"{file or name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'items.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{doc_to_text}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
{extra}""", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("tasks"), "walks_mc")


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
    (["--replace-builtin-tasks"], "error: eval: --replace-builtin-tasks goes with --tasks."),
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


#: the refusal's end, whatever the folder runs
TRUST = "; add --trust-remote-code if you trust the folder (Python: trust_remote_code=True)."


def evil_folder(d):
    """A real task folder whose YAML runs its ``utils.py``: the module leaves a marker file when imported, and its
    ``process_docs`` keeps the first 4 of the 6 documents (so a run shows the function ran)."""
    write_task(d, "evil_mc", extra="process_docs: !function utils.process_docs\n")
    (d / "utils.py").write_text("from pathlib import Path\n"
                                "Path(__file__).with_name('imported.marker').write_text('utils.py ran')\n\n\n"
                                "def process_docs(dataset):\n    return dataset.select(range(4))\n", encoding="utf-8")
    return d


def test_a_task_folder_that_runs_code_is_refused_until_trusted(run, tmp_path):
    d = evil_folder(tmp_path)
    refused = cli_in_process("eval", str(run), "--tasks", "evil_mc", "--include-path", str(d), "--no-write", cwd=REPO)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert (f"error: {d}/evil_mc.yaml: process_docs: !function utils.process_docs runs {d}/utils.py{TRUST}"
            in refused.stderr.splitlines())
    assert not (d / "imported.marker").exists()  # nothing of the folder was imported
    trusted = cli_in_process("eval", str(run), "--tasks", "evil_mc", "--include-path", str(d), "--trust-remote-code",
                             "--json", "--no-write", cwd=REPO)
    assert trusted.returncode == 0, trusted.stderr
    assert (d / "imported.marker").read_text(encoding="utf-8") == "utils.py ran"
    assert json.loads(trusted.stdout)["tasks"][0]["samples"] == 4  # the folder's process_docs chose the documents


def test_the_refusal_is_one_line_and_exit_2_as_the_user_runs_it(run, tmp_path):
    d = evil_folder(tmp_path)
    p = run_cli("eval", str(run), "--tasks", "evil_mc", "--include-path", str(d), "--no-write")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert [line for line in p.stderr.splitlines() if "error" in line.lower()] == [
        f"error: {d}/evil_mc.yaml: process_docs: !function utils.process_docs runs {d}/utils.py{TRUST}"]
    assert not (d / "imported.marker").exists()


@pytest.mark.parametrize("extra,files,metric,said", [
    ("include: common.yml\n", {"common.yml": "process_results: !function scoring.score\n", "scoring.py": ""}, "acc",
     "{d}/common.yml: process_results: !function scoring.score runs {d}/scoring.py"),
    ("process_docs: !function utils.process_docs\nprocess_docs: null\n", {"utils.py": ""}, "acc",
     "{d}/t.yaml: process_docs: !function utils.process_docs runs {d}/utils.py"),  # the harness imports it all the same
    ("class: !function custom.MyTask\n", {"custom.py": ""}, "acc", "{d}/t.yaml: class: !function custom.MyTask runs {d}/custom.py"),
    ("filter_list:\n  - name: picked\n    filter:\n      - function: custom\n        filter_fn: !function re.escape\n", {}, "acc",
     "{d}/t.yaml: filter_list[0].filter[0].filter_fn: !function re.escape imports the Python module re"),
    ("", {}, "rouge", "{d}/t.yaml: metric_list[0].metric: rouge is loaded by Hugging Face evaluate, which runs the "
                      "metric's Python script"),
    ("", {}, "exact_match\n    hf_evaluate: true", "{d}/t.yaml: metric_list[0].metric: exact_match is loaded by Hugging "
                                                  "Face evaluate, which runs the metric's Python script"),
    ("process_results: !!python/name:os.system\n", {}, "acc", "{d}/t.yaml: process_results: !!python/name:os.system builds a "
                                                             "Python object"),
], ids=["include", "key_twice", "class", "filter", "metric", "hf_evaluate", "python_tag"])
def test_each_way_a_task_yaml_runs_code_is_named(run, tmp_path, extra, files, metric, said):
    write_task(tmp_path, "t_mc", extra=extra, file="t", metric=metric)
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    out = cli_in_process("eval", str(run), "--tasks", "t_mc", "--include-path", str(tmp_path), "--no-write", cwd=REPO)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: {said.format(d=tmp_path)}{TRUST}" in out.stderr.splitlines()


def test_a_yaml_of_the_harness_itself_included_by_a_folder_is_not_the_folder_s_code(tmp_path):
    from finetuner.infer.task_folder import builtin_task_dir, code_uses

    hellaswag = builtin_task_dir() / "hellaswag" / "hellaswag.yaml"
    assert "process_docs: !function utils.process_docs" in hellaswag.read_text(encoding="utf-8")
    (tmp_path / "mine.yaml").write_text(f"include: {hellaswag}\ntask: my_hellaswag\n", encoding="utf-8")
    assert code_uses(tmp_path) == []  # the installed harness's code, run for its own hellaswag anyway
    (tmp_path / "mine.yaml").write_text(f"include: {hellaswag}\ntask: my_hellaswag\nprocess_docs: !function utils.own\n",
                                        encoding="utf-8")
    assert [str(u) for u in code_uses(tmp_path)] == [
        f"{tmp_path}/mine.yaml: process_docs: !function utils.own imports the Python module utils"]


def test_templates_render_in_jinja2s_sandbox_while_it_lasts():
    from jinja2.exceptions import SecurityError
    from lm_eval.utils import apply_template

    from finetuner.infer.task_folder import sandboxed_templates

    reach = "{{ ''.__class__.__mro__ }}"
    assert "<class 'object'>" in apply_template(reach, {})  # the harness's own Environment reaches Python's objects
    with sandboxed_templates():
        with pytest.raises(SecurityError):
            apply_template(reach, {})
        # arc_easy's target template and the harness's own filter still render
        doc = {"choices": {"label": ["A", "B"]}, "answerKey": "B", "question": "Why?"}
        assert apply_template("{{choices.label.index(answerKey)}} {{question|regex_replace('y', 'o')}}", doc) == "1 Who?"
    assert "<class 'object'>" in apply_template(reach, {})  # put back


def test_a_template_that_reaches_for_python_objects_is_refused(run, tmp_path):
    write_task(tmp_path, "reach_mc", doc_to_text="{{ ''.__class__.__mro__ }} {{question}}")
    out = cli_in_process("eval", str(run), "--tasks", "reach_mc", "--include-path", str(tmp_path), "--no-write", cwd=REPO)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (f"error: --tasks reach_mc: a template in {tmp_path} reached for Python's internals (access to attribute "
            f"'__class__' of 'str' object is unsafe.){TRUST}") in out.stderr.splitlines()


def test_a_folder_task_named_like_one_of_the_harness_s_own_is_refused_unless_asked(run, tmp_path):
    write_task(tmp_path, "arc_easy", file="arc")  # the case: `task: arc_easy` replaced the benchmark
    write_task(tmp_path, "walks_tagged", extra="tag: ai2_arc\n")  # and a tag of the harness's own
    refused = cli_in_process("eval", str(run), "--tasks", "arc_easy", "--include-path", str(tmp_path), "--no-write",
                             cwd=REPO)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert (f"error: {tmp_path}/walks_tagged.yaml: tag: ai2_arc would replace lm-evaluation-harness's own tag ai2_arc "
            "(and arc_easy); rename it, or add --replace-builtin-tasks to run the folder's instead (Python: "
            "replace_builtin_tasks=True).") in refused.stderr.splitlines()
    asked = cli_in_process("eval", str(run), "--tasks", "arc_easy", "--include-path", str(tmp_path),
                           "--replace-builtin-tasks", "--json", "--no-write", cwd=REPO)
    assert asked.returncode == 0, asked.stderr
    (task,) = json.loads(asked.stdout)["tasks"]
    assert task["task"] == "arc_easy" and task["samples"] == len(ITEMS)  # the folder's 6 questions, as asked
    assert (task["base"]["acc"], task["fine_tuned"]["acc"]) == pytest.approx(reference_acc(run), abs=1e-9)

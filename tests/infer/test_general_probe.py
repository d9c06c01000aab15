"""Issue 38, part 1 on demand: `finetuner eval RUN --general` answers the shipped general probe set with the base
model and the fine-tune and says what the fine-tune kept, scored without a judge model."""

from __future__ import annotations

import json
import re

import pytest

from finetuner.infer.probe import PROBE_FILE, Probe, is_right, load_probes
from tests.conftest import REPO, cli_in_process


def test_the_shipped_probe_set_is_well_formed_and_what_its_script_writes():
    from scripts.dev import make_general_probe

    probes = load_probes()
    assert len(probes) == 120 and len({p.id for p in probes}) == 120
    assert {p.kind for p in probes} == {"fact", "arithmetic", "instruction"}
    assert PROBE_FILE.read_text(encoding="utf-8") == "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                            for r in make_general_probe.rows())
    for p in probes:  # every numeric answer is the sum, difference or product its question asks
        if p.match == "numeric":
            x, word, y = re.fullmatch(r"What is (\d+) (plus|minus|times) (\d+)\?", p.question).groups()
            assert int(p.answers[0]) == {"plus": int(x) + int(y), "minus": int(x) - int(y), "times": int(x) * int(y)}[word]


@pytest.mark.parametrize("answer,right", [
    ("The capital of France is Paris.", True), ("paris", True), ("Parisian food is good.", False), ("Lyon", False),
])
def test_contains_means_a_whole_word_in_any_case(answer, right):
    assert is_right(answer, Probe("f", "fact", "?", ("Paris",))) is right


@pytest.mark.parametrize("answer,right", [
    ("The symbol for gold is Au.", True), ("au", False), ("A is the first letter.", True), ("It is a letter.", False),
])
def test_a_cased_answer_must_match_its_case(answer, right):
    probe = Probe("f", "fact", "?", ("Au",) if "old" in answer or answer == "au" else ("A",), case=True)
    assert is_right(answer, probe) is right


@pytest.mark.parametrize("answer,right", [("42", True), ("It is 42.", True), ("It is 4,200 or 42", False),
                                          ("forty-two", False), ("-3 is the answer", False)])
def test_numeric_means_the_first_number(answer, right):
    assert is_right(answer, Probe("a", "arithmetic", "?", ("42",), "numeric")) is right


def test_a_bad_probe_file_names_its_row(tmp_path):
    from finetuner.errors import UserError

    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "a", "question": "?", "answers": ["x"]}\n{"id": "b", "question": "?"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"p.jsonl, row 2: not a probe \(KeyError"):
        load_probes(bad)


def test_eval_general_on_the_demo_says_what_the_fine_tune_kept(demo_run, tmp_path):
    import shutil

    run = tmp_path / "demo_cpu"
    shutil.copytree(demo_run, run)  # the shared run is only read; metrics.json is written here
    out = cli_in_process("eval", str(run), "--general", "--limit", "12", cwd=REPO)
    assert out.returncode == 0, out.stderr
    head = re.search(r"general probe \(12 questions, general_probe.jsonl\): the base answers (\d+), the fine-tune (\d+); "
                     r"kept (\d+) of the base's (\d+)", out.stdout)
    assert head, out.stdout
    stored = json.loads((run / "metrics.json").read_text(encoding="utf-8"))["general_probe"]
    assert (stored["base_right"], stored["fine_tuned_right"], stored["kept"]) == tuple(int(g) for g in head.groups()[:3])
    assert stored["kept"] <= stored["base_right"] and stored["questions"] == 12 and "answers" not in stored
    again = cli_in_process("eval", str(run), "--general", "--limit", "12", "--json", "--no-write", cwd=REPO)
    r = json.loads(again.stdout)
    assert r["kept"] == stored["kept"] and len(r["answers"]) == 12  # greedy: the same answers again
    assert r["lost"] == [a["id"] for a in r["answers"] if a["base_right"] and not a["fine_tuned_right"]]


def test_merge_and_export_say_what_the_run_forgot_before_it_ships(demo_run, tmp_path):
    """Part 5: no block, a line: the stored probe result (a warning under 80 % kept), or how to measure it."""
    import shutil

    import finetuner
    from finetuner.infer.probe import kept_note

    run = tmp_path / "demo_cpu"
    shutil.copytree(demo_run, run)
    assert kept_note(run) == f"what the fine-tune forgot is not measured: `finetuner eval {run} --general` says it"
    metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    metrics["general_probe"] = {"base_right": 10, "kept": 7, "lost": ["fact-001", "fact-013", "arithmetic-004"]}
    (run / "metrics.json").write_text(json.dumps(metrics), encoding="utf-8")
    r = finetuner.merge_adapter(run, tmp_path / "merged", verify=False)
    assert ("warning: general probe: the fine-tune kept 7 of the base's 10 right answers (70%), under 80%: it forgot "
            "general answers the base knew (lost: fact-001, fact-013, arithmetic-004)") in r.notes[-1]
    out = cli_in_process("export", str(run), "--format", "gguf", "--quant", "f16", "-o", str(tmp_path / "m.gguf"),
                         "--no-verify", cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "note        warning: general probe: the fine-tune kept 7 of the base's 10" in out.stdout

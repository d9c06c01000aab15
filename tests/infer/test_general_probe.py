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
    # said in words a first-time user reads: what was asked, what the base knew, what is still right after training
    head = re.search(r"general knowledge check: of 12 general questions, the base model answered (\d+) right; after "
                     r"training, (\d+) of those are still right \((\d+) forgotten.*\); the fine-tune answers (\d+) of the "
                     r"12 right in all \(general_probe.jsonl\)", " ".join(out.stdout.split()))
    assert head, out.stdout
    stored = json.loads((run / "metrics.json").read_text(encoding="utf-8"))["general_probe"]
    base, kept, forgot, tuned = (int(g) for g in head.groups())
    assert (stored["base_right"], stored["kept"], stored["fine_tuned_right"]) == (base, kept, tuned)
    assert forgot == base - kept == len(stored["lost"])
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
    assert ("warning: general knowledge check: of the general questions it asks, the base model answered 10 right; "
            "after training, 7 of those are still right (3 forgotten: fact-001, fact-013, arithmetic-004), 70% kept, "
            "under 80%: it forgot general answers the base knew") in r.notes[-1]
    out = cli_in_process("export", str(run), "--format", "gguf", "--quant", "f16", "-o", str(tmp_path / "m.gguf"),
                         "--no-verify", cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "note warning: general knowledge check: of the general questions it asks, the base model answered 10 right" \
        in " ".join(out.stdout.split())


def test_every_run_ends_with_the_probe_and_says_what_it_kept(tmp_path, monkeypatch):
    """Part 1 at the end of a run: the trainer's model in memory answers `training.general_probe` questions with its
    adapter off and on; metrics.json, the done event, the CLI summary, `finetuner status` and the UI's notes carry
    "kept N of M". The probe file here accepts the base model's own answers, so the base is right on all of them
    and what the fine-tune kept is measured against it."""
    import finetuner
    import finetuner.infer.probe as probe
    from finetuner.config.recipe import Recipe
    from finetuner.infer.chat import load_chat_model
    from finetuner.runs.events import read_events
    from finetuner.runs.jobs import run_status
    from finetuner.run_handle import load_run
    from tests.conftest import alpaca_rows

    demo = REPO / "data" / "demo_model"  # it answers in words (of its corpus): a random model says nothing
    questions = ["What is the capital of France?", "What should I pack for a day hike?", "What is 2 plus 3?", "Say hello."]
    base = load_chat_model(demo, device="cpu")
    rows = [{"id": f"q{i}", "kind": "fact", "question": q, "answers": [a], "match": "contains"}
            for i, (q, a) in enumerate((q, base.reply([{"role": "user", "content": q}], max_new_tokens=probe.MAX_NEW_TOKENS,
                                                       temperature=0.0)) for q in questions) if a.strip()]
    assert rows, "the demo model answered nothing"
    probes = tmp_path / "probes.jsonl"
    probes.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    monkeypatch.setattr(probe, "PROBE_FILE", probes)
    data = tmp_path / "d.json"
    data.write_text(json.dumps(alpaca_rows(16)), encoding="utf-8")
    raw = {"name": "p", "model": {"name": str(demo)}, "device": "cpu", "output_dir": str(tmp_path / "run"),
           "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "data": {"path": str(data), "max_seq_len": 64, "val_size": 0},
           "training": {"max_steps": 3, "micro_batch_size": 2, "gradient_accumulation": 1, "lr": 5e-3,
                        "general_probe": len(rows)}}
    result = finetuner.train(Recipe.from_dict(raw))
    stored = result.metrics["general_probe"]
    assert stored["questions"] == stored["base_right"] == len(rows)  # the adapter switched off: the base's answers
    assert stored["kept"] == stored["fine_tuned_right"] and len(stored["lost"]) == len(rows) - stored["kept"]
    on_disk = json.loads((result.run_dir / "metrics.json").read_text(encoding="utf-8"))["general_probe"]
    assert on_disk == stored and "answers" not in on_disk
    done = [e for e in read_events(result.run_dir / "events.jsonl") if e["event"] == "done"][0]
    assert done["metrics"]["general_probe"] == stored
    line = probe.kept_line(stored)
    assert line.startswith(f"general knowledge check: of {len(rows)} general questions, the base model answered "
                           f"{len(rows)} right; after training, {stored['kept']} of those are still right "
                           f"({len(rows) - stored['kept']} forgotten")
    assert ("kept", line) in load_run(result.run_dir)._rows()
    assert line in run_status(result.run_dir, runs_dir=tmp_path).notes  # the UI's Train tab shows these notes
    raw["training"]["general_probe"] = 0  # asked for none: no probe, no key
    raw["output_dir"] = str(tmp_path / "run0")
    assert "general_probe" not in finetuner.train(Recipe.from_dict(raw)).metrics


def test_the_number_of_probes_a_run_answers(monkeypatch):
    from finetuner.errors import UserError
    from finetuner.infer.probe import DEFAULT_RUN_PROBES, RUN_PROBES_ENV, run_probe_count

    from finetuner.infer.probe import DEFAULT_CPU_RUN_PROBES, load_probes, spread

    monkeypatch.delenv(RUN_PROBES_ENV, raising=False)
    assert run_probe_count(None) == DEFAULT_RUN_PROBES == 40 and run_probe_count(7) == 7 and run_probe_count(0) == 0
    assert run_probe_count(None, cuda=False) == DEFAULT_CPU_RUN_PROBES == 16 and run_probe_count(5, cuda=False) == 5
    chosen = spread(load_probes(), 16)  # every kind of question, not the first kind alone
    assert len(chosen) == len({p.id for p in chosen}) == 16 and {p.kind for p in chosen} == {"fact", "arithmetic", "instruction"}
    assert spread([1, 2, 3], None) == spread([1, 2, 3], 5) == [1, 2, 3] and spread(list(range(10)), 2) == [0, 5]
    monkeypatch.setenv(RUN_PROBES_ENV, "12")
    assert run_probe_count(None) == 12 and run_probe_count(3) == 3
    monkeypatch.setenv(RUN_PROBES_ENV, "lots")
    with pytest.raises(UserError, match="FINETUNER_GENERAL_PROBE='lots'"):
        run_probe_count(None)

"""The phases of the commands outside a run (merge, export, eval) said with their counts (finetuner.phases): to the
caller in this process, through the export worker's protocol, and on the CLI's stderr (its --json stdout clean)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import finetuner.worker_protocol as protocol
from finetuner import phases
from tests.conftest import REPO, cli_in_process, demo_run_folder


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The demo model with a real LoRA adapter (no training: the merge and the export read only the adapter)."""
    return demo_run_folder(tmp_path_factory.mktemp("phases") / "runs", adapter=True)


def said(records: list[dict]) -> dict[str, list[dict]]:
    """The records by phase (its name, or its label where a name comes twice: the merge's check and the GGUF's),
    each phase's in order; every phase opened once, started and ended, its counts never above its total and never
    going back."""
    by: dict[str, list[dict]] = {}
    for rec in records:
        key = rec["phase"] if rec["label"] == phases.PHASES[rec["phase"]] else rec["label"]
        by.setdefault(key, []).append(rec)
    for name, recs in by.items():
        assert [r["state"] for r in recs][0] == "start" and recs[-1]["state"] == "end", (name, recs)
        assert [r for r in recs if r["state"] == "start"] == [recs[0]], (name, recs)  # no phase opened twice
        done = [r["done"] for r in recs]
        assert done == sorted(done), (name, done)
        assert all(r["total"] is None or r["done"] <= r["total"] for r in recs), (name, recs)
        assert all(phases.line(r).startswith(r["label"] + ":") for r in recs)
    return by


def test_a_merge_says_its_phases_and_counts_the_shards_it_wrote(run, tmp_path):
    from finetuner.export.merge import merge_adapter

    records: list[dict] = []
    with phases.reporting(records.append):
        r = merge_adapter(run, tmp_path / "merged", shard_size="100KB")
    by = said(records)
    assert list(by) == ["load", "merge", "write", "verify"]  # in the order the merge meets them
    assert r.shards > 1 and by["write"][-1]["done"] == by["write"][-1]["total"] == r.shards
    assert by["write"][-1]["unit"] == "shards"
    config = json.loads((run / "adapter" / "adapter_config.json").read_text(encoding="utf-8"))
    layers = json.loads((tmp_path / "merged" / "config.json").read_text(encoding="utf-8"))["num_hidden_layers"]
    assert by["merge"][-1]["done"] == len(config["target_modules"]) * layers  # each adapted layer merged
    assert phases.line(by["write"][-1]).startswith(f"writing the model files: done, {r.shards} shards in ")
    quiet: list[dict] = []
    merge_adapter(run, tmp_path / "again", shard_size="100KB")  # without reporting: the records go nowhere
    assert quiet == [] and phases.current() is None


def test_an_export_counts_the_tensors_it_wrote_and_read_back(run, tmp_path):
    from finetuner.export.gguf import export_model

    records: list[dict] = []
    with phases.reporting(records.append):
        r = export_model(run, tmp_path / "demo.gguf", quant="q8_0")
    by = said(records)
    assert list(by) == ["load", "merge", "write", "verify", "export", "readback",  # the merge's, then the file's
                        "checking the GGUF file with transformers' loader"]
    for name in ("export", "readback"):
        assert by[name][-1]["done"] == by[name][-1]["total"] == r.tensors and by[name][-1]["unit"] == "tensors"


def test_the_worker_sends_its_phases_before_its_answer(run, tmp_path):
    """A real merge in the export worker (the web UI's way): the phase records come through the protocol as they
    are said, the shards' count among them, and then the result."""
    from finetuner.export.worker import merge_job

    job = merge_job(run, tmp_path / "merged", shard_size="100KB")
    records = list(job)
    assert job.result is not None and job.result["output_dir"] == str(tmp_path / "merged")
    by = said(records)
    assert by["write"][-1]["done"] == job.result["shards"] > 1
    sent = protocol.decode(protocol.encode(protocol.message("phase", **records[0])))
    assert sent == {"kind": "phase", **records[0]}  # a phase message is one the caller reads


def test_the_cli_says_the_phases_on_stderr_and_keeps_json_on_stdout_clean(run, tmp_path, monkeypatch):
    """Off a terminal a phase's line comes once it has run PhasePrinter.QUIET_S seconds, and its end line after one:
    at 0 s, every phase that said its last item (a phase of one call ends before it says anything)."""
    from finetuner.cli.progress import PhasePrinter

    monkeypatch.setattr(PhasePrinter, "QUIET_S", 0.0)
    p = cli_in_process("export", str(run), "-o", str(tmp_path / "demo.gguf"), "--quant", "q8_0", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)  # stdout is the one JSON object
    n = r["tensors"]
    assert f"writing the GGUF file: {n}/{n} tensors, " in p.stderr, p.stderr
    assert f"writing the GGUF file: done, {n} tensors in " in p.stderr
    assert f"reading the GGUF file back: done, {n} tensors in " in p.stderr
    p = cli_in_process("eval", str(run), "--data", str(REPO / "data" / "alpaca_sample.json"), "--no-write", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    n = r["examples"]
    assert f"held-out loss of the fine-tune: done, {n:,} examples in " in p.stderr, p.stderr
    assert f"held-out loss of the base model: done, {n:,} examples in " in p.stderr


def test_an_evaluation_counts_its_examples_and_answers(run):
    from finetuner.infer.evaluate import evaluate_run

    records: list[dict] = []
    with phases.reporting(records.append):
        r = evaluate_run(run, data=REPO / "data" / "alpaca_sample.json", exact_match=2, write=False)
    ends = [(rec["label"], rec["done"]) for rec in records if rec["state"] == "end"]
    assert ends == [("loading the model", 0), ("held-out loss of the fine-tune", r.examples),
                    ("exact-match answers of the fine-tune", 2), ("held-out loss of the base model", r.examples),
                    ("exact-match answers of the base model", 2)]


def test_the_general_probe_counts_the_answers_of_both_models(run):
    from finetuner.infer.probe import probe_run

    records: list[dict] = []
    with phases.reporting(records.append):
        r = probe_run(run, limit=3)
    by = said(records)
    assert list(by) == ["load", "probe"]
    assert by["probe"][-1]["done"] == by["probe"][-1]["total"] == 2 * r.questions == 6  # the base's and the fine-tune's
    assert by["probe"][-1]["unit"] == "answers"

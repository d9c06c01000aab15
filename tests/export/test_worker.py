"""Merging in another process (``python -m finetuner.export.worker``): the caller gets the merge's
own result and its own ``UserError`` (message and hint as raised), and never loads the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetuner.errors import UserError
from finetuner.export import worker
from finetuner.export.merge import merge_adapter
from tests.conftest import demo_run_folder, HANG_GUARD_S


@pytest.fixture
def full_folder(tmp_path) -> Path:
    """An output folder that holds a file of the user's."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine", encoding="utf-8")
    return full


def test_the_worker_raises_the_merges_own_user_error(tmp_path, full_folder):
    run = demo_run_folder(tmp_path / "runs")
    with pytest.raises(UserError) as here:
        merge_adapter(run, full_folder)
    with pytest.raises(UserError) as there:
        worker.merge_in_subprocess(run, full_folder)
    assert (there.value.message, there.value.hint) == (here.value.message, here.value.hint)  # both parts, as raised
    assert "is not empty" in there.value.message and "empty that folder yourself" in there.value.hint
    assert [p.name for p in full_folder.iterdir()] == ["keep.txt"]  # nothing written


def test_the_worker_reports_a_bug_as_one_and_refuses_bad_requests(monkeypatch):
    from finetuner.export import merge

    def broken(**kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(merge, "merge_adapter", broken)
    assert worker.serve({"source": "a", "output_dir": "b"}) == {
        "kind": "error", "message": "ValueError: boom", "hint": None, "type": "ValueError", "user_error": False}
    assert worker.serve({"source": "a", "output_dir": "b", "dtpye": "fp32"})["user_error"] is False
    assert worker.serve(["a", "b"])["user_error"] is False
    proc = subprocess.run([sys.executable, "-m", "finetuner.export.worker"], input="not json", capture_output=True, text=True)
    answer = json.loads(proc.stdout)  # one line of JSON, even for a request it cannot read
    assert proc.returncode == 1 and answer["kind"] == "error" and not answer["user_error"] and "not JSON" in answer["message"]
    with pytest.raises(TypeError, match="dtpye"):
        worker.merge_in_subprocess("a", "b", dtpye="fp32")


def test_a_merge_in_another_process_returns_the_result_and_the_caller_never_loads_the_model(tmp_path):
    """A real merge through merge_in_subprocess, called from a fresh process that stands for the
    web UI: the result comes back whole (in the demo base's fp32, matching the adapter), and that
    process never imported torch, transformers or peft."""
    run = demo_run_folder(tmp_path / "runs", adapter=True)
    probe = (
        "import json, sys\n"
        "from finetuner.export.worker import merge_in_subprocess\n"
        f"r = merge_in_subprocess({str(run)!r}, {str(tmp_path / 'merged')!r})\n"
        "print(json.dumps({'result': r.to_dict(), 'loaded': sorted({'torch', 'transformers', 'peft'} & set(sys.modules))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [], out
    r = out["result"]
    assert r["output_dir"] == str(tmp_path / "merged") and r["dtype"] == "fp32" and r["shards"] >= 1
    assert r["max_abs_diff"] <= r["tolerance"] < r["adapter_effect"]
    assert (tmp_path / "merged" / "config.json").is_file() and "finetuner_merge.json" in r["files"]

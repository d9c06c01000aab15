"""The memory model against every GPU run recorded in docs/validation/, replayed on the CPU.

Each ``docs/validation/validate_*.json`` holds runs of ``scripts/validate/memory.py`` on an H100:
the recipe's settings and the measured ``max_memory_allocated`` / ``max_memory_reserved``. The
tests re-predict every run with the memory model as it is now, through the very functions that
print docs/memory.md's table (``scripts.validate.memory.replay`` / ``summary`` / ``report``), so
a change to the model that breaks the published claims fails here: no allocated peak predicted
below its measurement, the median allocated error under 5 %, and the table in docs/memory.md
equal to the replay. Pure arithmetic: no torch, well under a second.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from scripts.validate.memory import VALIDATION, replay, report, summary
from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
MEMORY_MD = REPO / "docs" / "memory.md"
#: the goal docs/memory.md states for the allocated peak
MEDIAN_GOAL_PCT = 5.0


def recorded_runs() -> int:
    return sum(len(json.loads(p.read_text())["results"]) for p in VALIDATION.glob("validate_*.json"))


def test_every_recorded_run_is_replayed():
    rows = replay()
    assert len(rows) == recorded_runs() >= 21
    failed = [f"{r['preset']} {r['config']}: {r['error'][-200:]}" for r in rows if "error" in r]
    assert not failed, f"a recorded GPU run failed (a measurement is missing): {failed}"
    assert {r["preset"] for r in rows} >= {"llama-2-7b", "llama-2-13b", "llama-3.1-8b"}


def test_the_measured_families_are_the_records():
    """What a plan says of a family's memory terms (measured on a GPU or not) follows docs/validation."""
    from finetuner.model.shapes import GPU_MEASURED_TYPES, load_config

    measured = {load_config(r["preset"])[0]["model_type"] for r in replay(again=False) if "error" not in r}
    assert measured == set(GPU_MEASURED_TYPES)


def test_allocated_peak_is_never_under_predicted_and_the_median_error_is_small():
    """The published claim: every allocated prediction at or above the measurement, median |error| < 5 %."""
    rows = replay()
    for r in rows:  # named row by row, so a failure says which run and by how much
        assert r["predicted_allocated_bytes"] >= r["measured_allocated_bytes"], (
            f"{r['preset']} {r['config']}: predicted {r['predicted_allocated_bytes'] / 2**30:.2f} GiB allocated, "
            f"measured {r['measured_allocated_bytes'] / 2**30:.2f} GiB ({r['error_allocated_pct']:+.1f}%)")
    st = summary(rows)
    assert st["allocated"]["under_predicted"] == []
    assert st["allocated"]["median_abs_pct"] < MEDIAN_GOAL_PCT, st["allocated"]


def test_the_replay_uses_the_current_model(monkeypatch):
    """The replay is not the recorded prediction: shrink one term of the model and rows fall below."""
    import finetuner.memory.model as model

    assert summary(replay())["allocated"]["under_predicted"] == []
    monkeypatch.setattr(model, "CUBLAS_WORKSPACE_BYTES", model.CUBLAS_WORKSPACE_BYTES - 2**30)
    assert summary(replay())["allocated"]["under_predicted"], "a 1 GiB smaller prediction left every row above"


def test_published_table_is_the_replay():
    """docs/memory.md's table and summary line are exactly `python -m scripts.validate.memory --report docs/validation --again`."""
    m = re.search(r"<!-- memory-table:start -->\n(.*?)<!-- memory-table:end -->", MEMORY_MD.read_text(encoding="utf-8"), re.S)
    assert m, "docs/memory.md has no <!-- memory-table:start --> ... <!-- memory-table:end --> section"
    assert m.group(1) == report(VALIDATION, again=True), (
        "docs/memory.md's table is stale: paste the output of `python -m scripts.validate.memory --report docs/validation --again`")


def test_the_report_runs_without_torch():
    """The replay is arithmetic on the records: the report command imports neither torch nor transformers."""
    code = ("import runpy, sys, traceback, builtins\n"
            "first = []\n"
            "real = builtins.__import__\n"
            "def spy(name, *a, **k):\n"
            "    if name.split('.')[0] in ('torch', 'transformers') and not first:\n"
            "        first.append(''.join(traceback.format_stack(limit=30)))\n"
            "        r = sys.modules.get('finetuner.model.reading')\n"
            "        if r is not None:  # why the shipped inventories did not answer\n"
            "            first.append(repr((r.PACKAGED, r.PACKAGED.is_file(), len(r.packaged().get('models', {})))))\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = spy\n"
            "sys.argv = ['memory', '--report', 'docs/validation', '--again']\n"
            "runpy.run_module('scripts.validate.memory', run_name='__main__')\n"
            "heavy = sorted({'torch', 'transformers', 'bitsandbytes', 'peft'} & set(sys.modules))\n"
            "assert not heavy, (heavy, first)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("| model | config |") and "Rows: " in out.stdout


def test_readme_quotes_the_replay():
    """docs/compare.md's "Where finetuner differs" gives the same run count and errors as the replay."""
    st = summary(replay())
    text = " ".join((REPO / "docs" / "compare.md").read_text(encoding="utf-8").split())
    m = re.search(r"(\d+) runs of 7B-, 8B- and 13B-shaped models on an H100 .*? median error ([\d.]+) % of the allocated "
                  r"peak \(largest ([\d.]+) %, (never under|\d+ runs? under)\) and ([\d.]+) % of the reserved peak", text)
    assert m, "docs/compare.md no longer states the memory model's measured error in the expected words"
    a, r = st["allocated"], st["reserved"]
    assert (int(m[1]), m[2], m[3], m[5]) == (
        st["rows"], f"{a['median_abs_pct']:.1f}", f"{a['max_abs_pct']:.1f}", f"{r['median_abs_pct']:.1f}")
    assert (m[4] == "never under") == (not a["under_predicted"])

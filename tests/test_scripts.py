"""The README's two set-up scripts as a user runs them: arguments to ``scripts/demo.sh`` reach
``finetuner run`` and nothing else (``_setup.sh`` once took them for pip extras)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO


def test_demo_script_passes_its_arguments_to_finetuner_run(tmp_path):
    stamp = REPO / ".venv" / ".finetuner-install"
    if not stamp.is_file():  # scripts/test.sh (and so CI) always makes it before pytest starts
        pytest.skip(f"no {stamp}: run the tests through ./scripts/test.sh (a failure with CI=true)")
    before = stamp.read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), "--set", "training.max_steps=2", "-o", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "install failed" not in out and "installing into" not in out, out  # the installed venv serves the demo as it is
    assert stamp.read_text() == before  # the test extras stay installed
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2, metrics

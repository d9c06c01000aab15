"""What a run prints when nobody watches a terminal (a log file, a pipe, CI): whole lines, no library noise."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def _env() -> dict[str, str]:
    """The environment of a job writing to a log: no terminal, no ``COLUMNS`` (rich then assumes 80)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TERM")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def test_step_lines_are_not_wrapped_when_output_is_not_a_terminal(tmp_path):
    out = tmp_path / "a-run-folder-with-a-name-long-enough-to-push-the-start-line-past-eighty-columns"
    r = subprocess.run(
        [sys.executable, "-m", "finetuner", "run", str(REPO / "recipes" / "demo_dpo_cpu.yaml"), "-o", str(out),
         "--set", "training.max_steps=2", "--set", "logging.every=1", "--set", "samples.prompts=[]"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/2", "2/2"], r.stdout
    for ln in steps:  # each step's line whole: from the step to its ETA, reward figures included
        assert "reward accuracy" in ln and re.search(r" ETA \d+:\d\d:\d\d( \(planned\))?$", ln.rstrip()), ln
    assert max(len(ln) for ln in steps) > 80, steps  # wider than rich's default width, and not cut there
    start = next(ln for ln in lines if ln.startswith("demo_dpo_cpu (new run)"))
    assert start.endswith(str(out)), r.stdout  # the start line too: one line, ending with the run folder


def test_a_lora_run_on_the_cpu_prints_no_bitsandbytes_kernels_notice(tmp_path):
    """bitsandbytes (imported by peft on every LoRA run) announces on a CPU that its optional ``kernels``
    package is missing: finetuner drops exactly that notice, through the Python API as through the CLI,
    and lets bitsandbytes' other warnings through."""
    script = (
        "import logging, finetuner\n"
        f"finetuner.train({str(REPO / 'recipes' / 'demo_cpu.yaml')!r}, output_dir={str(tmp_path / 'run')!r},\n"
        "               overrides=['training.max_steps=1', 'samples.prompts=[]'])\n"
        "import bitsandbytes\n"  # imported by the run (through peft): the notice, if any, is printed by now
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('Another bitsandbytes warning')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "adapter").is_dir()
    out = r.stdout + r.stderr
    assert "kernels-community" not in out and "pip install kernels" not in out, out
    assert "Another bitsandbytes warning" in out

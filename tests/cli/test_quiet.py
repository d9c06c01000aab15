"""Quiet by default: finetuner's own output only; ``--debug`` lets the libraries speak."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.cli.test_run_output import _env

#: what another library prints (Python's warnings, the libraries' logger prefixes, a progress bar)
THIRD_PARTY = re.compile(r"Warning:|UserWarning|FutureWarning|DeprecationWarning|warnings\.warn|^(bitsandbytes|peft|transformers|"
                         r"torch|mlflow|wandb|trackio)\b|kernels-community|it/s\]")


def test_finetuner_help_prints_no_third_party_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "finetuner", "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0 and "--debug" in r.stdout
    foreign = [ln for ln in (r.stdout + r.stderr).splitlines() if THIRD_PARTY.search(ln)]
    assert not foreign, foreign


def test_the_peft_notice_on_a_gguf_base_is_dropped_and_debug_shows_it(tmp_path):
    """peft's "Could not find a config file" (saving an adapter of a model loaded from a GGUF file), raised here
    as peft raises it: gone in a finetuner process, shown again with FINETUNER_DEBUG (``finetuner --debug``)."""
    script = ("import warnings, finetuner.quiet as q\nq.quiet_libraries()\n"
              "warnings.warn('Could not find a config file in /x/SmolLM2.gguf - will assume that the vocabulary was not modified.')\n")
    quiet = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True)
    loud = subprocess.run([sys.executable, "-c", script], env=dict(_env(), FINETUNER_DEBUG="1"), capture_output=True, text=True)
    assert quiet.returncode == 0 and "Could not find a config file" not in quiet.stderr, quiet.stderr
    assert "Could not find a config file" in loud.stderr

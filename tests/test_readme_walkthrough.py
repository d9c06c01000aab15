"""Every shell command of README.md and of the documentation site's pages, in the order a reader meets them (the
README, then the pages of ``mkdocs.yml``'s nav), as a newcomer runs them on a fresh clone.

The README's quick start is ``./scripts/demo.sh`` and the pages after it assume what it left
behind (``runs/demo_cpu`` trained 150 steps); each section's commands assume the ones before it.
This test runs *all* the ``bash`` blocks (the ``bash runnable`` walk-through of docs/getting-started.md among
them), top to bottom, page after page, in one temporary copy of the checkout, so that a command that only fails after an earlier
one (the walk-through's 5-step ``run`` after the 150-step demo, a second ``merge -o`` into a folder
an earlier line wrote) is caught. ``HF_TOKEN`` is set to a fake token throughout, and no file the
commands write may contain it (README, "Gated models"). The walk-through blocks are not also run
on their own: every command of theirs runs here, and a second run would cost minutes and show
nothing more than a 5-step run where this one has the demo's 150 steps.

What "as written" means here, and where it cannot be:

* Every command runs exactly as printed, with no flag added or changed: ``./scripts/demo.sh``
  trains its full 150 steps (the walk-through's trouble came from exactly that state), the
  exports verify their files. This makes the test long (minutes of CPU); that is its point.
* ``./scripts/demo.sh`` runs the real script. Its ``.venv/`` is this environment, linked in (the
  copy's ``.venv/bin`` holds ``python`` and ``finetuner`` from here and the install stamp
  ``scripts/_setup.sh`` writes), so the script's setup finds nothing to install; what install
  costs on a fresh machine is measured separately (docs/getting-started.md, The demo).
* An interactive ``finetuner chat`` gets an empty standard input: the user presses Ctrl-D.
* Commands that cannot run here are skipped, each for the reason in :data:`NOT_RUN` (matched by
  pattern, and every pattern must match a command of the pages, so the list cannot go stale): the test
  suite itself, placeholders (``RECIPE``, the user's ``my_data.jsonl``), hub downloads of
  7B-class models and GPU recipes (nothing can be downloaded here), the web server, package
  installs, the documentation server, and the shell's ``source``. Skipped commands still must parse (``tests/test_readme.py``).

Each command must exit 0 and print no Python traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import HANG_GUARD_S, cli_in_process, share_gguf_cache, shared_gguf_cache
from tests.test_readme import FAKE_TOKEN, blocks, commands, reading_order

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

#: (pattern on the command, why it is not run): every command of the pages that is not run, and why
NOT_RUN: list[tuple[str, str]] = [
    (r"^\./scripts/test\.sh\b", "runs the whole test suite, of which this test is a part"),
    (r"my_data\.jsonl", "my_data.jsonl stands for the user's own file"),
    (r"^finetuner run my\.yaml$", "trains Qwen2.5-7B: a 15 GB hub download and a 24 GB GPU"),
    (r"qwen2\.5-7b-my_data-sft", "uses the Qwen2.5-7B run of the line before (not run)"),
    (r"^source ", "each command runs in a shell of its own with this environment's finetuner already on PATH"),
    (r"^(\w+=('[^']*'|\S+) )*finetuner ui\b", "starts the web server, which runs until stopped (tests/ui/ drive it; "
                                    "tests/ui/test_ui_access.py its --auth-file and FINETUNER_UI_AUTH)"),
    (r"^mkdir -p ~/\.config/finetuner && ", "writes a UI password file into the home folder of whoever runs the tests "
                                            "(tests/ui/test_ui_access.py checks --auth-file with a file of its own)"),
    (r"^finetuner run recipes/7b_4090\.yaml", "downloads Qwen2.5-7B-Instruct and needs a 24 GB GPU"),
    (r"^finetuner run grpo\.yaml", "the GRPO plan's Llama-3.1-8B: a hub download and a 24 GB GPU (tests/planning/"
                                   "test_plan_grpo.py runs a planned GRPO recipe with auto values on the CPU)"),
    (r"~/models/", "~/models/model.Q8_0.gguf stands for the user's own GGUF file: "
                   "tests/export/test_gguf_base_run.py plans, trains and exports a GGUF base through the CLI"),
    (r"\bRECIPE\b", "RECIPE is a placeholder for the user's recipe"),
    (r"smollm2_cpu", "the real 135M model's walk-through (minutes of CPU): tests/training/test_cpu_walkthrough.py "
                     "runs its recipe, chat and evals through the CLI and checks what the page says of them"),
    (r"^finetuner run tools_plan\.yaml$", "the default plan's tool-calling run: 90 steps of SmolLM2-135M, 45 min on 2 CPU "
     "cores (docs/tools.md quotes its measurement, docs/tool_calls_default_plan.json); the plan before it runs here, "
     "and tests/training/test_tool_call_scores.py trains and scores a tool-calling run on the demo model"),
    (r"smollm2-135m-instruct-tool_calls-sft", "measures the default plan's run of the line before (not run)"),
    (r"^pip install ", "installs packages (network; changes the environment under test)"),
    (r"^FINETUNER_DOCS_SCREENSHOTS=", "refreshes the web UI page's screenshots by running the browser tests "
                                      "(tests/ui/test_ui_browser.py), which the suite runs itself"),
    (r"^mkdocs serve\b", "serves the documentation site until stopped (tests/test_docs_site.py builds it)"),
    (r"^python -m scripts\.validate\.(memory|train_gpu) ", "measures on a GPU (docs/memory.md, docs/benchmarks.md): "
     "tests/test_gpu_all_smoke.py runs the same functions at toy size on the CPU, tests/memory/test_memory_accuracy.py "
     "replays the recorded runs"),
    (r"^python -m scripts\.validate\.speed_", "re-measures a CPU speed matrix into docs/validation (minutes to an hour on "
     "2 cores; docs/benchmarks.md): the pages quote the recorded files, which the speed tests replay"),
    (r"^(site=\$\(mktemp -d\) && )?python3 -m pip ", "docs/benchmarks.md's measurement on a GPU machine without finetuner's environment: "
     "downloads wheels and installs them elsewhere"),
]


def readme_commands() -> list[str]:
    """Every command of every ``bash`` block (``bash runnable`` included) of the README and the site's pages, in
    reading order."""
    text = "\n".join(page.read_text(encoding="utf-8") for page in reading_order())
    cmds = [c for info, body in blocks(text) if info.split()[:1] == ["bash"] for c in commands(body)]
    return [re.sub(r"\s+#.*$", "", c) for c in cmds]  # the trailing comment, as bash drops it


def why_not_run(cmd: str) -> str | None:
    return next((why for pattern, why in NOT_RUN if re.search(pattern, cmd)), None)


def fresh_copy(work: Path) -> None:
    """The files a clone has that the commands use, and a ``.venv`` that is this environment."""
    for part in ("recipes", "data", "scripts"):
        shutil.copytree(REPO / part, work / part, ignore=shutil.ignore_patterns("uploads", "__pycache__"))
    for name in ("pyproject.toml", "constraints.txt", "README.md"):
        shutil.copy2(REPO / name, work / name)
    venv_bin = work / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    (venv_bin / "finetuner").symlink_to(BIN / "finetuner")
    # the stamp scripts/_setup.sh writes after an install without extras: sha256 of the two files, 16 hex digits
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + (REPO / "constraints.txt").read_bytes()).hexdigest()
    (work / ".venv" / ".finetuner-install").write_text(f"{digest[:16]}-\n", encoding="utf-8")


#: what bash would expand or redirect: a command with any of these runs in bash
SHELL_SYNTAX = re.compile(r"[|&;<>$`*?~(){}\\]|^\w+=")


def finetuner_argv(cmd: str) -> list[str] | None:
    """The arguments of a plain ``finetuner ...`` command (words and quotes only, nothing bash would expand),
    else None. Those run in the test process: the same parser, command and output as the ``finetuner``
    script, without a new interpreter's ~10 s of imports each (``./scripts/demo.sh`` runs the script itself)."""
    words = shlex.split(cmd)
    if words[:1] != ["finetuner"] or SHELL_SYNTAX.search(re.sub(r'"[^"$`\\]*"|\'[^\']*\'', "", cmd)):
        return None
    return words[1:]


def test_plain_finetuner_commands_are_told_apart_from_shell_ones():
    assert finetuner_argv('finetuner chat runs/demo_cpu -p "What do I need?" --compare') == [
        "chat", "runs/demo_cpu", "-p", "What do I need?", "--compare"]
    for cmd in ("./scripts/demo.sh", "finetuner gpus | head", "finetuner run ~/my.yaml", "finetuner eval $RUN",
                "HF_TOKEN=x finetuner run a.yaml", "finetuner run a.yaml > log", "finetuner-x run"):
        assert finetuner_argv(cmd) is None, cmd


def test_every_not_run_reason_names_a_readme_command():
    cmds = readme_commands()
    assert any(c.startswith("./scripts/demo.sh") for c in cmds)
    for pattern, why in NOT_RUN:
        assert any(re.search(pattern, c) for c in cmds), f"no command of the pages matches {pattern!r} ({why}): remove it"


# a hang guard of two per-test guards: this test runs some 35 commands in a row (the demo's 150 steps, two
# DPO runs, a GRPO run, evals, merges and three verified exports), each with its own guard
@pytest.mark.timeout(2 * HANG_GUARD_S)
def test_the_readme_commands_run_in_order(tmp_path, tmp_path_factory):
    work = tmp_path / "clone"
    fresh_copy(work)
    # a cache of its own (the token check below reads it), the GGUF conversions shared with the run's other tests:
    # converting the real SmolLM2 file for `finetuner chat smollm2-135m-instruct` again would cost 17-55 s
    share_gguf_cache(tmp_path / "cache", shared_gguf_cache(tmp_path_factory))
    overrides = {
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FINETUNER_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_TOKEN": FAKE_TOKEN,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "MPLCONFIGDIR": str(tmp_path / "mpl"),
        "COLUMNS": "120",
    }
    ran, skipped, outputs, took = [], [], {}, []
    for cmd in readme_commands():
        why = why_not_run(cmd)
        if why:
            skipped.append(f"{cmd}  ({why})")
            continue
        began = time.monotonic()
        argv = finetuner_argv(cmd)
        if argv is not None:  # the same command, parsed as bash would, in this process (cli_in_process)
            proc = cli_in_process(*argv, cwd=work, env=overrides)
        else:
            proc = subprocess.run(["bash", "-c", cmd], cwd=work, env={**os.environ, **overrides}, capture_output=True,
                                  text=True, stdin=subprocess.DEVNULL, timeout=HANG_GUARD_S)  # an interactive chat ends as Ctrl-D ends it
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode} after {len(ran)} commands:\n{output[-3000:]}"
        assert "Traceback" not in output, f"`{cmd}` printed a traceback:\n{output[-3000:]}"
        ran.append(cmd)
        outputs[cmd] = " ".join(output.split())
        took.append(f"{time.monotonic() - began:6.1f} s  {cmd}")
    print("ran (seconds each, for whoever makes this test faster):\n  " + "\n  ".join(took))
    print("not run:\n  " + "\n  ".join(skipped))
    assert len(ran) >= 30 and len(ran) + len(skipped) == len(readme_commands()), (len(ran), skipped)

    # the demo trained its 150 steps; the walk-through's 5-step run then said so and changed nothing
    demo = work / "runs" / "demo_cpu"
    assert json.loads((demo / "metrics.json").read_text(encoding="utf-8"))["steps"] == 150
    said = outputs["finetuner run recipes/demo_cpu.yaml --set training.max_steps=5"]
    assert "already trained 150 steps, more than the 5 that training.max_steps=5 asks for" in said, said
    assert "runs/demo_cpu/adapter" in said and "--no-resume" not in said
    for folder in ("exports/demo-merged", "exports/demo-bf16", "exports/demo-ollama"):
        assert (work / folder).is_dir(), folder
    # what the walk-through says it leaves behind
    assert (demo / "adapter" / "adapter_config.json").is_file()
    assert "evaluation" in json.loads((demo / "metrics.json").read_text(encoding="utf-8"))
    assert (work / "exports" / "demo-merged" / "config.json").is_file() and (work / "my.yaml").is_file()
    # "finetuner never writes the token into run folders": nor anywhere else it writes
    # (the shared GGUF conversions behind cache/gguf are not this test's writing: os.walk does not follow the link)
    written = [Path(d) / f for top in (work, tmp_path / "cache") for d, _, files in os.walk(top) for f in files]
    written = [p for p in written if p.is_file() and not p.is_symlink()]
    leaked = [p for p in written if FAKE_TOKEN.encode() in p.read_bytes()]
    assert not leaked, f"HF_TOKEN written into {leaked}"

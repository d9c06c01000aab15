"""README.md as a newcomer meets it: its commands run, and its "what fits where" table is current.

Every fenced block whose info string is ``bash runnable`` is run line by line, in order, as a
user would type it: in a temporary copy of ``recipes/`` and ``data/`` (nothing is written into
the checkout), with this environment's ``finetuner`` on PATH, a temporary tokenized-data cache
and a fake ``HF_TOKEN`` that must not end up in any file. Each command must exit 0 and print no
Python traceback. The other ``bash`` blocks (GPU recipes, the web UI, placeholders such as
RECIPE) are not run, but each ``finetuner ...`` line in them must parse with the real CLI.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent  # the environment's bin/, where the `finetuner` entry point lives
FAKE_TOKEN = "hf_readmeTestTokenNotReal0123456789abcdef"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def commands(body: str) -> list[str]:
    """The commands of a shell block: backslash continuations joined, blank and comment lines dropped."""
    out: list[str] = []
    pending = ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    assert not pending, f"a block ends in a line continuation: {pending!r}"
    return out


def runnable_commands(text: str) -> list[str]:
    return [c for info, body in blocks(text) if info.split() == ["bash", "runnable"] for c in commands(body)]


def test_blocks_are_marked():
    """The runnable blocks exist, and every shell block is either ``bash`` or ``bash runnable``."""
    text = README.read_text(encoding="utf-8")
    infos = [info for info, _ in blocks(text)]
    assert infos.count("bash runnable") >= 2, infos
    assert all(i in ("bash", "bash runnable", "python", "") for i in infos), infos
    quick = next(body for info, body in blocks(text) if info == "bash")  # the first block: the quick start
    assert [c.split("#")[0].strip() for c in commands(quick)] == ["./scripts/demo.sh", "./scripts/test.sh"]
    walk = runnable_commands(text)
    for sub in ("gpus", "plan", "estimate", "run", "chat", "eval", "merge"):
        assert any(shlex.split(c, comments=True)[1] == sub for c in walk), f"no runnable `finetuner {sub}`"


def test_every_finetuner_line_parses():
    """Commands shown but not run (GPU recipes, placeholders) still name real subcommands and flags."""
    from finetuner.cli.main import build_parser

    parser = build_parser()
    checked = 0
    for info, body in blocks(README.read_text(encoding="utf-8")):
        if not info.startswith("bash"):
            continue
        for cmd in commands(body):
            argv = shlex.split(cmd, comments=True)
            if not argv or argv[0] != "finetuner":
                continue
            try:
                parser.parse_args(argv[1:])
            except SystemExit as e:  # argparse exits on an unknown flag or a missing argument
                pytest.fail(f"README command does not parse (exit {e.code}): {cmd}")
            checked += 1
    assert checked >= 20


def test_fit_table_is_current():
    """The table between the fit-table markers is exactly `python -m scripts.dev.fit_table`'s output."""
    text = README.read_text(encoding="utf-8")
    m = re.search(r"<!-- fit-table:start -->\n(.*?)<!-- fit-table:end -->", text, re.S)
    assert m, "README.md has no <!-- fit-table:start --> ... <!-- fit-table:end --> section"
    out = subprocess.run([sys.executable, "-m", "scripts.dev.fit_table"], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert m.group(1) == out.stdout, "README's fit table is stale: paste the output of `python -m scripts.dev.fit_table`"


@pytest.mark.parametrize("installed", [True, False], ids=["liger-and-flash-attn-installed", "neither-installed"])
def test_fit_table_does_not_depend_on_what_is_installed(monkeypatch, installed):
    """The table is made for a default install whatever this environment has: the same with
    liger-kernel (and triton, flash_attn) importable as without, where a plan for the card as
    found here does change."""
    import finetuner.config.runtime as runtime
    from finetuner.planning.planner import plan
    from scripts.dev.fit_table import table

    text = README.read_text(encoding="utf-8")
    section = re.search(r"<!-- fit-table:start -->\n(.*?)<!-- fit-table:end -->", text, re.S).group(1)
    monkeypatch.setattr(runtime, "_installed", lambda package: installed)
    assert table() == section
    # the simulation reaches the planner: the card as found here (no assumption) is planned differently
    found_here = plan("llama-3.1-8b", "a100-40gb", seq_len=2048).estimate.settings
    assert (found_here.fused_ce, found_here.attn_implementation) == (
        (True, "flash_attention_2") if installed else (False, "sdpa"))


def test_runnable_blocks_run(tmp_path):
    """The README's runnable blocks, line by line, in a copy of recipes/ and data/."""
    finetuner = BIN / "finetuner"
    assert finetuner.exists(), f"no finetuner entry point next to {sys.executable}: pip install -e ."
    work = tmp_path / "checkout"
    for part in ("recipes", "data"):
        shutil.copytree(REPO / part, work / part, ignore=shutil.ignore_patterns("uploads", "__pycache__"))
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FINETUNER_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_TOKEN": FAKE_TOKEN,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "MPLCONFIGDIR": str(tmp_path / "mpl"),
        "COLUMNS": "120",
    }
    cmds = runnable_commands(README.read_text(encoding="utf-8"))
    assert cmds
    for cmd in cmds:
        proc = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=540)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}:\n{output[-3000:]}"
        assert "Traceback" not in output, f"`{cmd}` printed a traceback:\n{output[-3000:]}"

    # what the walk-through says it leaves behind
    run = work / "runs" / "demo_cpu"
    assert (run / "adapter" / "adapter_config.json").is_file()
    assert "evaluation" in json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    assert (work / "exports" / "demo-merged" / "config.json").is_file()
    assert (work / "my.yaml").is_file()
    # "finetuner never writes the token into run folders": nor anywhere else it writes
    leaked = [p for p in work.rglob("*") if p.is_file() and FAKE_TOKEN.encode() in p.read_bytes()]
    leaked += [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and FAKE_TOKEN.encode() in p.read_bytes()]
    assert not leaked, f"HF_TOKEN written into {leaked}"

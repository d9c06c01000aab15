"""A fast command line: building the parser (``finetuner --help``) imports no heavy library."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import HANG_GUARD_S

HEAVY = ("torch", "transformers", "datasets", "peft", "accelerate", "bitsandbytes", "gradio")

PROBE = """
import json, sys
import finetuner.cli.main as cli
import importlib
for name in cli.COMMAND_MODULES:
    importlib.import_module(name)
parser = cli.build_parser()
parser.format_help()
for action in parser._subparsers._group_actions:
    for sub in action.choices.values():
        sub.format_help()
print(json.dumps({"modules": sorted(m for m in sys.modules if m.split('.')[0] in HEAVY), "commands": list(cli.COMMAND_MODULES)}))
"""


def test_parser_and_help_import_nothing_heavy():
    code = f"HEAVY = {HEAVY!r}\n" + PROBE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["modules"] == [], f"building the CLI parser imported {got['modules']}"
    assert "finetuner.cli.plan" in got["commands"]


def test_help_exits_cleanly_without_heavy_imports():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['finetuner', '--help']\n"
        "try:\n"
        "    runpy.run_module('finetuner', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print('HEAVY', bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert "usage: finetuner" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_plan_for_a_preset_imports_nothing_heavy(tmp_path):
    """``finetuner plan`` answers from the memory model and presets: no torch, no transformers."""
    code = (
        "import sys, runpy\n"
        "sys.argv = ['finetuner', 'plan', '--model', 'llama-3.1-8b', '--gpu', 'rtx4090', '--json']\n"
        "try:\n"
        "    runpy.run_module('finetuner', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print('HEAVY', bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []"

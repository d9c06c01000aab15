"""Every hint is a command that works where it is shown: an error that names recipe settings to
change says how *that* command takes them (``finetuner run --set``, ``finetuner plan --column``,
``finetuner eval --column``), and the suggested command, filled in, then succeeds.
(``finetuner plan`` used to suggest ``--set data.columns…``, which it refuses.)"""

from __future__ import annotations

import csv
import re
import shlex

import pytest

from finetuner.surface import shown_in
from finetuner.errors import UserError, how_to_set
from tests.conftest import REPO, cli_in_process, run_cli, write_recipe

DEMO_MODEL = str(REPO / "data" / "demo_model")
ROWS = [(f"Was nehme ich auf Wanderung {i} mit?", f"Wasser, eine Karte und Stiefel für Wanderung {i}.", "wandern") for i in range(16)]
COLUMNS = {"prompt": "frage", "response": "antwort"}


def write_csv(path):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["frage", "antwort", "kategorie"])
        w.writerows(ROWS)
    return path


def suggested_args(stderr: str, command: str) -> list[str]:
    """The command-line arguments the hint offers ``command``, with COLUMN filled in per role."""
    line = next((ln for ln in stderr.splitlines() if ln.startswith("On the command line")), None)
    assert line is not None, stderr
    assert line.startswith(f"On the command line (finetuner {command}): ") or command in ("run", "estimate"), line
    args = shlex.split(line.split(": ", 1)[1])
    filled = []
    for a in args:
        m = re.fullmatch(r"(?:data\.columns\.)?(\w+)=COLUMN", a)
        filled.append(a.replace("COLUMN", COLUMNS[m.group(1)]) if m else a)
    return filled


def test_settings_are_written_as_each_command_takes_them():
    e = UserError("x", hint="Roles: ...", settings={"data.columns.prompt": "COLUMN", "data.columns.response": "COLUMN"})
    assert e.hint_for("run").startswith("On the command line: --set data.columns.prompt=COLUMN --set data.columns.response=COLUMN")
    assert e.hint_for("plan").startswith("On the command line (finetuner plan): --column prompt=COLUMN --column response=COLUMN")
    assert e.hint_for("eval").startswith("On the command line (finetuner eval): --column prompt=COLUMN --column response=COLUMN")
    assert e.hint_for("ui") == ("In the web UI: choose the columns for prompt and response in the Data tab's column "
                                "menus (under the data file).\nRoles: ...")
    assert how_to_set({"objective": "dpo"}, "ui") == "In the web UI: choose dpo in the Plan tab's Objective menu."
    # a setting the UI has no control for: its recipe editor
    assert how_to_set({"training.micro_batch_size": "2"}, "ui").startswith("In the recipe editor (Plan tab):\n  training:")
    with shown_in("ui"):  # raised in a worker the web UI started: worded for the UI from the start
        assert UserError("x", settings={"objective": "dpo"}).hint.startswith("In the web UI: choose dpo")
    # anywhere (the Python API's str(e)): the recipe, and which command takes which flag
    assert "`finetuner run` and `estimate` take --set data.columns.prompt=COLUMN" in e.hint
    assert "`finetuner plan` takes --column prompt=COLUMN" in e.hint and e.hint.endswith("Roles: ...")
    # a setting a command has no flag for: the recipe, never a flag it refuses
    t = how_to_set({"training.micro_batch_size": "2"}, "plan")
    assert "--" not in t and "training: {micro_batch_size: '2'}" in t
    assert how_to_set({"objective": "dpo"}, "plan") == "On the command line (finetuner plan): --objective dpo"


def test_the_data_columns_hint_works_where_it_is_shown(tmp_path):
    """plan, run and eval each refuse the CSV, each suggests its own flags, and each works with them."""
    data = write_csv(tmp_path / "fragen.csv")

    r = run_cli("plan", "-m", DEMO_MODEL, "--gpu", "cpu", "--data", str(data), cwd=tmp_path)
    assert r.returncode == 2 and "cannot tell the data format" in r.stderr and "--set" not in r.stderr, r.stderr
    fixed = run_cli("plan", "-m", DEMO_MODEL, "--gpu", "cpu", "--data", str(data), *suggested_args(r.stderr, "plan"),
                    cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr

    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "fragen", "model": {"name": DEMO_MODEL}, "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 0},
        "training": {"max_steps": 2, "lr": 2e-3, "micro_batch_size": 4, "gradient_accumulation": 1, "warmup_steps": 0},
        "logging": {"tensorboard": False}, "output_dir": str(tmp_path / "run"),
    })
    r = cli_in_process("run", str(recipe), cwd=tmp_path)
    assert r.returncode == 2 and "cannot tell the data format" in r.stderr and "--column" not in r.stderr, r.stderr
    fixed = cli_in_process("run", str(recipe), *suggested_args(r.stderr, "run"), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr

    other = write_csv(tmp_path / "mehr.csv")  # the same columns, in a file the run did not train on
    r = cli_in_process("eval", str(tmp_path / "run"), "--data", str(other), "--no-write", cwd=tmp_path)
    assert r.returncode == 2 and "cannot tell the data format" in r.stderr and "--set" not in r.stderr, r.stderr
    fixed = cli_in_process("eval", str(tmp_path / "run"), "--data", str(other), "--no-write", *suggested_args(r.stderr, "eval"),
                    cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert f"16 examples from {other} (" in fixed.stdout and "held-out" not in fixed.stdout

    # the run's own training file is named as such, not as held-out data
    own = cli_in_process("eval", str(tmp_path / "run"), "--data", str(data), "--no-write", "--column", "prompt=frage",
                  "--column", "response=antwort", cwd=tmp_path)
    assert own.returncode == 0, own.stderr
    assert f"16 examples from {data}, the run's training data" in own.stdout and "held-out" not in own.stdout


@pytest.mark.parametrize("bad", ["prompt", "=frage", "prompt="])
def test_eval_column_items_are_checked(tmp_path, bad):
    r = cli_in_process("eval", str(tmp_path), "--data", "x.csv", "--column", bad, cwd=tmp_path)
    assert r.returncode == 2 and "write ROLE=COLUMN" in r.stderr


def test_the_ui_shows_settings_without_command_line_flags(tmp_path):
    from ui.errors import error_md
    from ui.handlers import Handlers

    data = write_csv(tmp_path / "fragen.csv")
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    shown = h.on_data(DEMO_MODEL, str(data), 0)[0]
    assert "cannot tell the data format" in shown and "choose the columns for prompt and response" in shown
    assert "--set" not in shown and "--column" not in shown
    e = UserError("x", settings={"objective": "dpo"})
    assert "--" not in error_md(e) and "choose dpo in the Plan tab's Objective menu" in error_md(e)

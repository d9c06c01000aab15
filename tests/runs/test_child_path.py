"""A folder someone gave you is never on the ``sys.path`` of a process finetuner starts (issue 35).

Each test plants modules named like finetuner's imports (``yaml``, ``peft``, ``safetensors``) in the folder a
child runs in; a planted module that is imported writes a marker file and ends
its process, so a run that imported one both leaves the marker and fails. These processes start from a new
interpreter here (``real_interpreters``), not forked from the tests' zygote (tests/zygote_child.py), which has
imported those libraries already and would show nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.children import BOOTSTRAP, PYTHON_ENV, module_args, module_command, python_command
from finetuner.runs import jobs
from tests.conftest import HANG_GUARD_S, REPO, demo_run_folder, write_recipe

PLANTED = ("yaml", "peft", "safetensors")


@pytest.fixture(autouse=True)
def real_interpreters(monkeypatch):
    """Every process finetuner starts in these tests is a new interpreter (``$FINETUNER_PYTHON`` unset)."""
    monkeypatch.delenv(PYTHON_ENV, raising=False)


def plant(folder: Path) -> Path:
    """Modules named like finetuner's imports in ``folder``; the marker file they would write."""
    marker = folder / "PLANTED-CODE-RAN"
    for name in PLANTED:
        (folder / f"{name}.py").write_text(
            f"import pathlib, os\npathlib.Path({str(marker)!r}).write_text({name!r})\nos._exit(7)\n", encoding="utf-8")
    return marker


@pytest.mark.parametrize("safe_path", [True, False], ids=["-P", "bootstrap"])
def test_a_module_run_as_finetuner_runs_it_imports_nothing_from_the_working_folder(tmp_path, safe_path):
    """Both forms of the command (``-P`` from Python 3.11; the bootstrap 3.10 gets, which works on any)."""
    marker = plant(tmp_path)
    code = "import sys, yaml, safetensors; print(yaml.__file__, sys.argv[1:])"
    (tmp_path / "probe_main.py").write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = module_args("json.tool", "--help", safe_path=safe_path)
    assert args[:2] == (["-P", "-m"] if safe_path else ["-c", BOOTSTRAP])
    p = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert p.returncode == 0 and "usage" in p.stdout, p.stderr
    plain = subprocess.run([sys.executable, "-c", "import yaml"], cwd=tmp_path, capture_output=True, timeout=HANG_GUARD_S)
    assert plain.returncode == 7 and marker.exists()  # what the planted module does where the folder is on sys.path
    marker.unlink()
    p = subprocess.run([sys.executable, *module_args("finetuner", "--version", safe_path=safe_path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert p.returncode == 0 and p.stdout.startswith("finetuner "), p.stderr
    assert not marker.exists()


def test_every_python_child_finetuner_starts_runs_a_module_without_the_working_folder():
    """No ``[sys.executable, "-m", ...]`` left in the package: each child goes through finetuner.children."""
    offenders = []
    for path in (REPO / "finetuner").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name != "children.py" and ('sys.executable, "-m"' in text or "sys.executable, '-m'" in text):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders
    assert module_command("finetuner", "run") in ([sys.executable, "-P", "-m", "finetuner", "run"],
                                                  [sys.executable, "-c", BOOTSTRAP, "finetuner", "run"])
    assert python_command() == [sys.executable]


def test_resuming_a_received_run_in_the_web_ui_runs_no_code_planted_in_it(recipe_dict, tmp_path):
    """The UI resumes a job as ``python -m finetuner run RUN/recipe.yaml -o RUN`` inside RUN: a received run
    folder with a ``yaml.py`` ran it (the code box unticked). Now the job resumes, trains and never imports it."""
    import yaml

    run = tmp_path / "runs" / "received"
    short = dict(recipe_dict, output_dir=str(run), training=dict(recipe_dict["training"], max_steps=2),
                 checkpointing={"save_every": 2, "keep_last": 1})
    finetuner.train(Recipe.from_dict(short))
    saved = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8"))
    saved["training"]["max_steps"] = 4  # two steps left: the job must load and train, not only read the folder
    (run / "recipe.yaml").write_text(yaml.safe_dump(saved), encoding="utf-8")
    marker = plant(run)
    job = jobs.start_job(None, run_dir=run, runs_dir=tmp_path / "runs")
    assert job.command[1] in ("-P", "-c")
    assert jobs.wait_job(job, HANG_GUARD_S)
    log = (run / jobs.LOG_NAME).read_text(encoding="utf-8", errors="replace")
    assert jobs.exit_code(job.pid) == 0 and not marker.exists(), log[-2000:]
    assert json.loads((run / "metrics.json").read_text(encoding="utf-8"))["steps"] == 4


def test_a_multi_process_run_started_in_a_received_folder_runs_no_code_planted_in_it(recipe_dict, tmp_path):
    """``finetuner run RECIPE --gpus 2`` typed inside a folder holding planted modules: the torchrun launcher and
    both ranks start with that folder off their sys.path (PYTHONSAFEPATH reaches the ranks)."""
    folder = tmp_path / "received"
    folder.mkdir()
    recipe = write_recipe(folder / "r.yaml", dict(recipe_dict, output_dir=str(tmp_path / "run"),
                                                    training=dict(recipe_dict["training"], max_steps=2)))
    marker = plant(folder)
    # typed as `finetuner run`: the console script never puts the working folder on its own sys.path
    script = Path(sys.executable).parent / "finetuner"
    p = subprocess.run([str(script), "run", str(recipe), "--gpus", "2", "--quiet"], cwd=folder, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=HANG_GUARD_S)
    assert p.returncode == 0 and not marker.exists(), (p.stdout + p.stderr)[-3000:]
    launch = (tmp_path / "run" / "distributed" / "launch.sh").read_text(encoding="utf-8")
    assert "--no-python" in launch and "-m finetuner.training.distributed" in launch


def test_chat_and_merge_workers_started_in_a_received_folder_run_no_code_planted_in_it(tmp_path, monkeypatch):
    """The chat and merge/export workers run in the caller's working folder (the UI's, or a terminal's)."""
    from finetuner.export.worker import merge_in_subprocess
    from finetuner.infer.chat_worker import ChatWorker

    here = tmp_path / "received"
    here.mkdir()
    marker = plant(here)
    monkeypatch.chdir(here)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    with ChatWorker(str(REPO / "data" / "demo_model"), adapter=False) as chat:
        assert chat.start().alive and isinstance(chat.reply([{"role": "user", "content": "hi"}], max_new_tokens=2, temperature=0), str)
    run = demo_run_folder(tmp_path / "runs", adapter=True)
    merged = merge_in_subprocess(run, tmp_path / "merged")
    assert (tmp_path / "merged" / "config.json").is_file() and merged is not None
    assert not marker.exists()

"""A run folder is never silently overwritten (issue 23, item 2), through the CLI as a user runs it.

(a) a finished run whose ``checkpoints/`` the user deleted is not replaced by a new run; (b) a
folder the user made, holding their own ``recipe.yaml``, is not taken for a run folder; (c)
``--no-resume`` moves a finished run aside only after the data has been checked. What stays:
``--no-resume`` still moves a run aside when the data is good, and a run folder made before the
run marker (recipe.yaml and events.jsonl) is still recognised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetuner.run_marker import RUN_MARKER
from tests.conftest import cli_in_process, write_recipe


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _results(run: Path) -> dict[str, bytes]:
    """What a finished run's user keeps: its adapter, metrics and recipe."""
    return {k: v for k, v in _snapshot(run).items() if k.startswith("adapter/") or k in ("metrics.json", "recipe.yaml")}


def _finished_run(recipe_dict, tmp_path) -> tuple[Path, Path]:
    recipe = write_recipe(tmp_path / "a.yaml", {**recipe_dict, "training": {**recipe_dict["training"], "max_steps": 2},
                                                "checkpointing": {"save_every": 2, "keep_last": 1}})
    run = tmp_path / "run"
    p = cli_in_process("run", str(recipe), "-o", str(run), "--quiet")
    assert p.returncode == 0, p.stderr
    assert (run / "adapter").is_dir() and (run / "metrics.json").is_file() and (run / RUN_MARKER).is_file()
    return recipe, run


def test_a_finished_run_without_checkpoints_is_not_replaced_by_another_recipe(recipe_dict, tmp_path):
    _, run = _finished_run(recipe_dict, tmp_path)
    shutil.rmtree(run / "checkpoints")  # to free space
    kept = _results(run)
    other = write_recipe(tmp_path / "b.yaml", {**recipe_dict, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}})
    p = cli_in_process("run", str(other), "-o", str(run), "--set", "training.max_steps=2")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"error: {run} holds a finished run (adapter, metrics.json) and no checkpoint to resume" in p.stderr
    # a finished run: the hint is a folder of its own, never --no-resume (which would move it aside)
    assert f"--output {tmp_path / 'run-2'}" in p.stderr and "--no-resume" not in p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert _results(run) == kept and "(new run)" not in p.stdout

    # naming it explicitly: --no-resume moves it aside (not deleted) and trains the new recipe there
    p = cli_in_process("run", str(other), "-o", str(run), "--set", "training.max_steps=2", "--no-resume", "--quiet")
    assert p.returncode == 0, p.stderr
    aside = [d for d in tmp_path.iterdir() if d.name.startswith("run.old-")]
    assert len(aside) == 1 and _results(aside[0]) == kept
    assert (run / "adapter").is_dir() and json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_a_folder_holding_the_users_own_recipe_is_not_a_run_folder(recipe_dict, tmp_path):
    exp = tmp_path / "exp1"
    exp.mkdir()
    import yaml

    text = "# my experiment: keep these comments\n" + yaml.safe_dump({**recipe_dict, "output_dir": None})
    (exp / "recipe.yaml").write_text(text, encoding="utf-8")
    for extra in ([], ["--no-resume"]):
        p = cli_in_process("run", str(exp / "recipe.yaml"), "-o", str(exp), *extra)
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"error: Output folder {exp} is not empty and holds no finetuner run (it holds recipe.yaml)" in p.stderr
        assert "Traceback" not in p.stderr
        assert [x.name for x in exp.iterdir()] == ["recipe.yaml"] and (exp / "recipe.yaml").read_text(encoding="utf-8") == text
        assert sorted(x.name for x in tmp_path.iterdir()) == ["alpaca.json", "exp1"]  # nothing moved aside


def test_no_resume_checks_the_data_before_moving_a_finished_run(recipe_dict, tmp_path):
    recipe, run = _finished_run(recipe_dict, tmp_path)
    before = _snapshot(run)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": ""}\n', encoding="utf-8")
    p = cli_in_process("run", str(recipe), "-o", str(run), "--no-resume", "--set", f"data.path={bad}")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{bad}, line 2: 'text' is empty" in p.stderr and "Traceback" not in p.stderr
    assert not [d for d in tmp_path.iterdir() if ".old-" in d.name]  # nothing moved aside
    after = _snapshot(run)
    assert {k: v for k, v in after.items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}

    no_tokenizer = tmp_path / "model"  # a model folder without tokenizer files: the model is checked first too
    no_tokenizer.mkdir()
    shutil.copy(Path(recipe_dict["model"]["name"]) / "config.json", no_tokenizer)
    p = cli_in_process("run", str(recipe), "-o", str(run), "--no-resume", "--set", f"model.name={no_tokenizer}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert str(no_tokenizer) in p.stderr
    assert not [d for d in tmp_path.iterdir() if ".old-" in d.name]
    assert {k: v for k, v in _snapshot(run).items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}


def test_a_run_folder_made_before_the_marker_is_still_recognised(recipe_dict, tmp_path):
    recipe, run = _finished_run(recipe_dict, tmp_path)
    (run / RUN_MARKER).unlink()  # as finetuner left run folders before the marker: recipe.yaml and events.jsonl
    p = cli_in_process("run", str(recipe), "-o", str(run))
    assert p.returncode == 0, p.stderr
    assert "is finished" in p.stdout + p.stderr


def test_a_job_is_never_started_in_a_folder_of_the_users(recipe_dict, tmp_path):
    """The UI's job start writes the recipe into the run folder it makes (and marks it); a folder given
    to it that holds something else and no run is refused before anything is written."""
    from finetuner.config.recipe import Recipe
    from finetuner.errors import UserError
    from finetuner.runs import jobs

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(UserError, match="is not empty and holds no run"):
        jobs.start_job(Recipe.from_dict(recipe_dict), run_dir=folder, runs_dir=tmp_path / "runs")
    assert [x.name for x in folder.iterdir()] == ["notes.txt"]

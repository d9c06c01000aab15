"""A run folder knows itself (issue 35): its own ``recipe.yaml`` trains in the folder it was read from, never in the
``output_dir`` saved in it. A copy resumes as the copy and leaves the original as it was; a received run never
writes where the giver's path points on this machine."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import yaml

from finetuner.config.recipe import Recipe
from tests.conftest import cli_in_process, write_recipe


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def stopped_run(recipe_dict, tmp_path: Path) -> Path:
    """A run of 4 steps stopped after its step-2 checkpoint: its recipe says 4, it holds 2."""
    run = tmp_path / "A"
    recipe = write_recipe(tmp_path / "r.yaml", dict(recipe_dict, output_dir=str(run),
                                                      checkpointing={"save_every": 2, "keep_last": 1}))
    assert cli_in_process("run", str(recipe), "--set", "training.max_steps=2", "--quiet").returncode == 0
    saved = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8"))
    saved["training"]["max_steps"] = 4
    (run / "recipe.yaml").write_text(yaml.safe_dump(saved), encoding="utf-8")
    assert saved["output_dir"] == str(run)
    return run


def test_a_copied_run_resumes_as_the_copy_and_the_original_is_untouched(recipe_dict, tmp_path):
    original = stopped_run(recipe_dict, tmp_path)
    copy = tmp_path / "B"
    shutil.copytree(original, copy)
    before = digest(original)
    assert Recipe.from_yaml(copy / "recipe.yaml").output_path() == copy.resolve()
    p = cli_in_process("run", str(copy / "recipe.yaml"))  # finetuner's own hint: `finetuner run RUN/recipe.yaml` resumes
    assert p.returncode == 0, p.stderr
    assert "resuming at step 2" in p.stdout and str(copy) in " ".join(p.stdout.split())
    assert json.loads((copy / "metrics.json").read_text())["steps"] == 4
    assert digest(original) == before  # not a byte of A changed, its adapter still the 2-step one
    assert not (original / "metrics.json").exists() or json.loads((original / "metrics.json").read_text())["steps"] == 2


def test_a_received_run_writes_into_its_own_folder_not_where_the_givers_path_points(recipe_dict, tmp_path):
    original = stopped_run(recipe_dict, tmp_path)
    received = tmp_path / "inbox" / "run"
    shutil.copytree(original, received)
    shutil.rmtree(original)  # the giver's machine: that path is not here
    assert cli_in_process("run", str(received / "recipe.yaml"), "--quiet").returncode == 0
    assert not original.exists() and (received / "adapter" / "adapter_config.json").is_file()


def test_a_recipe_that_is_not_a_run_folders_own_keeps_its_output_dir(recipe_dict, tmp_path):
    """A folder the user made, with a recipe.yaml in it, is not a run folder; and an explicit --set wins."""
    mine = tmp_path / "mine"
    mine.mkdir()
    write_recipe(mine / "recipe.yaml", dict(recipe_dict, output_dir=str(tmp_path / "elsewhere")))
    assert Recipe.from_yaml(mine / "recipe.yaml").output_path() == (tmp_path / "elsewhere").resolve()
    run = stopped_run(recipe_dict, tmp_path)
    other = tmp_path / "other"
    assert Recipe.from_yaml(run / "recipe.yaml", [f"output_dir={other}"]).output_path() == other.resolve()

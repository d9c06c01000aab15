"""Planned runs do not collide: ``finetuner plan -o`` names a run after the model, the data file and
the objective, and a name a run folder already has gets ``-2`` (said in the output), so a DPO plan
after an SFT one, or a second plan of the same file, never lands in a finished run's folder. The
written recipe has no placeholder left in it and writes whole numbers as ints."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from tests.conftest import REPO, cli_in_process, run_cli

DEMO = REPO / "data" / "demo_model"


def digest(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())).hexdigest()


def test_an_sft_and_a_dpo_plan_get_runs_of_their_own(tmp_path):
    plan = ("plan", "--model", str(DEMO), "--gpu", "cpu")
    p = run_cli(*plan, "--data", str(REPO / "data" / "qa_sample.csv"), "-o", "sft.yaml", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    sft = yaml.safe_load((tmp_path / "sft.yaml").read_text(encoding="utf-8"))
    assert sft["name"] == "demo_model-qa_sample-sft"
    said = " ".join(p.stdout.split())
    assert "run it with `finetuner run sft.yaml` (its run folder: runs/demo_model-qa_sample-sft)" in said
    p = cli_in_process("run", "sft.yaml", "--set", "training.max_steps=2", "--quiet", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    sft_run = tmp_path / "runs" / "demo_model-qa_sample-sft"
    assert (sft_run / "adapter").is_dir()
    kept = digest(sft_run / "adapter")

    p = run_cli(*plan, "--data", str(REPO / "data" / "preference_sample.jsonl"), "-o", "dpo.yaml", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load((tmp_path / "dpo.yaml").read_text(encoding="utf-8"))["name"] == "demo_model-preference_sample-dpo"
    p = cli_in_process("run", "dpo.yaml", "--set", "training.max_steps=2", "--quiet", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr  # before: the SFT run's folder, refused with a --no-resume hint
    assert (tmp_path / "runs" / "demo_model-preference_sample-dpo" / "adapter").is_dir()

    # the same file planned again: a folder of its own, said in the output; the finished run is untouched
    p = run_cli(*plan, "--data", str(REPO / "data" / "qa_sample.csv"), "-o", "sft-again.yaml", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load((tmp_path / "sft-again.yaml").read_text(encoding="utf-8"))["name"] == "demo_model-qa_sample-sft-2"
    said = " ".join(p.stdout.split())
    assert "run named demo_model-qa_sample-sft-2: runs/demo_model-qa_sample-sft already holds a run" in said
    assert "(its run folder: runs/demo_model-qa_sample-sft-2)" in said
    assert digest(sft_run / "adapter") == kept and sorted(x.name for x in (tmp_path / "runs").iterdir()) == [
        "demo_model-preference_sample-dpo", "demo_model-qa_sample-sft"]


def test_the_written_recipe_has_no_placeholder_and_whole_numbers_as_ints(tmp_path):
    p = run_cli("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(REPO / "data" / "qa_sample.csv"),
                "-o", "my.yaml", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "my.yaml").read_text(encoding="utf-8")
    assert "# Check it: finetuner estimate my.yaml --gpu cpu\n" in text and "RECIPE" not in text
    assert "\n  val_size: 4\n" in text and "\n  epochs: 10\n" in text and ".0\n" not in text
    assert run_cli("estimate", "my.yaml", "--gpu", "cpu", cwd=tmp_path).returncode == 0  # the header's command works

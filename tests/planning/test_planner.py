"""The planner's decisions on a grid of cards and models, its CLI, and auto values in recipes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from finetuner.errors import UserError
from finetuner.config.hardware import get_gpu, list_profiles
from finetuner.planning.planner import plan
from finetuner.planning.search import METHOD_TIER
from finetuner.config.recipe import Recipe

from tests.conftest import cli_in_process, run_cli, write_recipe, HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
MODELS = ["llama-3.2-1b", "phi-3-mini", "llama-2-7b", "mistral-7b-v0.1", "llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b",
          "llama-2-13b", "qwen2.5-14b"]
CARDS = ["t4", "rtx4080", "rtx4090", "l4", "a10g", "a100-40gb", "a100-80gb", "h100-80gb"]


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-2-13b", "llama-3.1-8b", "qwen2.5-7b"])
def test_7b_and_13b_fit_a_24gb_card_at_2048(model):
    p = plan(model, "rtx4090", seq_len=2048)
    assert p.fits and p.recipe is not None
    assert p.estimate.total_bytes <= p.estimate.budget_bytes
    assert p.recipe.data.max_seq_len == 2048  # never cut
    t = p.recipe.training
    assert t.micro_batch_size * t.gradient_accumulation == 16


def test_13b_on_a_4090_needs_qlora_and_7b_gets_lora():
    assert plan("llama-2-13b", "rtx4090", seq_len=2048).recipe.method == "qlora"
    assert plan("llama-2-7b", "rtx4090", seq_len=2048).recipe.method == "lora"


@pytest.mark.parametrize("model", MODELS)
def test_decisions_on_a_grid_of_cards(model):
    previous_tier = None
    for card in sorted(CARDS, key=lambda c: get_gpu(c).memory_bytes):
        p = plan(model, card, seq_len=1024, effective_batch=8)
        if not p.fits:
            assert p.suggestions, (model, card)
            continue
        o = p.recipe
        assert p.estimate.total_bytes <= p.estimate.budget_bytes
        assert o.training.micro_batch_size * o.training.gradient_accumulation == 8
        if o.method == "qlora":  # LoRA is preferred whenever any LoRA option fits
            lora = plan(model, card, seq_len=1024, effective_batch=8, method="lora")
            assert not lora.fits
        tier = METHOD_TIER[o.method]
        if previous_tier is not None:  # a bigger card never gets a lower-quality method
            assert tier <= previous_tier, (model, card)
        previous_tier = tier


def test_bigger_card_is_never_slower():
    speeds = [plan("llama-2-7b", c, seq_len=2048).tokens_per_s for c in ("rtx4090", "a100-80gb", "h100-80gb")]
    assert speeds == sorted(speeds)


def test_nothing_fits_says_what_would():
    p = plan("llama-3.1-70b", "rtx4090", seq_len=2048)
    assert not p.fits and p.recipe is None
    text = " ".join(p.suggestions)
    assert "bigger card" in text and "smaller model" in text


def test_shorter_sequence_suggested_when_only_that_fits():
    p = plan("llama-3.1-8b", "t4", seq_len=65536, method="qlora")
    assert not p.fits
    assert any("shorter sequence" in s for s in p.suggestions)


def test_full_fine_tuning_when_asked_for():
    assert not plan("llama-2-7b", "rtx4090", method="full").fits
    p = plan("llama-3.2-1b", "a100-80gb", method="full", seq_len=1024)
    assert p.fits and p.recipe.method == "full"


def test_data_sets_sequence_length_and_packing():
    data = str(REPO / "data" / "alpaca_sample.json")
    p = plan("llama-2-7b", "rtx4090", data=data)
    assert p.data["rows"] == 300 and 0 < p.data["label_fraction"] < 1
    assert p.data["max_tokens"] <= p.recipe.data.max_seq_len < p.data["max_tokens"] + 64
    # short examples, but 294 of them would fill only ~8 packed rows: not packed (see test_sizing.py)
    assert not p.recipe.data.packing and any(r.startswith("no packing") for r in p.reasons)
    assert p.recipe.data.path == data
    short = plan("llama-2-7b", "rtx4090", data=str(REPO / "data" / "chat_sample.jsonl"), seq_len=16)
    assert any("truncated" in n for n in short.notes)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"model": "llama-2-7b", "gpu": "rtx4909"}, "rtx4090"),
        ({"model": "lama-2-7b", "gpu": "rtx4090"}, "llama-2-7b"),
        ({"model": "llama-2-7b", "gpu": "rtx4090", "seq_len": 0}, "at least 1"),
        ({"model": "llama-2-7b", "gpu": "rtx4090", "effective_batch": 0}, "at least 1"),
        ({"model": "llama-2-7b", "gpu": "rtx4090", "method": "qlra"}, "qlora"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, fragment):
    model, gpu = kwargs.pop("model"), kwargs.pop("gpu")
    with pytest.raises(UserError) as e:
        plan(model, gpu, **kwargs)
    assert fragment in (e.value.message + (e.value.hint or ""))


def test_effective_batch_smaller_than_micro_batch_is_an_error(tmp_path):
    raw = {"model": {"name": "llama-2-7b"}, "data": {"path": "x/y"},
           "training": {"micro_batch_size": 4, "gradient_accumulation": "auto", "effective_batch": 2}}
    with pytest.raises(UserError) as e:
        Recipe.from_dict(raw)
    assert "training.effective_batch" in e.value.message


def test_gpu_sizes_and_profiles():
    assert get_gpu("24GB").memory_bytes == 24 * 2**30
    names = {p.name for p in list_profiles()}
    assert {"rtx3090", "rtx4090", "rtx4080", "l4", "t4", "a10g", "a100-40gb", "a100-80gb", "h100-80gb"} <= names
    assert not get_gpu("t4").bf16


def test_shipped_gpu_recipes_are_what_the_planner_says():
    from scripts.dev.make_gpu_recipes import GPU_RECIPES, planned

    for file in GPU_RECIPES:
        shipped = Recipe.from_yaml(REPO / "recipes" / file)
        fresh = planned(file)
        assert fresh.fits
        assert fresh.recipe_choice() == {
            "method": shipped.method,
            "quantization_bits": shipped.quantization.bits if shipped.quantization else None,
            "micro_batch_size": shipped.training.micro_batch_size,
            "gradient_accumulation": shipped.training.gradient_accumulation,
            "optimizer": shipped.training.optimizer,
            "gradient_checkpointing": shipped.training.gradient_checkpointing,
            "offload_activations": shipped.training.offload_activations,
            "max_seq_len": shipped.data.max_seq_len,
            "packing": shipped.data.packing,
        }, f"recipes/{file} drifted from the planner: run python -m scripts.dev.make_gpu_recipes"


# ---------------------------------------------------------------------- CLI
def test_cli_plan_json_and_recipe_file(tmp_path):
    out = tmp_path / "r.yaml"
    res = run_cli("plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--seq-len", "2048", "--json", "-o", str(out))
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["fits"] is True and d["device_bytes"] == get_gpu("rtx4090").memory_bytes
    assert d["total_bytes"] == sum(d["components"].values())
    recipe = Recipe.from_yaml(out)
    assert recipe.method == d["choice"]["method"] and not recipe.auto_keys()
    again = run_cli("plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "-o", str(out))
    assert again.returncode == 2 and "will not overwrite" in again.stderr and "Traceback" not in again.stderr
    est = run_cli("estimate", str(out), "--gpu", "rtx4090", "--json")
    assert est.returncode == 0 and json.loads(est.stdout)["total_bytes"] == d["total_bytes"]


def test_cli_plan_text_nothing_fits_and_errors():
    res = run_cli("plan", "--model", "llama-2-13b", "--gpu", "rtx4090", "--seq-len", "2048")
    assert res.returncode == 0 and "QLoRA 4-bit" in res.stdout and "Predicted peak memory" in res.stdout
    none = run_cli("plan", "--model", "llama-3.1-70b", "--gpu", "rtx4090")
    assert none.returncode == 1 and "What would fit" in none.stdout
    bad = run_cli("plan", "--model", "llama-2-7b", "--gpu", "rtx4909")
    assert bad.returncode == 2 and "rtx4090" in bad.stderr and "Traceback" not in bad.stderr
    gpus = run_cli("gpus", "--json", "--no-detect")
    assert any(p["name"] == "a100-80gb" for p in json.loads(gpus.stdout)["profiles"])


def test_plan_does_not_import_torch():
    import subprocess

    code = ("import sys; from finetuner.cli.main import main; main(['plan','--model','llama-2-7b','--gpu','rtx4090','--json']);"
            "heavy=[m for m in ('torch','transformers','peft','datasets') if m in sys.modules]; print('HEAVY', heavy)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert "HEAVY []" in res.stdout, res.stdout[-300:] + res.stderr[-300:]


def test_run_resolves_auto_values_and_writes_the_plan(recipe_dict, tmp_path):
    recipe_dict["method"] = "auto"
    recipe_dict["training"].update({"micro_batch_size": "auto", "gradient_accumulation": "auto", "effective_batch": 4,
                                    "gradient_checkpointing": "auto", "max_steps": 2})
    path = write_recipe(tmp_path / "auto.yaml", recipe_dict)
    res = cli_in_process("run", str(path), "-q")
    assert res.returncode == 0, res.stderr[-2000:]
    run_dir = Path(recipe_dict["output_dir"])
    plan_doc = json.loads((run_dir / "plan.json").read_text())
    assert plan_doc["fits"] and plan_doc["gpu"]["platform"] in ("cpu", "cuda")
    saved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    t = saved["training"]
    assert saved["method"] in ("lora", "qlora") and t["micro_batch_size"] * t["gradient_accumulation"] == 4
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "plan" for e in events)
    # resuming keeps the resolved values instead of planning again
    res2 = cli_in_process("run", str(path), "-q", "--set", "training.max_steps=3")
    assert res2.returncode == 0, res2.stderr[-2000:]


def test_several_gpus_get_a_strategy_with_per_device_memory():
    four = plan("qwen2.5-32b", "a100-80gb", seq_len=2048, gpus=4, method="lora", cpu_memory="512GB")
    assert four.fits
    # LoRA of a 32B model on 4 x 80 GB: replicated it does not fit (its 61 GiB bf16 base and the rest), so the
    # parameters are sharded; ZeRO-3 fits without offload and wins, FSDP2 only with CPU offload (though it sends less:
    # its root unit, embeddings and LM head, is gathered once per micro-batch, not for forward and backward)
    assert four.recipe.distributed.num_processes == 4 and four.recipe.distributed.strategy == "zero3"
    by = {s["label"]: s for s in four.strategies}
    assert not by["ddp"]["fits"] and by["zero3"]["fits"] and by["fsdp + CPU offload"]["fits"]
    assert by["fsdp + CPU offload"]["comm_bytes_per_step"] < by["zero3"]["comm_bytes_per_step"]
    assert four.sharded.per_device_bytes < four.estimate.total_bytes and four.sharded.comm_bytes_per_step > 0
    assert four.recipe.training.gradient_accumulation % 4 == 0
    assert {s["strategy"] for s in four.strategies} >= {"ddp", "zero1", "zero2", "zero3"}
    small = plan("llama-2-7b", "rtx4090", seq_len=2048, gpus=2)
    assert small.fits and small.recipe.distributed.strategy == "ddp"  # fits replicated: least communication
    with pytest.raises(UserError):
        plan("llama-2-7b", "rtx4090", gpus=4, effective_batch=2)


def test_cli_plan_gpus_json():
    res = run_cli("plan", "--model", "llama-2-13b", "--gpu", "a100-40gb", "--gpus", "4", "--method", "lora", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["gpus"] == 4 and d["per_device"]["world_size"] == 4
    assert d["total_bytes"] == d["per_device"]["per_device_bytes"] == sum(d["components"].values())
    assert d["choice"]["strategy"] == d["per_device"]["strategy"]


@pytest.mark.parametrize("model, gpu", [("llama-2-13b", "a100-40gb"), ("qwen2.5-32b", "a100-80gb")])
def test_estimate_of_a_two_gpu_plan_shards_as_the_plan_did(tmp_path, model, gpu):
    """Sharding is decided once (:attr:`finetuner.planning.predict.Prediction.sharded`): ``finetuner estimate`` of
    the recipe ``plan --gpus 2`` wrote says the per-device memory, its parts, the strategy and the communication the
    plan chose, to the byte (a 13B model that fits each card replicated, a 32B one that must be sharded)."""
    out = tmp_path / "two.yaml"
    planned = cli_in_process("plan", "--model", model, "--gpu", gpu, "--gpus", "2", "--method", "lora", "--json",
                             "-o", str(out))
    assert planned.returncode == 0, planned.stderr[-2000:]
    est = cli_in_process("estimate", str(out), "--gpu", gpu, "--json")
    assert est.returncode == 0, est.stderr[-2000:]
    p, e = json.loads(planned.stdout)["per_device"], json.loads(est.stdout)["per_device"]
    assert p["world_size"] == e["world_size"] == 2
    for key in ("strategy", "offload", "per_device_bytes", "components", "comm_bytes_per_step"):
        assert e[key] == p[key], key


def test_plan_of_preference_pairs_plans_dpo_with_its_memory_and_sizing(tmp_path):
    """A file of pairs is planned as DPO (objective auto): searched with the objective's memory (two
    sequences per pair, the reference pass), not packed, at most 3 epochs, the preference learning rate;
    the written recipe trains as it is (`finetuner run`, as a user would)."""
    from finetuner.memory.model import estimate, settings_from_recipe
    from finetuner.objectives.specs.preference import LEARNING_RATES as PREFERENCE_LR, MAX_EPOCHS as PREFERENCE_MAX_EPOCHS

    pairs = REPO / "data" / "preference_sample.jsonl"
    p = plan("llama-3.1-8b", "rtx4090", data=str(pairs), seq_len=2048)
    r = p.recipe
    assert (r.objective, r.method, r.data.packing) == ("dpo", "lora", False)
    assert r.training.epochs <= PREFERENCE_MAX_EPOCHS and r.training.lr == PREFERENCE_LR["lora"]
    assert p.data["kind"] == "pairs" and p.data["format"] == "sharegpt_ranking"
    assert any(x.startswith("objective dpo: ") for x in p.reasons)
    # the plan's estimate is the memory model's for the written recipe, the preference term included
    from finetuner.data.stats import profile_data

    fraction = profile_data(str(pairs), "llama-3.1-8b", 2048).label_fraction
    est = estimate(p.shape, settings_from_recipe(r, p.gpu, p.shape.model_type).with_(label_fraction=fraction), p.gpu)
    assert est.allocated_bytes == p.estimate.allocated_bytes
    assert est.details["preference"]["rows"] == 2 * r.training.micro_batch_size
    # the same settings as SFT need less: the objective's cost is in the search
    as_sft = {**r.to_dict(), "objective": "sft"}
    as_sft.pop("preference", None)
    sft = estimate(p.shape, settings_from_recipe(Recipe.from_dict(as_sft), p.gpu, p.shape.model_type)
                   .with_(label_fraction=fraction), p.gpu)
    assert sft.allocated_bytes < est.allocated_bytes
    out = tmp_path / "dpo.yaml"
    made = run_cli("plan", "--model", str(REPO / "data" / "demo_model"), "--gpu", "cpu", "--data", str(pairs), "-o", str(out))
    assert made.returncode == 0, made.stderr
    assert "Plan: DPO with LORA" in made.stdout and "400 pairs (ShareGPT ranking)" in made.stdout
    raw = yaml.safe_load(out.read_text())
    assert raw["objective"] == "dpo" and raw["data"].get("packing", False) is False
    ran = cli_in_process("run", str(out), "--set", "training.max_steps=2", "--set", "data.max_examples=48",
                  "--output", str(tmp_path / "run"), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    steps = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    steps = [e for e in steps if e["event"] == "step"]
    assert len(steps) == 2 and "reward_accuracy" in steps[0]


def test_plan_of_rated_responses_plans_kto_and_an_objective_must_fit_the_data(tmp_path):
    rated = tmp_path / "rated.jsonl"
    rated.write_text("".join(json.dumps({"prompt": f"Question {i}?", "completion": f"Answer number {i}.", "label": i % 2 == 0}) + "\n"
                             for i in range(40)))
    demo = str(REPO / "data" / "demo_model")
    p = plan(demo, "cpu", data=str(rated))
    assert p.recipe.objective == "kto" and p.data["kind"] == "rated" and p.data["format"] == "kto_completion"
    assert plan(demo, "cpu", data=str(REPO / "data" / "preference_sample.jsonl"), objective="orpo").recipe.objective == "orpo"
    assert plan(demo, "cpu", data=str(REPO / "data" / "alpaca_sample.json"), objective="auto").recipe.objective == "sft"
    cases = [
        (["--data", str(REPO / "data" / "preference_sample.jsonl"), "--objective", "sft"],
         "preference_sample.jsonl: this file holds preference pairs", "Plan with objective dpo"),
        (["--data", str(REPO / "data" / "alpaca_sample.json"), "--objective", "dpo"],
         "alpaca_sample.json: this file holds supervised examples", "Plan with objective sft"),
        (["--data", str(rated), "--objective", "simpo"], "rated.jsonl: this file holds rated responses", "Plan with objective kto"),
        (["--objective", "dpo"], "--objective dpo: a preference objective needs --data", "--data PAIRS.jsonl"),
        (["--objective", "rlhf"], "--objective rlhf: not an objective", "auto, sft, neftune, dpo"),
    ]
    for args, message, hint in cases:
        r = run_cli("plan", "--model", demo, "--gpu", "cpu", *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert message in r.stderr and hint in r.stderr, r.stderr
        assert "--set" not in r.stderr  # plan has no --set: the hint names plan's own flag


def test_a_pair_is_measured_by_its_longer_side(tmp_path):
    """The profile of pairs: one length per pair, the longer of prompt + chosen and prompt + rejected;
    both responses count as trained; a bad pair is counted in a note with its row."""
    from finetuner.data.stats import CHARS_PER_TOKEN, TEMPLATE_TOKENS_PER_MESSAGE, profile_data

    rows = [{"prompt": "p" * 35, "chosen": "c" * 70, "rejected": "r" * 7},
            {"prompt": "q" * 35, "chosen": "same", "rejected": "same"},
            {"prompt": "s" * 7, "chosen": "c" * 7, "rejected": "r" * 350}]
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prof = profile_data(str(f))  # no model: 3.5 characters per token
    t = TEMPLATE_TOKENS_PER_MESSAGE
    assert CHARS_PER_TOKEN == 3.5 and (prof.kind, prof.format, prof.rows, prof.bad_rows) == ("pairs", "columns", 2, 1)
    assert prof.lengths == [10 + t + 20 + t, 2 + t + 100 + t]
    assert prof.trained_tokens == (20 + t) + (2 + t) + (2 + t) + (100 + t)
    assert prof.total_tokens == prof.trained_tokens + 2 * (10 + t) + 2 * (2 + t)
    assert "pairs.jsonl, line 2" in prof.notes[0] and "the same response" in prof.notes[0]


@pytest.mark.parametrize("method", ["lora", "full", "auto"])
def test_a_cpu_plan_chooses_torch_optimizers_never_paged_or_8bit_ones(method):
    """Paging is CUDA's (a paged optimizer on a CPU warns and falls back): a CPU plan never picks one."""
    for model in (str(Path(__file__).resolve().parents[2] / "data" / "demo_model"), "llama-3.2-1b"):
        p = plan(model, "cpu", seq_len=256, method=method)
        assert p.recipe.training.optimizer in ("adamw_torch", "adafactor"), (model, method, p.recipe.training.optimizer)


def test_a_plan_for_several_cards_opens_with_a_sentence_a_newcomer_reads():
    """Whether one card would do, what the strategy does, and what the extra cards save: the numbers of
    the one-card plan of the same job."""
    two = plan("llama-2-7b", "rtx4090", seq_len=2048, gpus=2)
    one = plan("llama-2-7b", "rtx4090", seq_len=2048)
    from finetuner.units import duration_text

    assert two.headline.startswith(f"One rtx4090 is enough for this run ({one.peak_bytes / 2**30:.1f} of 23.6 GiB); 2 save ")
    assert f"({duration_text(two.step_s)} instead of {duration_text(one.step_s)})" in two.headline
    assert two.headline.endswith("with DDP: each card holds the whole model and trains on its share of every step's rows.")
    big = plan("llama-2-13b", "rtx4090", seq_len=2048, gpus=2, method="lora", cpu_memory="64GB")
    assert not plan("llama-2-13b", "rtx4090", seq_len=2048, method="lora").fits
    assert big.headline == (f"One rtx4090 is not enough for this run; on 2 it fits ({big.sharded.per_device_bytes / 2**30:.1f} GiB "
                            "per card) with FSDP: the weights, gradients and optimizer states are sharded between the cards, "
                            "each layer gathered as it runs (with the shards kept in CPU memory).")  # 13B LoRA at 2,048: the
    # layer's whole backward transient counted (the H200 rows) leaves no room on the cards for the shards
    assert one.headline is None and two.to_dict()["headline"] == two.headline
    out = cli_in_process("plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--gpus", "2", "--seq-len", "2048")
    assert " ".join(out.stdout.split()).find("One rtx4090 is enough") < " ".join(out.stdout.split()).find("Plan:"), out.stdout


def test_a_chat_file_on_a_base_model_names_its_instruct_variant():
    from finetuner.model.shapes import instruct_variant

    repo = Path(__file__).resolve().parents[2]
    p = plan("qwen2.5-7b", "rtx4090", data=str(repo / "data" / "chat_sample.jsonl"))
    (note,) = [n for n in p.notes if "base model" in n]
    assert "its instruction-tuned variant Qwen/Qwen2.5-7B-Instruct" in note and "--model Qwen/Qwen2.5-7B-Instruct" in note
    assert not [n for n in plan("Qwen/Qwen2.5-7B-Instruct", "rtx4090", data=str(repo / "data" / "chat_sample.jsonl")).notes
                if "base model" in n]
    assert not [n for n in plan("qwen2.5-7b", "rtx4090", data=str(repo / "data" / "alpaca_sample.json")).notes if "base model" in n]
    assert (instruct_variant("llama-2-13b"), instruct_variant("gemma-2-9b"), instruct_variant("smollm2-135m-instruct"),
            instruct_variant("my/own-model")) == ("meta-llama/Llama-2-13b-chat-hf", "google/gemma-2-9b-it", None, None)

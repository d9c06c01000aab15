"""``finetuner plan`` for GRPO: a user brings prompts and a reward function; the plan searches method,
optimizer, checkpointing and micro-batch with GRPO's own memory terms (the rollout's KV cache, the loss over
the group, the reference pass), says the largest group size and completion length that fit its choice,
and writes a recipe that ``estimate`` and ``run`` read back."""

from __future__ import annotations

import json

import pytest
import yaml

from finetuner.config.hardware import get_gpu
from finetuner.config.recipe import Recipe
from finetuner.data.stats import profile_prompts
from finetuner.errors import UserError
from finetuner.memory.grpo import grpo_estimate, grpo_settings_of, largest_fit
from finetuner.memory.model import settings_from_recipe
from finetuner.model.shapes import resolve_shape
from finetuner.objectives.specs.grpo import GRPO
from finetuner.planning.planner import plan, plan_recipe
from finetuner.planning.recipe_data import run_optimizer_steps
from finetuner.planning.search import search
from finetuner.planning.predict import estimate_grpo, estimate_time
from finetuner.planning.sizing import SEQ_ROUND
from tests.conftest import REPO, cli_in_process, run_cli, write_recipe

PROMPTS = REPO / "data" / "alpaca_sample.json"
REWARDS = REPO / "recipes" / "rewards_demo.py"
WHISTLE = {"function": "mentions_whistle", "file": str(REWARDS)}


def _plan(model="llama-3.1-8b", gpu="rtx4090", **grpo):
    return plan(model, gpu, data=str(PROMPTS), grpo={"rewards": [WHISTLE], **grpo})


def _exact(recipe: Recipe, gpu: str):
    """The GRPO memory model's prediction for a resolved recipe, computed directly."""
    shape = resolve_shape(recipe.model.name)
    s = settings_from_recipe(recipe, get_gpu(gpu), shape.model_type)
    return shape, s, grpo_estimate(shape, s, grpo_settings_of(recipe), top_p=recipe.grpo.top_p < 1)


def test_the_plan_is_a_grpo_recipe_sized_on_the_prompts_with_the_grpo_step_memory():
    p = _plan(num_generations=8, max_new_tokens=512)
    assert p.fits and p.recipe.objective == "grpo"
    g = p.recipe.grpo
    assert (g.num_generations, g.max_new_tokens) == (8, 512)
    assert [(r.function, r.file) for r in g.rewards] == [("mentions_whistle", str(REWARDS))]
    prof = profile_prompts(str(PROMPTS), "llama-3.1-8b")
    assert p.data["kind"] == "prompts" and p.data["rows"] == prof.rows == 300
    # the sequence holds the longest prompt and the longest completion
    longest = prof.max_tokens + 512
    assert p.recipe.data.max_seq_len == -(-longest // SEQ_ROUND) * SEQ_ROUND and p.recipe.data.packing is False
    assert p.recipe.training.effective_batch_size == GRPO.default_effective_batch
    # the plan's peak is the GRPO step's (its phases, the generation's KV cache among the components) ...
    _, _, want = _exact(p.recipe, "rtx4090")
    assert p.estimate.total_bytes == want.total_bytes and p.estimate.peak_phase == want.peak_phase
    assert sum(p.estimate.components.values()) == p.estimate.total_bytes
    assert set(p.estimate.phases) >= {"generation", "loss forward/backward", "optimizer step"}
    # ... which is not the SFT step's at the same sequence
    sft = plan("llama-3.1-8b", "rtx4090", seq_len=p.recipe.data.max_seq_len, effective_batch=8)
    assert sft.recipe_choice() != p.recipe_choice() or sft.estimate.total_bytes != p.estimate.total_bytes
    # the plan's step time is the one estimate and the run's start event predict for its recipe
    assert p.step.step_s == pytest.approx(estimate_time(p.recipe, "rtx4090")["step_s"], rel=1e-12)
    # the written recipe reads back as it is, and the plan's optimizer steps are the run's
    again = Recipe.model_validate(p.recipe.to_dict())
    assert again.grpo == p.recipe.grpo and not again.auto_keys()
    assert p.optimizer_steps == run_optimizer_steps(again.model_copy(update={"training": again.training.model_copy(
        update={"max_steps": None})}))


def test_every_option_that_fits_fits_by_the_grpo_memory_model_and_the_choice_is_the_best_ranked():
    p = _plan(num_generations=8, max_new_tokens=512)
    base = Recipe.model_validate({**p.recipe.to_dict(), "method": "auto", "quantization": None, "training": {
        **p.recipe.training.model_dump(), "micro_batch_size": "auto", "gradient_accumulation": "auto", "optimizer": "auto",
        "gradient_checkpointing": "auto", "offload_activations": "auto", "effective_batch": 8}})
    gpu = get_gpu("rtx4090")
    ranked = search(base, resolve_shape("llama-3.1-8b"), gpu)
    assert len(ranked) > 10
    for c, r in ranked:
        _, _, want = _exact(r, "rtx4090")
        assert c.estimate.total_bytes == want.total_bytes
        assert c.fits == want.fits(c.estimate.budget_bytes)  # the planner's rule: the whole total (paged states too)
    best = next(c for c, _ in ranked if c.fits)
    assert p.recipe_choice()["micro_batch_size"] == best.option.micro_batch
    assert p.recipe.method == best.option.method and p.recipe.training.optimizer == best.option.optimizer


def test_the_plan_says_the_largest_group_and_completion_length_that_fit_its_choice():
    p = _plan(num_generations=8, max_new_tokens=512)
    shape, s, _ = _exact(p.recipe, "rtx4090")
    g = grpo_settings_of(p.recipe)
    budget = p.estimate.budget_bytes
    tokens = largest_fit(shape, s, g, budget, vary="max_new_tokens").max_new_tokens
    gens = largest_fit(shape, s, g, budget, vary="num_generations", scale_generation_batch=True).num_generations
    line = next(r for r in p.reasons if r.startswith("GRPO room"))
    assert f"max_new_tokens {tokens:,} at 8 generations" in line and f"num_generations {gens:,} at 512 tokens" in line
    assert tokens >= 512 and gens >= 8  # the choice fits, so its own values do
    # estimate of the written recipe says the same
    e = estimate_grpo(p.recipe, get_gpu("rtx4090"))
    assert e["fits"] and (e["largest_max_new_tokens"], e["largest_num_generations"]) == (tokens, gens)


def test_a_longer_rollout_moves_the_plan_to_a_smaller_footprint():
    short = _plan(num_generations=4, max_new_tokens=128)
    long = _plan(num_generations=16, max_new_tokens=2048)
    assert short.fits and long.fits
    assert short.recipe.method == "lora"
    # 16 x 2048 tokens of KV cache do not fit beside a 16-bit 8B base: the plan quantizes or shrinks the micro-batch
    assert (long.recipe.method, long.recipe.training.micro_batch_size) != (short.recipe.method, short.recipe.training.micro_batch_size)
    _, _, at_short_choice = _exact(Recipe.model_validate({**long.recipe.to_dict(), "method": short.recipe.method,
                                                           "quantization": None, "training": {
        **long.recipe.training.model_dump(), "micro_batch_size": short.recipe.training.micro_batch_size,
        "gradient_accumulation": short.recipe.training.gradient_accumulation,
        "gradient_checkpointing": short.recipe.training.gradient_checkpointing,
        "optimizer": short.recipe.training.optimizer}}), "rtx4090")
    assert at_short_choice.total_bytes > long.estimate.budget_bytes


def test_when_nothing_fits_the_plan_names_the_group_size_that_would_and_that_plan_fits():
    p = _plan(model="qwen2.5-14b", num_generations=16, max_new_tokens=4096)
    assert not p.fits and p.recipe is None
    fewer = next(s for s in p.suggestions if s.startswith("fewer completions"))
    n = int(fewer.split("num_generations ")[1].split()[0])
    assert 2 <= n < 16
    assert _plan(model="qwen2.5-14b", num_generations=n, max_new_tokens=4096).fits
    assert not _plan(model="qwen2.5-14b", num_generations=n + 1, max_new_tokens=4096).fits
    assert not any("several cards" in s or "shorter sequence" in s for s in p.suggestions)


@pytest.mark.parametrize("grpo, message", [
    ({}, "GRPO trains on rewards, and none is named"),
    ({"rewards": ["exact_mtch"]}, "reward 'exact_mtch': not a built-in reward"),
    ({"rewards": [{"function": "f", "file": "/nowhere/rewards.py"}]}, "reward 'f': /nowhere/rewards.py is not a file"),
    ({"rewards": [{"function": "no_such_reward", "file": str(REWARDS)}]}, "defines no top-level 'no_such_reward'"),
    ({"rewards": ["exact_match"], "num_generations": 1}, "num_generations"),
    ({"rewards": ["length_bounds"]}, "reward 'length_bounds': reward length_bounds: give min_length, max_length or both"),
    ({"rewards": [{"function": "exact_match", "args": {"colum": "answer"}}]}, "'colum' is not a setting of exact_match"),
])
def test_bad_grpo_settings_are_named(grpo, message):
    with pytest.raises(UserError, match=message):
        plan("llama-3.1-8b", "rtx4090", data=str(PROMPTS), objective="grpo", grpo=grpo)


def test_grpo_needs_prompts_and_one_card():
    with pytest.raises(UserError, match="GRPO generates completions of prompts"):
        plan("llama-3.1-8b", "rtx4090", grpo={"rewards": ["exact_match"]})
    with pytest.raises(UserError, match="the plan of a GRPO run is made for one card"):
        plan("llama-3.1-8b", "rtx4090", data=str(PROMPTS), gpus=2, grpo={"rewards": ["exact_match"]})
    with pytest.raises(UserError, match="GRPO settings .rewards. given, but the objective is sft"):
        plan("llama-3.1-8b", "rtx4090", data=str(PROMPTS), objective="sft", grpo={"rewards": ["exact_match"]})


def test_auto_values_in_a_grpo_recipe_are_resolved_with_the_grpo_terms(tmp_path):
    raw = yaml.safe_load((REPO / "recipes" / "demo_grpo_cpu.yaml").read_text())
    raw["model"]["name"] = "llama-3.1-8b"
    raw["method"] = "auto"
    raw["grpo"]["rewards"][0]["file"] = str(REWARDS)
    raw["data"].update(path=str(PROMPTS), max_seq_len=1024)
    raw["grpo"].update(max_new_tokens=768, num_generations=8)
    raw["training"].update(micro_batch_size="auto", gradient_accumulation="auto", gradient_checkpointing="auto",
                           optimizer="auto", effective_batch=8)
    r = Recipe.model_validate(raw)
    assert r.auto_keys()
    p = plan_recipe(r, "rtx4090")
    assert p.fits and not p.recipe.auto_keys()
    _, _, want = _exact(p.recipe, "rtx4090")
    assert p.estimate.total_bytes == want.total_bytes <= p.estimate.budget_bytes
    out = run_cli("estimate", str(write_recipe(tmp_path / "auto.yaml", raw)), "--gpu", "rtx4090", "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    d = json.loads(out.stdout)
    assert d["objective"] == "grpo" and d["total_bytes"] == want.total_bytes and d["resolved"] == p.recipe_choice()


def test_the_cli_plans_a_grpo_run_from_prompts_and_a_reward_file_and_estimate_agrees(tmp_path):
    out_path = tmp_path / "grpo.yaml"
    out = run_cli("plan", "--model", "llama-3.1-8b", "--gpu", "rtx4090", "--data", str(PROMPTS),
                  "--reward", f"{REWARDS}:mentions_whistle", "--reward", "length_bounds(min_length=4, max_length=80)",
                  "--num-generations", "8", "--max-new-tokens", "512", "-o", str(out_path))
    assert out.returncode == 0, out.stderr + out.stdout
    text = " ".join(out.stdout.split())
    assert "Plan: GRPO" in text and "GRPO room on this choice" in text and "generation: KV cache" in text
    assert "300 prompts (the prompt side of each row)" in text
    r = Recipe.from_yaml(out_path)
    assert r.objective == "grpo" and [x.function for x in r.grpo.rewards] == ["mentions_whistle", "length_bounds"]
    est = run_cli("estimate", str(out_path), "--gpu", "rtx4090", "--json")
    assert est.returncode == 0, est.stderr + est.stdout
    _, _, want = _exact(r, "rtx4090")
    assert json.loads(est.stdout)["total_bytes"] == want.total_bytes
    bad = run_cli("plan", "--model", "llama-3.1-8b", "--gpu", "rtx4090", "--data", str(PROMPTS), "--reward", "rewards.py:")
    assert bad.returncode != 0 and "write FILE.py:FUNCTION" in bad.stderr + bad.stdout and "Traceback" not in bad.stderr


def test_peer_preference_and_chat_files_are_planned_on_their_prompts(peer_data):
    for name in ("dpo_en_demo.json", "alpaca_en_demo.json"):
        prof = profile_prompts(str(peer_data / name), "llama-3.1-8b")
        assert prof.kind == "prompts" and prof.rows > 100
        p = plan("llama-3.1-8b", "a100-80gb", data=str(peer_data / name), grpo={"rewards": ["exact_match"],
                                                                                 "max_new_tokens": 256})
        assert p.recipe is not None and p.recipe.objective == "grpo"
        assert p.recipe.data.max_seq_len >= min(prof.max_tokens + 256, resolve_shape("llama-3.1-8b").max_position_embeddings)


def test_a_grpo_recipe_with_auto_values_runs_with_them_resolved(tiny_model_dir, tmp_path):
    from finetuner.runs.events import read_events
    from tests.objectives.test_grpo_run import grpo_recipe

    raw = grpo_recipe(tiny_model_dir, tmp_path, max_steps=1)
    raw["method"] = "auto"
    raw["training"].update(micro_batch_size="auto", gradient_accumulation="auto", gradient_checkpointing="auto",
                           optimizer="auto", effective_batch=4)
    out = cli_in_process("run", str(write_recipe(tmp_path / "auto.yaml", raw)), "--quiet")
    assert out.returncode == 0, out.stderr + out.stdout
    saved = Recipe.from_yaml(tmp_path / "grpo" / "recipe.yaml")
    assert not saved.auto_keys() and saved.objective == "grpo" and saved.method == "lora"  # QLoRA only when asked on a CPU
    t = saved.training
    assert t.micro_batch_size * t.gradient_accumulation == 4 and isinstance(t.gradient_checkpointing, bool)
    events = list(read_events(tmp_path / "grpo" / "events.jsonl"))
    start = next(e for e in events if e["event"] == "start")
    assert start["max_steps"] == 1 and start["predicted_speed"]["upper_bound"] is True
    assert [e["step"] for e in events if e["event"] == "step"] == [1]


def test_a_file_of_prompts_alone_planned_without_an_objective_is_pointed_to_grpo(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2+2?", "answer": "4"}\n{"prompt": "Name a colour.", "answer": "red"}\n')
    out = run_cli("plan", "--model", "llama-3.1-8b", "--gpu", "rtx4090", "--data", str(prompts))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "holds prompts without responses: that is data for objective grpo" in out.stderr
    assert "--objective grpo --reward FILE.py:FUNCTION" in out.stderr
    p = plan("llama-3.1-8b", "rtx4090", data=str(prompts), grpo={"rewards": ["exact_match"]})
    assert p.fits and p.recipe.objective == "grpo" and p.data["rows"] == 2

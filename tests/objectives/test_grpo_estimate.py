"""``finetuner estimate`` of a GRPO recipe: the GRPO step's memory (generation with its KV cache, the
loss over the group, the reference pass), not the SFT step's, and the largest group size and
completion length that fit the card."""

from __future__ import annotations

import json

from finetuner.config.hardware import get_gpu
from finetuner.config.recipe import Recipe
from finetuner.memory.grpo import grpo_estimate, grpo_settings_of
from finetuner.memory.model import settings_from_recipe
from finetuner.model.shapes import resolve_shape
from finetuner.planning.predict import estimate_grpo
from tests.conftest import REPO, run_cli

DEMO = REPO / "recipes" / "demo_grpo_cpu.yaml"
EIGHT_B = ["model.name=llama-3.1-8b", "data.max_seq_len=1024", "grpo.max_new_tokens=512", "grpo.num_generations=8",
           "training.micro_batch_size=1", "training.gradient_accumulation=4", "training.gradient_checkpointing=true",
           "method=qlora", "quantization.bits=4"]


def _recipe(*overrides: str) -> Recipe:
    return Recipe.from_yaml(DEMO, list(overrides))


def test_the_cli_estimates_the_grpo_step_of_the_demo_recipe(tmp_path):
    out = run_cli("estimate", str(DEMO), "--gpu", "rtx4090", "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    d = json.loads(out.stdout)
    r = _recipe()
    shape = resolve_shape(r.model.name)
    gpu = get_gpu("rtx4090")
    want = grpo_estimate(shape, settings_from_recipe(r, gpu, shape.model_type, label_fraction=1.0), grpo_settings_of(r),
                         top_p=r.grpo.top_p < 1)
    assert d["objective"] == "grpo" and d["total_bytes"] == want.total_bytes and d["fits"] is True
    assert d["components"]["generation: KV cache"] == want.components["generation: KV cache"] > 0
    assert set(d["phases"]) >= {"generation", "loss forward/backward", "optimizer step"}
    assert d["largest_max_new_tokens"] > r.grpo.max_new_tokens and d["largest_num_generations"] > r.grpo.num_generations
    # the time is the GRPO step's (the rollout's generation included), an upper bound at the longest lengths
    t = d["time"]
    assert t["upper_bound"] is True and t["optimizer_steps"] == r.training.max_steps
    assert t["parts_s"]["generation: decode"] > 0 and t["step_s"] == sum(t["parts_s"].values())


def test_the_largest_completion_length_and_group_size_are_the_edge_of_the_budget():
    r = _recipe(*EIGHT_B)
    gpu = get_gpu("rtx4090")
    got = estimate_grpo(r, gpu)
    shape = resolve_shape("llama-3.1-8b")
    s = settings_from_recipe(r, gpu, shape.model_type, label_fraction=1.0)
    g, top_p = grpo_settings_of(r), r.grpo.top_p < 1
    assert got["memory"].total_bytes == grpo_estimate(shape, s, g, top_p=top_p).total_bytes
    assert got["fits"] == (got["memory"].total_bytes <= got["budget_bytes"])
    for vary in ("max_new_tokens", "num_generations"):
        n = got[f"largest_{vary}"]
        assert n is not None and n > 1
        # the trainer generates micro_batch_size x num_generations rows at once: the batch grows with the group
        at = (lambda k: g.with_(num_generations=k, generation_batch=k)) if vary == "num_generations" else (lambda k: g.with_(max_new_tokens=k))
        assert grpo_estimate(shape, s, at(n), top_p=top_p).total_bytes <= got["budget_bytes"]
        assert grpo_estimate(shape, s, at(n + 1), top_p=top_p).total_bytes > got["budget_bytes"]


def test_a_group_too_large_for_the_card_exits_1_and_says_what_to_lower():
    args = [a for kv in EIGHT_B for a in ("--set", kv)]
    out = run_cli("estimate", str(DEMO), "--gpu", "rtx4090", *args, "--set", "grpo.num_generations=4096")
    assert out.returncode == 1, out.stderr + out.stdout
    assert "Does not fit" in out.stdout and "grpo.num_generations" in out.stdout
    assert "generation: KV cache" in out.stdout and "largest num_generations that fits" in out.stdout
    # the KV cache grows with the group: 4096 generations need more than the default 8
    small = estimate_grpo(_recipe(*EIGHT_B), get_gpu("rtx4090"))["memory"].components["generation: KV cache"]
    large = estimate_grpo(_recipe(*EIGHT_B, "grpo.num_generations=4096"), get_gpu("rtx4090"))["memory"].components["generation: KV cache"]
    assert large > 100 * small

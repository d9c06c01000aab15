"""GRPO's memory terms (finetuner/memory/grpo.py): the KV cache's arithmetic (and against a real cache
on the tiny model), the reference pass only with beta > 0, monotonicity, the largest group that fits."""

from __future__ import annotations

import json

import pytest

from finetuner.memory.grpo import (GrpoSettings, cache_dtype_bytes, grpo_components, grpo_estimate, kv_cache_bytes,
                                   largest_fit, loss_settings, sampling_bytes_per_logit)
from finetuner.memory.model import Settings, estimate
from finetuner.model.shapes import resolve_shape, shape_from_config

GiB = 1024**3


def shape():
    return resolve_shape("llama-3-8b")


S = Settings(method="qlora", micro_batch=4, gradient_checkpointing=True)
G = GrpoSettings(num_generations=8, max_new_tokens=512, prompt_len=256, prompts_per_step=2)


def test_kv_cache_arithmetic():
    sh = shape()
    assert (sh.num_layers, sh.num_kv_heads, sh.head_dim) == (32, 8, 128)
    assert kv_cache_bytes(sh, 16, 768, 2) == 2 * 32 * 8 * 128 * 16 * 768 * 2
    comp = grpo_components(sh, S, G)
    assert comp["generation: KV cache"] == 2 * 32 * 8 * 128 * (8 * 2) * (256 + 512) * 2  # rows 16, bf16
    assert comp["generation: KV cache growth (one layer copied)"] == 2 * 8 * 128 * 16 * 768 * 2
    # the cache's dtype: the compute dtype under autocast, else the stored weights' (fp32 for full)
    assert cache_dtype_bytes(S) == 2
    assert cache_dtype_bytes(S.with_(compute_dtype="fp32", weight_dtype="fp16")) == 2
    assert cache_dtype_bytes(S.with_(method="full", compute_dtype="fp32")) == 4
    # generation_batch caps the rows sampled at once
    capped = grpo_components(sh, S, G.with_(generation_batch=4))
    assert capped["generation: KV cache"] == kv_cache_bytes(sh, 4, 768, 2)


def test_kv_cache_matches_transformers_cache(tiny_model_dir):
    """The tiny model's DynamicCache after generate holds prompt + completion − 1 tokens (the last
    sampled token is never fed back): exactly the formula's bytes for that many tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    sh = shape_from_config(cfg, "tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows, prompt, new = 6, 5, 7
    ids = torch.randint(5, cfg["vocab_size"], (rows, prompt), generator=torch.Generator().manual_seed(0))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, return_dict_in_generate=True, use_cache=True, pad_token_id=0)
    cache = out.past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert held == kv_cache_bytes(sh, rows, prompt + new - 1, 4)
    assert held <= grpo_components(sh, Settings(method="lora", compute_dtype="fp32", weight_dtype="fp32"),
                                   GrpoSettings(num_generations=rows, max_new_tokens=new, prompt_len=prompt))["generation: KV cache"]


def test_beta_zero_has_no_reference_pass():
    off = grpo_estimate(shape(), S, G)
    assert off.components["reference pass"] == 0 and "reference pass" not in off.phases
    on = grpo_estimate(shape(), S, G.with_(beta=0.04))
    assert on.components["reference pass"] > 0 and "reference pass" in on.phases
    assert on.total_bytes >= off.total_bytes
    # the stored reference log-probabilities: one fp32 per completion token of the step
    assert on.components["loss: GRPO buffers"] - off.components["loss: GRPO buffers"] == 4 * G.rows * G.max_new_tokens
    # the chunked reference pass: one layer's temporaries plus 8 bytes × chunk × vocab
    assert on.components["reference pass"] > 8 * min(S.loss_chunk, 4 * 512) * shape().vocab_size


def test_the_loss_phase_is_the_sft_model_on_the_group_sequences():
    ls = loss_settings(S, G)
    assert (ls.micro_batch, ls.seq_len, ls.attention_mask, ls.label_fraction) == (4, 768, True, 512 / 768)
    m = grpo_estimate(shape(), S, G)
    assert m.phases["loss forward/backward"] == estimate(shape(), ls).phases["forward/backward"] + m.components["loss: GRPO buffers"]
    # a loss micro-batch larger than the step's rows is the rows
    assert loss_settings(S.with_(micro_batch=64), G).micro_batch == G.rows


@pytest.mark.parametrize("field, values", [
    ("num_generations", [1, 2, 4, 8, 16, 64]),
    ("max_new_tokens", [16, 128, 512, 2048, 8192]),
    ("prompt_len", [16, 256, 1024, 4096]),
    ("prompts_per_step", [1, 2, 4]),
])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_monotone_in_every_size(field, values, beta):
    totals = [grpo_estimate(shape(), S, G.with_(beta=beta, **{field: v})).total_bytes for v in values]
    kv = [grpo_components(shape(), S, G.with_(beta=beta, **{field: v}))["generation: KV cache"] for v in values]
    assert totals == sorted(totals) and kv == sorted(kv) and len(set(kv)) == len(kv)


def test_top_p_sampling_costs_more_per_logit():
    assert sampling_bytes_per_logit(S, True) > sampling_bytes_per_logit(S, False) == 2 + 4 + 4 + 4


def test_generation_phase_peaks_for_a_long_wide_group():
    """Many long completions and a small loss micro-batch: the KV cache makes generation the peak."""
    m = grpo_estimate(shape(), S.with_(micro_batch=1), G.with_(num_generations=64, max_new_tokens=4096))
    assert m.peak_phase == "generation"
    assert m.phases["generation"] > m.components["generation: KV cache"] > 32 * GiB


@pytest.mark.parametrize("vary", ["max_new_tokens", "num_generations"])
def test_largest_fit_is_the_boundary(vary):
    budget = int(24 * GiB * 0.95)
    best = largest_fit(shape(), S, G, budget, vary=vary)
    n = getattr(best, vary)
    assert n > 1 and grpo_estimate(shape(), S, best).total_bytes <= budget
    assert grpo_estimate(shape(), S, best.with_(**{vary: n + 1})).total_bytes > budget
    assert best.generated_tokens == best.num_generations * best.max_new_tokens
    assert largest_fit(shape(), S, G, 1 * GiB, vary=vary) is None  # the 4-bit 8B weights alone are more
    with pytest.raises(ValueError, match="vary"):
        largest_fit(shape(), S, G, budget, vary="prompt_len")


def test_a_larger_card_fits_more():
    small = largest_fit(shape(), S, G, 16 * GiB)
    large = largest_fit(shape(), S, G, 80 * GiB)
    assert small.max_new_tokens < large.max_new_tokens


def test_bad_settings():
    with pytest.raises(ValueError, match="num_generations"):
        GrpoSettings(num_generations=0)
    with pytest.raises(ValueError, match="generation_batch"):
        GrpoSettings(generation_batch=0)


def _allocated_peak(fn) -> int:
    """The peak of the bytes torch allocates on the CPU while ``fn`` runs (the profiler's per-op
    allocations and frees, summed in time order), counted from zero at the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.profiler.function_events
                    if e.self_cpu_memory_usage)
    cur = peak = 0
    for _, d in deltas:
        cur += d
        peak = max(peak, cur)
    return peak


def test_generation_terms_bound_what_generate_allocates():
    """On the CPU (fp32, no autocast), the generation phase's terms (KV cache, its growth copy, the larger
    of the prefill's layer temporaries and the sampling step's tensors) are at least what ``generate``
    allocates beyond the weights: a left-padded group of 16 rows, 96 prompt and 48 new tokens, top-p."""
    import torch

    from finetuner.model.tiny_llama import tiny_llama, train_bpe_tokenizer
    from tests.conftest import corpus

    tok = train_bpe_tokenizer(corpus(), vocab_size=400)
    model = tiny_llama(tok, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=768).eval()
    sh = shape_from_config(model.config.to_dict(), "tiny")
    rows, prompt, new = 16, 96, 48
    ids = torch.randint(5, model.config.vocab_size, (rows, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[: rows // 2, :10] = 0

    def run():
        with torch.no_grad():
            torch.manual_seed(0)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                           top_p=0.9, top_k=0, pad_token_id=0, use_cache=True)

    run()  # first call: lazy initialisations out of the measurement
    measured = _allocated_peak(run)
    comp = grpo_components(sh, Settings(method="lora", compute_dtype="fp32", weight_dtype="fp32", platform="cpu"),
                           GrpoSettings(num_generations=rows, max_new_tokens=new, prompt_len=prompt))
    predicted = (comp["generation: KV cache"] + comp["generation: KV cache growth (one layer copied)"]
                 + max(comp["generation: prefill layer temporaries"], comp["generation: logits and sampling"]))
    assert kv_cache_bytes(sh, rows, prompt + new - 1, 4) < measured <= predicted

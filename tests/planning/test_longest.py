"""The longest sequence a card trains (finetuner.planning.longest, `finetuner plan --longest`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from finetuner.config.hardware import get_gpu
from finetuner.errors import UserError
from finetuner.memory.model import estimate
from finetuner.model.shapes import resolve_shape
from finetuner.planning.longest import MIN_SEQ, longest_sequence
from finetuner.units import GiB

from tests.conftest import run_cli


def _fits(r, n: int) -> bool:
    """The planner's test, by the memory model, for the answer's settings at ``n`` tokens."""
    est = estimate(resolve_shape(r.model), r.settings.with_(seq_len=n), r.gpu, margin=r.margin)
    return est.total_bytes <= est.budget_bytes


@pytest.mark.parametrize("model,gpu,method", [
    ("llama-3.1-8b", "rtx4090", "qlora"),
    ("llama-3.1-8b", "rtx4090", "lora"),
    ("mistral-7b-v0.1", "10GB", "qlora"),  # 12 GB (rtx3060) reaches its 32k positions with a tiled MLP
    ("qwen2.5-7b", "a10g", "auto"),
    ("llama-3.2-1b", "t4", "lora"),
])
def test_the_answer_fits_and_one_step_more_does_not(model, gpu, method):
    r = longest_sequence(model, gpu, method)
    assert r.fits and not r.capped
    assert r.max_seq >= MIN_SEQ
    assert _fits(r, r.max_seq)
    assert not _fits(r, r.max_seq + 1)
    assert r.estimate.total_bytes <= r.budget_bytes < r.next_estimate.total_bytes
    # it is the longest of every setting it tried
    assert r.max_seq == max(c["max_seq"] for c in r.considered)


def test_a_coarser_step_gives_a_multiple_that_fits_and_the_next_multiple_does_not():
    r = longest_sequence("llama-3.1-8b", "rtx4090", "qlora", step=1024)
    assert r.max_seq % 1024 == 0
    assert _fits(r, r.max_seq) and not _fits(r, r.max_seq + 1024)
    exact = longest_sequence("llama-3.1-8b", "rtx4090", "qlora")
    assert exact.max_seq - 1024 < r.max_seq <= exact.max_seq


def test_8b_qlora_on_24gb_uses_offloaded_checkpointing_and_says_what_bounds_it():
    r = longest_sequence("llama-3.1-8b", "rtx4090", "qlora")
    c = r.candidate
    assert (c.method, c.quant_bits, c.gradient_checkpointing, c.offload_activations) == ("qlora", 4, True, True)
    assert r.recipe_values()["training.micro_batch_size"] == 1
    # each setting it searched costs length when taken away
    without_offload = longest_sequence("llama-3.1-8b", "rtx4090", "qlora", offload_activations=False)
    without_gc = longest_sequence("llama-3.1-8b", "rtx4090", "qlora", gradient_checkpointing=False, offload_activations=False)
    assert without_gc.max_seq < without_offload.max_seq < r.max_seq
    # the bound: an activation term, and the per-token growth is the estimate's own slope
    b = r.bound
    assert b["kind"] == "memory" and "activations" in b["component"]
    assert b["bytes_per_token"] == pytest.approx(max(r.bytes_per_token.values()), abs=0.05)  # rounded to 0.1
    shape = resolve_shape("llama-3.1-8b")
    lo = estimate(shape, r.settings.with_(seq_len=r.max_seq - 4096), r.gpu)
    slope = (r.estimate.total_bytes - lo.total_bytes) / 4096
    assert slope == pytest.approx(r.total_bytes_per_token, rel=0.01)
    assert r.fixed_bytes + r.total_bytes_per_token * r.max_seq == pytest.approx(r.estimate.total_bytes, rel=0.001)
    assert 0 < r.fixed_bytes < r.estimate.total_bytes
    assert r.layer_terms and b["layer_saved_bytes_per_token"] == pytest.approx(sum(x for _, x in r.layer_terms), abs=0.1)
    assert r.estimate.offloaded_bytes > 0 and any("pinned CPU memory" in n for n in r.notes)


def test_lora_dropout_costs_length():
    assert longest_sequence("llama-3.1-8b", "rtx4090", "qlora", lora_dropout=0.1).max_seq < \
        longest_sequence("llama-3.1-8b", "rtx4090", "qlora").max_seq


@pytest.mark.parametrize("model,method", [("llama-3.1-8b", "qlora"), ("llama-3.1-8b", "lora"), ("qwen2.5-14b", "qlora")])
def test_monotone_in_card_size(model, method):
    sizes = [8, 12, 16, 24, 32, 48, 64, 80, 96, 141]
    got = [longest_sequence(model, f"{gib}GB", method, step=64).max_seq for gib in sizes]
    assert got == sorted(got)
    positions = resolve_shape(model).max_position_embeddings
    # strictly longer on every bigger card that fits at all, until the positions cap it
    for a, b in zip(got, got[1:]):
        assert b > a or b == a == 0 or b == positions // 64 * 64
    assert got[-1] > got[0]


def test_capped_by_the_models_positions():
    r = longest_sequence("llama-2-7b", "h100-80gb", "lora")
    assert r.max_seq == r.positions == 4096
    assert r.capped and r.bound["kind"] == "positions" and "4,096" in r.bound["text"]
    assert _fits(r, r.positions)
    assert r.next_estimate is None
    # a step that does not divide the positions: the last multiple below them
    r = longest_sequence("llama-2-7b", "h100-80gb", "lora", step=1000)
    assert r.max_seq == 4000 and r.capped
    # among settings that all reach the cap, the simplest is reported
    assert not r.candidate.offload_activations


def test_a_shorter_position_limit_caps_a_card_that_would_allow_more():
    shape = resolve_shape("llama-3.1-8b")
    free = longest_sequence(shape, "rtx4090", "qlora")
    short = longest_sequence(replace(shape, max_position_embeddings=free.max_seq // 2), "rtx4090", "qlora")
    assert short.max_seq == free.max_seq // 2 and short.capped and not free.capped


def test_nothing_fits():
    r = longest_sequence("qwen2.5-14b", "t4", "lora")
    assert not r.fits and r.max_seq == 0 and r.candidate is None and r.recipe_values() is None
    assert r.bound["kind"] == "nothing fits" and "GiB" in r.bound["text"]
    assert json.loads(json.dumps(r.to_dict()))["fits"] is False


def test_a_smaller_margin_or_a_bigger_card_gives_longer():
    a = longest_sequence("llama-3.1-8b", "rtx4090", "qlora", margin=0.10)
    b = longest_sequence("llama-3.1-8b", "rtx4090", "qlora", margin=0.0)
    assert a.max_seq < b.max_seq
    assert longest_sequence("llama-3.1-8b", "rtx5090", "qlora").max_seq > b.max_seq


@pytest.mark.parametrize("kwargs,words", [
    (dict(gpu="cpu"), "CPU"),
    (dict(margin=1.5), "--margin"),
    (dict(margin=float("nan")), "--margin"),
    (dict(step=0), "step"),
    (dict(method="qlora16"), "--method"),
    (dict(optimizer="adam"), "optimizer"),
    (dict(kernels="triton"), "kernels"),
    (dict(gpu="no-such-card"), "no-such-card"),
])
def test_bad_input_is_a_user_error(kwargs, words):
    args = {"gpu": "rtx4090", **kwargs}
    gpu = args.pop("gpu")
    with pytest.raises(UserError) as e:
        longest_sequence("llama-3.1-8b", gpu, **args)
    assert words in str(e.value.message) + str(getattr(e.value, "hint", ""))


# ---------------------------------------------------------------------- the CLI
def test_cli_prints_the_longest_sequence_settings_and_bound():
    r = longest_sequence("llama-3.1-8b", "rtx4090", "qlora")
    p = run_cli("plan", "--model", "llama-3.1-8b", "--gpu", "rtx4090", "--method", "qlora", "--longest")
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert f"Longest sequence: {r.max_seq:,} tokens" in out
    assert "checkpointing, activation offload" in out and "paged_adamw_8bit" in out
    assert "Bound: memory: 'activations (layer backward)'" in out and "KB per token" in out


def test_cli_json():
    r = longest_sequence("llama-3.1-8b", "24GB", "lora", margin=0.1)
    p = run_cli("plan", "-m", "llama-3.1-8b", "-g", "24GB", "--method", "lora", "--margin", "0.1", "--longest", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["max_seq"] == r.max_seq and d["fits"] and not d["capped_by_positions"]
    assert d["recipe"]["data.max_seq_len"] == r.max_seq and d["recipe"]["method"] == "lora"
    assert d["bound"]["kind"] == "memory" and d["bound"]["bytes_per_token"] > 0
    assert d["budget_bytes"] == int(24 * GiB * 0.9)


def test_cli_capped_and_nothing_fits():
    p = run_cli("plan", "-m", "llama-2-7b", "-g", "h100-80gb", "--longest")
    assert p.returncode == 0, p.stderr
    assert "capped by the model's positions" in p.stdout and "4,096" in p.stdout
    p = run_cli("plan", "-m", "qwen2.5-14b", "-g", "t4", "--method", "lora", "--longest")
    assert p.returncode == 1 and "No sequence fits" in p.stdout and "Traceback" not in p.stderr


@pytest.mark.parametrize("extra,words", [
    (["--gpu", "cpu"], "CPU"),
    (["--gpu", "rtx4090", "--seq-len", "4096"], "--seq-len"),
    (["--gpu", "rtx4090", "--gpus", "2"], "--gpus"),
    (["--gpu", "rtx4090", "--cpu-memory", "64GB"], "--cpu-memory"),
    (["--gpu", "rtx4090", "-o", "x.yaml"], "-o/--output"),
    (["--gpu", "rtx4090", "--method", "nope"], "--method"),
])
def test_cli_bad_input_exits_2_without_traceback(extra, words):
    p = run_cli("plan", "-m", "llama-3.1-8b", "--longest", *extra)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert words in p.stderr and "Traceback" not in p.stderr


def test_help_says_how_to_ask_for_it():
    p = run_cli("plan", "--help")
    assert p.returncode == 0
    assert "--longest" in p.stdout and "longest sequence" in " ".join(p.stdout.split())

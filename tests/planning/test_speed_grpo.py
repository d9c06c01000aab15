"""The GRPO speed model (finetuner.planning.speed_grpo): each term's arithmetic, the recipe dispatch,
and the recorded runs replayed through it (no timing here: the measurements are in
docs/validation/speed_grpo_cpu.json and docs/benchmarks.md, written by scripts/validate/speed_grpo.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from finetuner.config.hardware import get_gpu
from finetuner.memory.grpo import GrpoSettings, kv_cache_bytes
from finetuner.memory.model import Settings
from finetuner.model.shapes import resolve_shape
from finetuner.planning import speed as sp
from finetuner.planning import speed_grpo as sg
from finetuner.planning.recipe_speed import recipe_step_time

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_model"
CALIBRATION = Path(__file__).with_name("speed_cpu.json")
VALIDATION = REPO / "docs" / "validation" / "speed_grpo_cpu.json"


@pytest.fixture(scope="module")
def demo():
    return resolve_shape(str(DEMO))


@pytest.fixture(scope="module")
def cpu_speed() -> sp.DeviceSpeed:
    return sp.DeviceSpeed.from_dict(json.loads(CALIBRATION.read_text()))


@pytest.fixture(scope="module")
def h100() -> sp.DeviceSpeed:
    return sp.DeviceSpeed.from_profile(get_gpu("h100"))


def cpu_settings(**kw) -> Settings:
    base = dict(method="lora", micro_batch=4, seq_len=128, compute_dtype="fp32", weight_dtype="fp32", platform="cpu",
                lora_dropout=0.0, attention_mask=True)
    return Settings(**{**base, **kw})


G = GrpoSettings(num_generations=4, max_new_tokens=32, prompt_len=48, prompts_per_step=4, generation_batch=16)


def test_the_parts_and_the_tokens(demo, cpu_speed):
    st = sg.grpo_step_time(demo, cpu_settings(), G, cpu_speed)
    names = list(st.parts)
    assert names[:3] == ["generation: prefill", "generation: decode", "reference/old log-probs"]
    assert names[-2:] == ["optimizer", "fixed"]
    assert all(n.startswith("training: ") for n in names[3:-2])
    assert all(v >= 0 for v in st.parts.values())
    # the trainer counts the real prompt + completion tokens of the step's rows
    assert st.tokens_per_step == G.rows * (G.prompt_len + G.max_new_tokens)
    assert st.micro_batches == G.rows // 4
    measured = sg.grpo_step_time(demo, cpu_settings(), G, cpu_speed, prompt_tokens=20.5, completion_tokens=11.25)
    assert measured.tokens_per_step == round(G.rows * (20.5 + 11.25))


def test_decode_scales_with_the_tokens_generated(demo, cpu_speed):
    s = cpu_settings()
    g = G.with_(generation_batch=8)  # 16 rows: two generate calls of 8
    a = sg.grpo_step_time(demo, s, g, cpu_speed, decode_steps=2 * 17).parts["generation: decode"]  # 2 calls of 17 tokens
    b = sg.grpo_step_time(demo, s, g, cpu_speed, decode_steps=2 * 9).parts["generation: decode"]
    # D - 1 decode forwards per call after the prefill, each at the mean cache length P + D/2, and D samplings
    def step(D):
        dev, ops = sg.decode_step_parts(demo, s, cpu_speed, 8, 48 + D / 2)
        return dev + ops + sg.sampling_seconds(demo, 8, cpu_speed)
    assert a == pytest.approx(2 * 16 * step(17))
    assert b == pytest.approx(2 * 8 * step(9))
    # the default is max_new_tokens per call
    d = sg.grpo_step_time(demo, s, g, cpu_speed).parts["generation: decode"]
    assert d == pytest.approx(sg.grpo_step_time(demo, s, g, cpu_speed, decode_steps=2 * 32).parts["generation: decode"])
    assert d == pytest.approx(2 * 31 * step(32))


def test_one_decode_step_counts_rows(demo, cpu_speed):
    s = cpu_settings()
    d8, o8 = sg.decode_step_parts(demo, s, cpu_speed, 8, 40)
    d16, o16 = sg.decode_step_parts(demo, s, cpu_speed, 16, 40)
    assert o8 == o16  # operations do not depend on the rows
    assert 1.0 < d16 / d8 <= 2.0 + 1e-9  # the linears' weight read is shared by the rows
    # sampling: rows x vocabulary at the CPU's sampling rate, nucleus sampling sorts on top
    assert sg.sampling_seconds(demo, 8, cpu_speed) == pytest.approx(8 * demo.vocab_size / sg.CPU_SAMPLING_ELEMENTS_PER_S)
    assert sg.sampling_seconds(demo, 8, cpu_speed, top_p=0.9) == pytest.approx(
        (1 + sg.TOP_P_SORT_FACTOR) * sg.sampling_seconds(demo, 8, cpu_speed))


def test_the_kv_cache_read_grows_with_the_cache(demo, h100):
    s = Settings(method="lora", micro_batch=1, seq_len=1024)
    shape = resolve_shape("llama-3.1-8b")
    short, _ = sg.decode_step_parts(shape, s, h100, 64, 128)
    long, _ = sg.decode_step_parts(shape, s, h100, 64, 4096)
    kv = lambda L: sg.kv_passes(shape) * kv_cache_bytes(shape, 64, L, 2) / h100.bandwidth_bytes_per_s  # noqa: E731
    assert sg.kv_passes(shape) == 3 + 2 * 4  # 32 query heads on 8 key/value heads: repeat_kv copies 4x
    # on the H100 the KV reads dominate attention at these lengths (bandwidth-bound)
    assert long - short == pytest.approx(kv(4096) - kv(128), rel=1e-6)


def test_beta_zero_has_no_reference_pass_and_iterations_amortise(demo, cpu_speed):
    s = cpu_settings()
    assert sg.grpo_step_time(demo, s, G, cpu_speed).parts["reference/old log-probs"] == 0
    ref = sg.grpo_step_time(demo, s, G.with_(beta=0.04), cpu_speed).parts["reference/old log-probs"]
    assert ref > 0
    # the rollout (generation and log-probabilities) is paid once per num_iterations steps
    one = sg.grpo_step_time(demo, s, G.with_(beta=0.04), cpu_speed)
    three = sg.grpo_step_time(demo, s, G.with_(beta=0.04, num_iterations=3), cpu_speed)
    for k in ("generation: prefill", "generation: decode"):
        assert three.parts[k] == pytest.approx(one.parts[k] / 3)
    # mu > 1 adds the old log-probabilities (adapter on) to the reference's (adapter off), both over 3 steps
    assert three.parts["reference/old log-probs"] > one.parts["reference/old log-probs"] / 3
    assert {k: v for k, v in three.parts.items() if k.startswith("training")} == \
        {k: v for k, v in one.parts.items() if k.startswith("training")}


def test_qlora_dequantizes_at_every_decode_step(demo, cpu_speed):
    lora = cpu_settings()
    q = cpu_settings(method="qlora", weight_dtype="fp32")
    dl, _ = sg.decode_step_parts(demo, lora, cpu_speed, 8, 40)
    dq, _ = sg.decode_step_parts(demo, q, cpu_speed, 8, 40)
    assert dq - dl >= demo.linear_weight_numel / cpu_speed.dequant_weights_per_s * (1 - 1e-9)
    a = sg.grpo_step_time(demo, lora, G, cpu_speed, decode_steps=2 * 20)
    b = sg.grpo_step_time(demo, q, G, cpu_speed, decode_steps=2 * 20)
    per = demo.linear_weight_numel / cpu_speed.dequant_weights_per_s
    assert b.parts["generation: decode"] - a.parts["generation: decode"] >= 2 * 19 * per * (1 - 1e-9)


def test_cuda_decode_is_max_of_device_work_and_operations(h100):
    """On a GPU a decode step takes max(device work, operations): a few rows are launch-bound (eager
    ``generate`` even of an 8B model), many rows over a long cache are bound by the KV reads."""
    s = Settings(method="lora", micro_batch=1, seq_len=256, lora_dropout=0.0)
    for shape, rows, cache, launch_bound in ((resolve_shape(str(DEMO)), 4, 96, True),
                                              (resolve_shape("llama-3.1-8b"), 4, 96, True),
                                              (resolve_shape("llama-3.1-8b"), 256, 2048, False)):
        dev, ops = sg.decode_step_parts(shape, s, h100, rows, cache)
        dev += sg.sampling_seconds(shape, rows, h100)
        assert (ops > dev) == launch_bound
        P, D = cache - 16, 32
        g = GrpoSettings(num_generations=rows, max_new_tokens=64, prompt_len=P, prompts_per_step=1, generation_batch=rows)
        decode = sg.grpo_step_time(shape, s, g, h100, decode_steps=D).parts["generation: decode"]
        assert decode == pytest.approx((D - 1) * max(dev, ops))
    # the device work reads every weight once per step at least
    dev, _ = sg.decode_step_parts(resolve_shape("llama-3.1-8b"), s, h100, 4, 96)
    assert dev >= resolve_shape("llama-3.1-8b").linear_weight_numel * 2 / h100.bandwidth_bytes_per_s


def test_recipe_dispatch(tmp_path, cpu_speed):
    from finetuner.config.hardware import cpu_profile
    from finetuner.config.recipe import Recipe
    from finetuner.memory.grpo import grpo_settings_of
    from finetuner.memory.model import settings_from_recipe

    recipe = Recipe.from_yaml(REPO / "recipes" / "demo_grpo_cpu.yaml")
    shape = resolve_shape(recipe.model.name)
    st = recipe_step_time(recipe, cpu_profile(), cpu_speed, shape=shape)
    s = settings_from_recipe(recipe, cpu_profile(), shape.model_type)
    direct = sg.grpo_step_time(shape, s, grpo_settings_of(recipe), cpu_speed, top_p=recipe.grpo.top_p)
    assert st.parts == direct.parts and st.tokens_per_step == direct.tokens_per_step
    assert "generation: decode" in st.parts
    g = grpo_settings_of(recipe)
    assert st.tokens_per_step == g.rows * g.seq_len


def test_the_step_takes_the_datas_prompts_and_stays_an_upper_bound_on_the_completions(cpu_speed):
    """With the data readable the rollout and the training passes are timed at the data's prompts (the mean
    prompt, the step's prompts padded to their longest: recipe_data.data_batch_of), the completions still at
    max_new_tokens (written during the run): an upper bound still, and shorter than at the longest prompts."""
    from finetuner.config.hardware import cpu_profile
    from finetuner.config.recipe import Recipe
    from finetuner.memory.grpo import grpo_settings_of
    from finetuner.memory.model import settings_from_recipe
    from finetuner.planning.recipe_data import data_batch_of

    recipe = Recipe.from_yaml(REPO / "recipes" / "demo_grpo_cpu.yaml")
    shape = resolve_shape(recipe.model.name)
    batch = data_batch_of(recipe)
    g = grpo_settings_of(recipe)
    assert batch is not None and batch.real_per_row < batch.padded_len < g.prompt_len
    timed = recipe_step_time(recipe, cpu_profile(), cpu_speed, shape=shape, batch=batch)
    longest = recipe_step_time(recipe, cpu_profile(), cpu_speed, shape=shape)
    assert timed.upper_bound and longest.upper_bound and timed.data_lengths and not longest.data_lengths
    s = settings_from_recipe(recipe, cpu_profile(), shape.model_type)
    direct = sg.grpo_step_time(shape, s, g, cpu_speed, top_p=recipe.grpo.top_p, prompt_tokens=batch.real_per_row,
                               prompt_width=batch.padded_len)
    assert timed.parts == direct.parts and timed.step_s < longest.step_s
    assert timed.tokens_per_step == round(g.rows * (batch.real_per_row + g.max_new_tokens))


def test_padding_widths(demo, cpu_speed):
    """The prefill and the KV cache run over the padded prompt width, the training passes over the
    micro-batch's padded width; the counted tokens stay the real ones."""
    s = cpu_settings()
    base = sg.grpo_step_time(demo, s, G, cpu_speed, prompt_tokens=20, completion_tokens=10, decode_steps=16)
    wide = sg.grpo_step_time(demo, s, G, cpu_speed, prompt_tokens=20, completion_tokens=10, decode_steps=16, prompt_width=30)
    assert wide.tokens_per_step == base.tokens_per_step == G.rows * 30
    assert wide.parts["generation: prefill"] > base.parts["generation: prefill"]
    assert wide.parts["generation: decode"] > base.parts["generation: decode"]
    # by default a micro-batch of several rows is as wide as the prompt width + the call's longest completion
    trained = {k: v for k, v in wide.parts.items() if k.startswith("training")}
    given = sg.grpo_step_time(demo, s, G, cpu_speed, prompt_tokens=20, completion_tokens=10, decode_steps=16, prompt_width=30,
                              train_width=30 + 16)
    assert trained == {k: v for k, v in given.parts.items() if k.startswith("training")}
    assert not base.upper_bound and sg.grpo_step_time(demo, s, G, cpu_speed).upper_bound


def test_a_cpu_matmul_over_few_rows_is_slower(demo, cpu_speed):
    """speed.py's CPU matmul rate falls off over few rows (CPU_MATMUL_HALF_ROWS): a decode step's few
    rows, a micro-batch of one short sequence; 1 at the calibration's own rows and on a GPU."""
    half = sp.CPU_MATMUL_HALF_ROWS
    calibrated = sp.DeviceSpeed.from_dict({**cpu_speed.to_dict(), "matmul_tokens": 1024})
    assert sp.matmul_row_efficiency(calibrated, 1024) == pytest.approx(1.0)
    assert sp.matmul_row_efficiency(calibrated, half) == pytest.approx(0.5 / (1024 / (1024 + half)))
    # a calibration that does not say at how many rows it measured: relative to many rows
    assert sp.matmul_row_efficiency(calibrated.__class__.from_dict({**cpu_speed.to_dict(), "matmul_tokens": None}), half) == 0.5
    assert sp.matmul_row_efficiency(sp.DeviceSpeed.from_profile(get_gpu("h100")), 4) == 1.0
    s = cpu_settings(micro_batch=1, seq_len=32)
    f, w = sp.forward_flops(demo, s), sp.typical_width(demo)
    p = sp._passes(s)
    raw = sum(f[k] * p[k] / cpu_speed.matmul_rate("fp32", w[k] if k != "lora" else 16) for k in f if f[k] and k != "attention")
    assert sp.matmul_seconds(demo, s, cpu_speed) == pytest.approx(raw / sp.matmul_row_efficiency(cpu_speed, 32))


def test_qlora_forward_counts_the_4bit_linears_operations(demo):
    lora, q = cpu_settings(), cpu_settings(method="qlora")
    extra = sg.forward_ops(demo, q) - sg.forward_ops(demo, lora)
    assert extra == pytest.approx(sg.QUANT_LINEAR_OPS["cpu"] * demo.linears_per_layer * demo.num_layers)
    # with the adapter off (the reference pass) LoRA's operations are not run
    assert sg.forward_ops(demo, lora, adapter=False) == pytest.approx(sg.forward_ops(demo, lora.with_(method="full")))


def test_decode_steps_of_a_rollout():
    from finetuner.objectives.grpo import decode_steps

    rows = [{"completion_ids": [0] * n} for n in (3, 5, 2, 2, 7, 1)]
    assert decode_steps(rows, 2) == 5 + 2 + 7
    assert decode_steps(rows, 6) == 7
    assert decode_steps(rows, 4) == 5 + 7


def test_recorded_runs_replay():
    """Each recorded configuration's two predictions (at the longest lengths, and with the measured
    lengths), recomputed from its recorded inputs by the current code, are the recorded ones; the errors
    are the recorded errors and the summary's; with the measured lengths every error is within the
    documented goal."""
    import statistics

    doc = json.loads(VALIDATION.read_text())
    goal = doc["goal_abs_error_pct"]
    rows = doc["rows"]
    assert len(rows) >= 8
    for row in rows:
        shape = resolve_shape(str(DEMO)) if row["model"] == "demo" else resolve_shape(row["model"])
        speed = sp.DeviceSpeed.from_dict(row["speed"])
        settings = dict(row["settings"])
        if isinstance(settings["lora_targets"], list):
            settings["lora_targets"] = tuple(settings["lora_targets"])
        s, g = Settings(**settings), GrpoSettings(**row["grpo"])
        bound = sg.grpo_step_time(shape, s, g, speed, top_p=row["top_p"])
        assert bound.upper_bound and bound.step_s == pytest.approx(row["predicted_step_s"], rel=1e-3, abs=1e-5), row["config"]
        given = sg.grpo_step_time(shape, s, g, speed, top_p=row["top_p"], **row["measured_lengths"])
        assert given.step_s == pytest.approx(row["predicted_step_s_measured_lengths"], rel=1e-3, abs=1e-5), row["config"]
        measured = row["measured_step_s"]
        # step times rounded to 1e-5 s, errors to 0.1
        for pred, key in ((bound.step_s, "error_pct"), (given.step_s, "error_pct_measured_lengths")):
            assert math.isclose(100 * (pred - measured) / measured, row[key], abs_tol=0.06 + 100 * 2e-5 / measured), (row["config"], key)
        assert abs(row["error_pct_measured_lengths"]) <= goal, row["config"]
        # docs/benchmarks.md: at the longest lengths the prediction was above every measured step
        assert row["error_pct"] > 0, row["config"]
    s = doc["summary"]
    assert s["configs"] == len(rows)
    assert s["median_abs_error_pct_measured_lengths"] == pytest.approx(statistics.median(abs(r["error_pct_measured_lengths"]) for r in rows), abs=0.06)
    assert s["max_abs_error_pct_measured_lengths"] == pytest.approx(max(abs(r["error_pct_measured_lengths"]) for r in rows), abs=0.06)
    assert s["median_abs_error_pct"] == pytest.approx(statistics.median(abs(r["error_pct"]) for r in rows), abs=0.06)
    # the matrix covers what it says: beta on and off, num_iterations 1 and 2, LoRA and QLoRA, nucleus sampling
    assert {0.0, 0.04} <= {r["grpo"]["beta"] for r in rows} and {1, 2} <= {r["grpo"]["num_iterations"] for r in rows}
    assert {"lora", "qlora"} <= {r["settings"]["method"] for r in rows} and any(r["top_p"] < 1 for r in rows)

"""The speed model (finetuner.planning.speed): each term of a step on its own, the recorded runs
replayed through it (no timing here: the measurements are in docs/validation/speed_model_*.json and
docs/benchmarks.md, written by scripts/validate/speed_model.py), and the calibration's plumbing."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from pathlib import Path

import pytest

from finetuner.config.hardware import get_gpu
from finetuner.memory.model import Settings
from finetuner.model.shapes import resolve_shape
from finetuner.planning import speed as sp

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_model"
CALIBRATION = Path(__file__).with_name("speed_cpu.json")


@pytest.fixture(scope="module")
def llama8b():
    return resolve_shape("llama-3.1-8b")


@pytest.fixture(scope="module")
def cpu_speed() -> sp.DeviceSpeed:
    return sp.DeviceSpeed.from_dict(json.loads(CALIBRATION.read_text()))


# ---------------------------------------------------------------------- the terms
def test_matmul_flops_count_the_passes(llama8b):
    s = Settings(method="lora", micro_batch=2, seq_len=512, lora_r=16)
    f = sp.matmul_flops(llama8b, s)
    T = 2 * 512
    N = llama8b.linear_weight_numel
    assert f["base forward"] == f["base input gradient"] == 2 * N * T
    assert f["base weight gradient"] == 0 and f["checkpointing recompute"] == 0 and f["reference pass"] == 0
    lora = sum(16 * (fin + fout) * k for _, fin, fout, k in sp.lora_targets(llama8b, "all-linear"))
    assert f["LoRA"] == 6 * lora * T
    full = sp.matmul_flops(llama8b, s.with_(method="full"))
    assert full["base weight gradient"] == 2 * N * T and full["LoRA"] == 0
    gc = sp.matmul_flops(llama8b, s.with_(gradient_checkpointing=True))
    # the recompute is one more forward of the decoder (base, LoRA, attention)
    assert gc["checkpointing recompute"] == pytest.approx(f["base forward"] + f["LoRA"] / 3 + f["attention"] / 3)
    # the chunked loss recomputes the head's forward: 3 head matmuls per labelled token, 2 without chunking
    assert f["LM head"] == pytest.approx(3 * 2 * llama8b.vocab_size * llama8b.hidden_size * T)
    assert sp.matmul_flops(llama8b, s.with_(loss_chunk=0))["LM head"] == pytest.approx(f["LM head"] * 2 / 3)
    half = sp.matmul_flops(llama8b, s.with_(label_fraction=0.5))
    assert half["LM head"] == pytest.approx(f["LM head"] / 2)


def test_attention_skips_the_masked_half_only_on_a_causal_kernel(llama8b):
    s = Settings(method="lora", micro_batch=1, seq_len=1024)
    causal = sp.matmul_flops(llama8b, s)["attention"]
    masked = sp.matmul_flops(llama8b, s.with_(attention_mask=True))["attention"]
    assert masked == 2 * causal
    assert sp.matmul_flops(llama8b, s.with_(platform="cpu"))["attention"] == masked  # the CPU's SDPA computes the square
    assert sp.matmul_flops(llama8b, s.with_(attn_implementation="flash_attention_2", attention_mask=True))["attention"] == causal
    assert masked == 3 * 4 * 1024 * llama8b.q_dim * llama8b.num_layers * 1024  # forward + backward (2x)


def test_preference_objectives_score_two_rows_and_dpo_adds_a_reference_pass(llama8b):
    sft = Settings(method="lora", micro_batch=2, seq_len=256)
    dpo = sft.with_(objective="dpo", reference="adapter_off")
    orpo = sft.with_(objective="orpo")
    assert sp.rows_per_micro_batch(sft) == 2 and sp.rows_per_micro_batch(dpo) == sp.rows_per_micro_batch(orpo) == 4
    f_dpo, f_orpo = sp.matmul_flops(llama8b, dpo), sp.matmul_flops(llama8b, orpo)
    assert f_orpo["reference pass"] == 0 and not sp.has_reference_pass(orpo)
    assert f_dpo["reference pass"] == pytest.approx(f_dpo["base forward"] + f_dpo["attention"] / 3 + f_dpo["LM head"] / 3)
    assert sp.matmul_flops(llama8b, dpo.with_(reference="precomputed"))["reference pass"] == 0
    assert sp.matmul_flops(llama8b, sft)["base forward"] * 2 == f_orpo["base forward"]
    assert sp.step_time(llama8b, dpo, sp.DeviceSpeed.from_profile(get_gpu("h100"))).tokens_per_step == 4 * 256


def test_dequantization_only_for_a_quantized_base(llama8b):
    h100 = sp.DeviceSpeed.from_profile(get_gpu("h100"))
    lora = Settings(method="lora", micro_batch=2, seq_len=2048)
    q4 = lora.with_(method="qlora", quant_bits=4)
    assert sp.dequant_seconds(llama8b, lora, h100) == 0
    two = sp.dequant_seconds(llama8b, q4, h100)  # forward and input gradient
    assert two == pytest.approx(2 * llama8b.linear_weight_numel / h100.dequant_weights_per_s)
    assert sp.dequant_seconds(llama8b, q4.with_(gradient_checkpointing=True), h100) == pytest.approx(1.5 * two)
    assert sp.dequant_seconds(llama8b, q4.with_(quant_bits=8), h100) == pytest.approx(sp.INT8_SLOWDOWN * two)


def test_memory_bound_work_follows_the_memory_models_saved_tensors(llama8b):
    s = Settings(method="lora", micro_batch=1, seq_len=512)
    m = sp.memory_bytes(llama8b, s)
    saved = sp.saved_bytes_per_token(llama8b, s) * 512
    assert m["activations"] == pytest.approx(saved * sp.TRAFFIC_PER_SAVED_BYTE)
    gc = sp.memory_bytes(llama8b, s.with_(gradient_checkpointing=True))
    assert gc["activations"] == pytest.approx(saved * (sp.TRAFFIC_PER_SAVED_BYTE + sp.FORWARD_TRAFFIC))
    assert m["logits"] == 4 * 2 * 512 * llama8b.vocab_size  # bf16 logits written and read, with their gradient
    assert sp.memory_bytes(llama8b, s.with_(compute_dtype="fp32"))["logits"] == 0  # no cast: the loss reads them directly


def test_optimizer_update_and_operations(llama8b):
    s = Settings(method="full", micro_batch=1, seq_len=128)
    n = llama8b.num_params
    assert sp.optimizer_bytes(llama8b, s) == 28 * n
    assert sp.optimizer_bytes(llama8b, s.with_(optimizer="adamw_8bit")) == 16 * n
    lora = Settings(method="lora", micro_batch=1, seq_len=128)
    # each LoRA target adds its operations to every layer's forward, and the backward 1.5x of them
    per_layer = sp.OPS_PER_LORA_TARGET * llama8b.linears_per_layer * llama8b.num_layers
    assert sp.op_count(llama8b, lora) - sp.op_count(llama8b, s) == pytest.approx(per_layer * (1 + sp.BACKWARD_OPS))


def test_a_gpu_hides_the_hosts_operations_behind_its_work_and_a_cpu_adds_them(llama8b, cpu_speed):
    s = Settings(method="lora", micro_batch=2, seq_len=2048)
    h100 = sp.step_time(llama8b, s, sp.DeviceSpeed.from_profile(get_gpu("h100")))
    assert h100.parts["operations"] == 0  # the device's work is far longer than queueing its kernels
    tiny = resolve_shape(str(DEMO))
    cpu = sp.step_time(tiny, Settings(method="lora", micro_batch=1, seq_len=128, platform="cpu", compute_dtype="fp32",
                                      weight_dtype="fp32"), cpu_speed)
    assert cpu.parts["operations"] > 0
    assert cpu.step_s == pytest.approx(sum(cpu.parts.values()))
    assert cpu.tokens_per_s == pytest.approx(128 / cpu.step_s)


def test_gradient_accumulation_repeats_the_micro_batch_not_the_update(llama8b):
    h100 = sp.DeviceSpeed.from_profile(get_gpu("h100"))
    one = sp.step_time(llama8b, Settings(method="full", micro_batch=1, seq_len=1024), h100)
    four = sp.step_time(llama8b, Settings(method="full", micro_batch=1, seq_len=1024, gradient_accumulation=4), h100)
    for part in ("matmuls", "attention", "memory-bound"):
        assert four.parts[part] == pytest.approx(4 * one.parts[part])
    assert four.parts["optimizer"] == one.parts["optimizer"] and four.tokens_per_step == 4 * 1024


def test_matmul_rate_interpolates_by_width(cpu_speed):
    table = cpu_speed.matmul_flops["fp32"]
    (w0, r0), (w1, r1) = table[2], table[3]
    mid = int(math.sqrt(w0 * w1))
    assert min(r0, r1) <= cpu_speed.matmul_rate("fp32", mid) <= max(r0, r1)
    assert cpu_speed.matmul_rate("fp32", table[0][0] // 2) == pytest.approx(table[0][1] / 2)
    assert cpu_speed.matmul_rate("fp32", 10**6) == table[-1][1]
    assert cpu_speed.matmul_rate("bf16", 64) == cpu_speed.matmul_rate("fp32", 64)  # unmeasured dtype: fp32's figures


def test_data_sheet_figures_say_so():
    s = sp.DeviceSpeed.from_profile(get_gpu("h100"))
    assert "data sheet" in s.source and not s.calibrated
    assert s.matmul_rate("bf16", 10**6) == pytest.approx(989e12 * sp.MATMUL_EFFICIENCY * 8192 / (8192 + sp.MATMUL_HALF_WIDTH))
    assert s.bandwidth_bytes_per_s == pytest.approx(3350e9 * sp.BANDWIDTH_EFFICIENCY)
    assert sp.DeviceSpeed.from_dict(json.loads(json.dumps(s.to_dict()))) == s


# ---------------------------------------------------------------------- recorded runs
def _recorded_h100_runs() -> dict[str, float]:
    """The Llama-3.1-8B rows of docs/benchmarks.md's first table: config → measured tokens/s."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    rows = {}
    for m in re.finditer(r"^\| Llama-3\.1-8B \| (QLoRA nf4|LoRA bf16), micro-batch 2, seq 2048, checkpointing, [^|]+\| ([\d,]+) \|", text, re.M):
        rows[m.group(1)] = float(m.group(2).replace(",", ""))
    return rows


def test_the_recorded_h100_runs_are_predicted_from_the_data_sheet_within_15_percent(llama8b):
    """docs/benchmarks.md: Llama-3.1-8B on one H100, micro-batch 2 x 2048 packed (a block mask reaches
    attention), checkpointing, bf16; LoRA with AdamW, QLoRA nf4 with paged AdamW 8-bit."""
    measured = _recorded_h100_runs()
    assert set(measured) == {"QLoRA nf4", "LoRA bf16"}, measured
    h100 = sp.DeviceSpeed.from_profile(get_gpu("h100"))
    base = Settings(method="lora", micro_batch=2, seq_len=2048, gradient_checkpointing=True, attention_mask=True)
    predicted = {
        "LoRA bf16": sp.step_time(llama8b, base, h100).tokens_per_s,
        "QLoRA nf4": sp.step_time(llama8b, base.with_(method="qlora", quant_bits=4, optimizer="paged_adamw_8bit"), h100).tokens_per_s,
    }
    for k, tps in predicted.items():
        assert abs(tps - measured[k]) / measured[k] <= 0.15, (k, tps, measured[k])
    assert predicted["QLoRA nf4"] < predicted["LoRA bf16"]  # dequantization costs time


def _validation_files() -> list[Path]:
    return sorted((REPO / "docs" / "validation").glob("speed_model_*.json"))


def test_there_is_a_recorded_validation_of_this_machine():
    names = [p.name for p in _validation_files()]
    assert "speed_model_cpu.json" in names, names


@pytest.mark.parametrize("path", _validation_files(), ids=lambda p: p.name)
def test_the_recorded_matrix_replays_through_the_model_and_meets_its_claims(path):
    """Each row's prediction is what the model says today for the row's settings and calibration;
    the summary's errors are the rows' errors; the goals (median <= 10 %, largest <= 25 %) hold."""
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert len(rows) >= 10
    errors = []
    for r in rows:
        for key in ("config", "device", "predicted_tokens_per_s", "measured_tokens_per_s", "predicted_step_s", "measured_step_s"):
            assert key in r, (r["config"], key)
        shape = resolve_shape(str(DEMO) if r["model"] == "demo" else r["model"])
        settings = dict(r["settings"])
        if isinstance(settings["lora_targets"], list):
            settings["lora_targets"] = tuple(settings["lora_targets"])
        st = sp.step_time(shape, Settings(**settings), sp.DeviceSpeed.from_dict(r["speed"]))
        assert st.step_s == pytest.approx(r["predicted_step_s"], rel=1e-3, abs=1e-4), r["config"]
        assert st.tokens_per_s == pytest.approx(r["predicted_tokens_per_s"], rel=1e-3), r["config"]
        # measured_step_s is rounded to 1e-4 s and tokens/s to 0.1: the bounds of that rounding
        step = r["measured_step_s"]
        assert r["tokens_per_step"] / (step + 5e-5) - 0.05 <= r["measured_tokens_per_s"] <= r["tokens_per_step"] / (step - 5e-5) + 0.05
        err = 100 * (r["predicted_tokens_per_s"] - r["measured_tokens_per_s"]) / r["measured_tokens_per_s"]
        # both tokens/s rounded to 0.1 (at most 0.07 % of the smallest, ~80 tokens/s, each) and error_pct to 0.1
        tol = 0.05 + 100 * 0.05 * (1 / r["predicted_tokens_per_s"] + 1 / r["measured_tokens_per_s"]) * (1 + abs(err) / 100)
        assert err == pytest.approx(r["error_pct"], abs=tol)
        errors.append((abs(r["error_pct"]), tol))
    s = doc["summary"]
    assert s["configs"] == len(rows)
    assert s["median_abs_error_pct"] == pytest.approx(statistics.median(e for e, _ in errors), abs=0.06)
    assert s["max_abs_error_pct"] == pytest.approx(max(e for e, _ in errors), abs=0.06)
    assert s["median_abs_error_pct"] <= 10 and s["max_abs_error_pct"] <= 25
    assert {"sft", "dpo"} <= {r["settings"]["objective"] for r in rows}
    assert {"lora", "full", "qlora"} <= {r["settings"]["method"] for r in rows}
    assert {True, False} <= {r["settings"]["gradient_checkpointing"] for r in rows}


# ---------------------------------------------------------------------- calibration plumbing
def test_a_calibration_file_is_what_plans_for_this_machine_use(monkeypatch):
    from finetuner.config.hardware import cpu_profile
    from finetuner.planning.calibrate import SPEED_FILE_ENV, speed_for

    monkeypatch.setenv(SPEED_FILE_ENV, str(CALIBRATION))
    s = speed_for(cpu_profile())
    assert s.calibrated and s.source.startswith("calibrated on this machine")
    assert speed_for(get_gpu("rtx4090")).source.startswith("rtx4090 data sheet")  # another card: its data sheet


def test_a_broken_calibration_file_is_a_user_error(tmp_path, monkeypatch):
    from finetuner.config.hardware import cpu_profile
    from finetuner.errors import UserError
    from finetuner.planning.calibrate import SPEED_FILE_ENV, speed_for

    bad = tmp_path / "speed.json"
    bad.write_text("{not json")
    monkeypatch.setenv(SPEED_FILE_ENV, str(bad))
    with pytest.raises(UserError, match="not a speed calibration"):
        speed_for(cpu_profile())


def test_gpus_calibrate_measures_caches_and_plans_for_this_machine_use_it(tmp_path, monkeypatch, capsys):
    """`finetuner gpus --calibrate` on the CPU: the same code as on a GPU; the cached figures are what a
    plan for this machine then reads (no second measurement). Sizes cut down: this checks the plumbing,
    not the figures."""
    from finetuner.cli.main import main
    from finetuner.config.hardware import cpu_profile
    from finetuner.planning import calibrate

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibrate.SPEED_FILE_ENV, raising=False)
    monkeypatch.setattr(calibrate, "MEASURE_S", 0.0)
    monkeypatch.setattr(calibrate, "CPU_WIDTHS", (16, 64))
    assert main(["gpus", "--calibrate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["matmul_gflops"]["fp32"]) == {"16", "64"} or set(out["matmul_gflops"]["fp32"]) == {16, 64}
    assert out["bandwidth_gbs"] > 0 and out["op_overhead_us"] > 0 and out["attention_gflops"]["causal"]
    assert out["cores"] == os.cpu_count() and out["load_average"] >= 0  # the load it was made under
    assert out["timed_by"] == ("cpu time" if out["threads"] == 1 else "wall clock")
    cached = Path(out["cached_in"])
    assert cached.is_file() and cached.is_relative_to(tmp_path / "speed")
    monkeypatch.setattr(calibrate, "measure", lambda: pytest.fail("measured again instead of reading the cache"))
    speed = calibrate.speed_for(cpu_profile())
    assert speed.calibrated and speed.source == out["source"]


def test_gpus_says_where_the_calibration_lives(tmp_path, monkeypatch):
    """`finetuner gpus` names the calibration file of this machine (the cache every front shares), whether it is
    measured, and a $FINETUNER_SPEED_FILE used instead."""
    from finetuner.planning import calibrate
    from tests.conftest import cli_in_process

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibrate.SPEED_FILE_ENV, raising=False)
    r = cli_in_process("gpus")
    expected = calibrate.cache_file(calibrate.device_key()[1])
    assert expected.parent == tmp_path / "speed"
    assert f"Speed calibration: {expected} (not measured yet" in " ".join(r.stdout.split()), r.stdout
    calibrate.save(calibrate.load(CALIBRATION), expected)
    r = cli_in_process("gpus", "--json")
    assert json.loads(r.stdout)["calibration"] == {"folder": str(tmp_path / "speed"), "file": str(expected), "cached": True,
                                                   "speed_file": None}
    assert f"cached in {tmp_path / 'speed'} " in " ".join(cli_in_process("gpus", "--no-detect").stdout.split())
    monkeypatch.setenv(calibrate.SPEED_FILE_ENV, str(CALIBRATION))
    assert f"Speed calibration: {CALIBRATION} ($FINETUNER_SPEED_FILE" in " ".join(cli_in_process("gpus", "--no-detect").stdout.split())


def test_plan_reports_time_and_cost_and_compares_cards(capsys):
    from finetuner.cli.main import main

    args = ["plan", "--model", str(DEMO), "--gpu", "cpu", "--data", str(REPO / "data" / "alpaca_sample.json"),
            "--price-per-hour", "3", "--json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["optimizer_steps"] > 0 and d["predicted_step_s"] > 0
    assert d["predicted_steps_s"] == pytest.approx(d["optimizer_steps"] * d["predicted_step_s"], abs=0.05 + 1e-3 * d["predicted_steps_s"])  # rounded to 0.1 s
    assert d["predicted_wall_s"] == pytest.approx(d["predicted_wait"]["wall_s"], abs=0.06)
    assert d["predicted_wall_s"] > d["predicted_steps_s"]
    assert d["predicted_cost"] == pytest.approx(d["predicted_wall_s"] / 3600 * 3, abs=1e-4)
    assert d["speed_source"].startswith("calibrated on this machine")
    assert main(["plan", "--model", "llama-3.1-8b", "--seq-len", "2048", "--compare-cards", "rtx4090,a100-80gb,h100", "--json"]) == 0
    rows = {r["card"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["rtx4090", "a100-80gb", "h100-80gb"] and all(r["fits"] for r in rows.values())
    assert rows["h100-80gb"]["tokens_per_s"] > rows["a100-80gb"]["tokens_per_s"]
    assert all("data sheet" in r["speed_source"] and r["recipe"] for r in rows.values())
    assert main(["plan", "--model", "llama-3.1-8b", "--seq-len", "2048", "--compare-cards", "rtx4090,h100"]) == 0
    out = capsys.readouterr().out
    assert "rtx4090" in out and "h100-80gb" in out and "tokens/s" in out

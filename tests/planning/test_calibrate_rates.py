"""The calibration's arithmetic on synthetic timings (finetuner.planning.calibrate.matmul_rates) and what the
speed model charges with it (finetuner.planning.speed.op_seconds): no timing is measured here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from finetuner.memory.model import Settings
from finetuner.model.shapes import resolve_shape
from finetuner.planning import wait
from finetuner.planning.calibrate import load, matmul_rates
from finetuner.planning.speed import EAGER_OP_FACTOR, PARALLEL_GRAIN, forward_op_count, op_seconds

REPO = Path(__file__).resolve().parents[2]
SPEED = load(Path(__file__).with_name("speed_cpu.json"))
TOKENS = 1024


def timings(fixed: float, rate: float, widths=(16, 32, 64, 128, 256, 512, 1024)) -> list[tuple[int, float]]:
    """What each [TOKENS x w] @ [w x w] product takes at ``rate`` FLOP/s after a fixed ``fixed`` seconds."""
    return [(w, fixed + 2.0 * TOKENS * w * w / rate) for w in widths]


def test_the_fixed_part_is_not_read_as_a_slow_rate():
    # this machine under load 9: every product waits ~20 ms for its threads, then computes at 60 GFLOP/s.
    # Per FLOP (the old table) width 16 read 2*1024*16*16 / 20 ms = 26 MFLOP/s; here it gets at least the best
    # gross rate, and the widths whose work is over half their time get their net rate.
    rows = dict(matmul_rates(TOKENS, timings(0.020, 60e9)))
    fixed16 = 0.020 + 2.0 * TOKENS * 16 * 16 / 60e9
    gross_peak = 2.0 * TOKENS * 1024**2 / (0.020 + 2.0 * TOKENS * 1024**2 / 60e9)
    assert rows[16] == pytest.approx(gross_peak) and rows[256] == pytest.approx(gross_peak)
    # 1024: 35.8 ms of work after 20 ms (>= 2 x the narrowest product's 20.009 ms): its own net rate, the
    # narrowest product's negligible work (8.7 us) subtracted with the fixed part
    net = 2.0 * TOKENS * 1024**2 / (2.0 * TOKENS * 1024**2 / 60e9 - 2.0 * TOKENS * 16 * 16 / 60e9)
    assert rows[1024] == pytest.approx(net) and net == pytest.approx(60e9, rel=1e-3)
    assert min(rows.values()) > 1000 * 2.0 * TOKENS * 16 * 16 / fixed16  # a thousand times the per-FLOP reading


def test_an_idle_machine_keeps_its_rates_by_width():
    # no fixed part to speak of (1 us): each width about its own rate, the narrowest at the best gross rate
    per_width = {16: 30e9, 32: 50e9, 64: 80e9, 128: 95e9, 256: 100e9, 512: 90e9, 1024: 60e9}
    t = [(w, 1e-6 + 2.0 * TOKENS * w * w / r) for w, r in per_width.items()]
    rows = dict(matmul_rates(TOKENS, t))
    t16 = t[0][1]
    for w, sec in t[2:]:  # the narrowest product's own work (17 us) is subtracted too: off by at most t16 / (sec - t16)
        assert rows[w] == pytest.approx(per_width[w], rel=t16 / (sec - t16)) and rows[w] >= per_width[w]
    assert rows[1024] == pytest.approx(per_width[1024], rel=0.001)
    assert rows[16] == pytest.approx(max(2.0 * TOKENS * w * w / s for w, s in t))


def test_noise_below_the_fixed_part_never_inflates_a_rate():
    # under load a narrow product's median varies by more than its work: 20 ms, 21 ms, 19.5 ms for tiny FLOPs
    t = [(16, 0.0200), (32, 0.0210), (64, 0.0195), (1024, 0.0600)]
    rows = dict(matmul_rates(TOKENS, t))
    gross = max(2.0 * TOKENS * w * w / s for w, s in t)
    assert max(rows.values()) <= 2.0 * TOKENS * 1024**2 / (0.0600 - 0.0195) + 1
    assert rows[16] == rows[32] == rows[64] == pytest.approx(gross)


def test_a_micro_batch_pays_the_wait_for_the_threads_and_a_decode_step_does_not():
    busy = replace(SPEED, parallel_op_s=0.02)
    bare = SPEED.op_overhead_s * EAGER_OP_FACTOR
    assert op_seconds(busy, PARALLEL_GRAIN) == pytest.approx(bare + 0.02)
    assert op_seconds(busy, PARALLEL_GRAIN - 1) == pytest.approx(bare) == op_seconds(SPEED, PARALLEL_GRAIN)


def test_the_demo_models_decode_token_is_its_operations_and_its_weights():
    # One decode token of the demo model (4 layers, hidden 128, LoRA r 16 on all linears) at seq_len 1: its
    # forward's operations, generate's, and its work. Its matmuls are ~2 x 1.4 M FLOPs: at the calibration's
    # rates (>= 1 GFLOP/s everywhere in speed_cpu.json), even at the 1/18 row efficiency of one row, under 50 ms;
    # so the token is the operations' time at most + that; a wait for the threads (20 ms) does not enter it.
    shape = resolve_shape(str(REPO / "data" / "demo_model"))
    s = Settings(platform="cpu", method="lora", lora_r=16, lora_targets="all-linear", compute_dtype="fp32",
                 weight_dtype="fp32", seq_len=64, micro_batch=8)
    busy = replace(SPEED, parallel_op_s=0.02)
    token = wait.decode_token_seconds(shape, s, busy)
    assert token == pytest.approx(wait.decode_token_seconds(shape, s, SPEED))
    one = s.with_(micro_batch=1, seq_len=1, label_fraction=1.0, loss_chunk=0)
    ops = (forward_op_count(shape, one) + wait.GENERATE_OPS_PER_TOKEN + 2 * shape.num_layers) * SPEED.op_overhead_s * EAGER_OP_FACTOR
    assert ops <= token <= ops + 0.05


def test_a_calibration_made_by_another_way_of_measuring_is_measured_again(tmp_path, monkeypatch):
    """The cache file names this module's source (calibrate.method_key): a calibration that an older way of
    measuring left in the cache (the one kept from before matmul_rates subtracted the fixed part predicted
    1,086 s a step for a 15 s one) is not read; this one's is, without measuring."""
    from finetuner.planning import calibrate

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibrate.SPEED_FILE_ENV, raising=False)
    name = calibrate.device_key()[1]
    current = calibrate.cache_file(name)
    assert current.name.endswith(f"-method-{calibrate.method_key()}.json")
    older = current.with_name(current.name.replace(calibrate.method_key(), "0" * 8))
    calibrate.save(SPEED, older)
    assert calibrate.cached(measure_if_missing=False) is None
    # the module with one line of its measuring changed (a copy, imported as its own module) names another file
    import importlib.util

    source = Path(calibrate.__file__).read_text(encoding="utf-8")
    changed = tmp_path / "calibrate_changed.py"
    changed.write_text(source.replace("def matmul_rates(", "# measured another way\ndef matmul_rates(", 1), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("calibrate_changed", changed)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    assert other.method_key() != calibrate.method_key() and other.cache_file(name) != current
    calibrate.save(SPEED, current)
    monkeypatch.setattr(calibrate, "measure", lambda: pytest.fail("measured again instead of reading the cache"))
    assert calibrate.cached(measure_if_missing=True).source == SPEED.source

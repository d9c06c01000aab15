"""A calibration records the load it was made under; the estimate says when the machine is busier now
(finetuner/planning/load.py): the rule's arithmetic, and `finetuner estimate` with a calibration file
recorded under another load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from finetuner.planning.load import busier_note, growth, stale_under_load
from finetuner.planning.speed import DeviceSpeed
from tests.conftest import cli_in_process

REPO = Path(__file__).resolve().parents[2]
SPEED = REPO / "tests" / "planning" / "speed_cpu.json"


def calibration(load: float | None, cores: int, timed_by: str, platform: str = "cpu") -> DeviceSpeed:
    d = json.loads(SPEED.read_text())
    d["platform"] = platform
    d["details"] = {**d["details"], "cores": cores, "timed_by": timed_by}
    if load is not None:
        d["details"]["load_average"] = load
    return DeviceSpeed.from_dict(d)


def test_times_grow_by_the_share_of_a_core_now_over_then():
    wall = calibration(3.0, 2, "wall clock")  # made while 3 tasks shared 2 cores: its rates carry 1.5x
    assert growth(wall, 8.0, 2) == pytest.approx((8 / 2) / (3 / 2))
    assert busier_note(wall, 8.0, 2) == ("the machine is busier now: load 8.0 on 2 cores (load 3.0 at calibration), "
                                         "so times may be up to 2.7x longer than planned")
    cpu_time = calibration(3.0, 2, "cpu time")  # timed by CPU time: an idle core's rates whatever the load
    assert growth(cpu_time, 8.0, 2) == pytest.approx(4.0)
    assert calibration(0.5, 2, "wall clock").details["load_average"] == 0.5
    assert growth(calibration(0.5, 2, "wall clock"), 8.0, 2) == pytest.approx(4.0)  # under the cores then: alone
    assert growth(calibration(None, 2, "wall clock"), 5.0, 2) == pytest.approx(2.5)  # an older calibration: no load
    assert busier_note(wall, 1.9, 2) is None  # not above the cores
    assert busier_note(wall, 2.9, 2) is None  # above the cores, but less busy than at calibration
    assert busier_note(calibration(0.5, 2, "wall clock", platform="cuda"), 8.0, 2) is None  # a GPU waits for the card


def test_estimate_and_plan_say_the_machine_is_busier_than_at_calibration(tmp_path, monkeypatch):
    """The load now is the one the threads were chosen for (finetuner/threads.py: other processes' tasks,
    ``$FINETUNER_LOAD`` here) plus the run's own threads."""
    import finetuner.threads as threads

    cores = threads.cores()
    d = json.loads(SPEED.read_text())
    d["details"] = {**d["details"], "load_average": cores / 2, "cores": cores, "timed_by": "wall clock"}
    speed_file = tmp_path / "speed.json"
    speed_file.write_text(json.dumps(d))
    monkeypatch.setenv("FINETUNER_SPEED_FILE", str(speed_file))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    kept = dict(threads._chosen)
    monkeypatch.setattr(threads, "_chosen", {})  # each command chooses for the load it is given

    def estimate(load: float, *args: str):
        threads._chosen.clear()
        return cli_in_process("estimate", str(REPO / "recipes" / "demo_cpu.yaml"), *args,
                              env={threads.LOAD_ENV: str(load)})

    r = estimate(cores * 3.0 - 1)  # other processes' load: with the run's 1 thread, 3 tasks a core
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert (f"Note: the machine is busier now: load {cores * 3.0:.1f} on {cores} cores (other processes "
            f"{cores * 3.0 - 1:.1f}, this run's 1 thread; load {cores / 2:.1f} at calibration), so times may be up to "
            f"3.0x longer than planned." in text), text
    r = estimate(cores * 3.0 - 1, "--json")
    assert "3.0x longer" in json.loads(r.stdout)["time"]["load_note"]
    r = estimate(0.0, "--json")  # the run's threads on free cores: nothing to say
    assert json.loads(r.stdout)["time"]["load_note"] is None
    threads._chosen.clear()
    r = cli_in_process("plan", "--model", str(REPO / "data" / "demo_model"), "--gpu", "cpu",
                       "--data", str(REPO / "data" / "alpaca_sample.json"), "--json",
                       env={threads.LOAD_ENV: str(cores * 3.0 - 1)})
    assert r.returncode == 0, r.stderr
    assert any(n.startswith("The machine is busier now: ") and "3.0x longer" in n for n in json.loads(r.stdout)["notes"])
    threads._chosen.update(kept)


def test_stale_under_load_when_the_calibrations_share_was_over_one_and_a_half_times_nows():
    then = calibration(4.45, 2, "wall clock")  # the calibration that planned 2 min 08 s a step for a 28 s one
    assert stale_under_load(then, 1.3, 2)  # 2.2x the share now (1 below the cores)
    assert not stale_under_load(then, 3.0, 2)  # 2.2 / 1.5 = 1.48: not over 1.5 times
    assert stale_under_load(then, 2.9, 2)  # 2.2 / 1.45 = 1.53
    assert not stale_under_load(calibration(4.45, 2, "cpu time"), 1.0, 2)  # CPU time carries no load
    assert not stale_under_load(calibration(1.5, 2, "wall clock"), 0.1, 2)  # under the cores then: alone
    assert not stale_under_load(calibration(8.0, 2, "wall clock", platform="cuda"), 0.1, 2)


def test_a_plan_measures_again_a_calibration_made_under_a_load_the_machine_no_longer_has(tmp_path, monkeypatch):
    """The cached calibration was made at load 3 per core; at load 0.5 per core `finetuner plan` measures the
    machine again (its phase on stderr), caches that and plans with it; at load 3 per core it plans with the cache."""
    from finetuner.planning import calibrate

    cores = os.cpu_count() or 1
    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FINETUNER_SPEED_FILE", raising=False)
    d = json.loads(SPEED.read_text())
    d["name"] = calibrate.device_key()[1]
    d["details"] = {**d["details"], "load_average": cores * 3.0, "cores": cores, "timed_by": "wall clock",
                    "measured_in_s": 26.1}
    d["source"] = "the busy calibration"
    cache = calibrate.save(DeviceSpeed.from_dict(d), calibrate.cache_file(d["name"]))  # as finetuner writes it
    fresh = DeviceSpeed.from_dict({**d, "source": "the fresh calibration", "details": {**d["details"], "load_average": cores * 0.5}})
    measured = []

    def measure_now():  # what the machine measures (the measurement itself is timed in test_calibrate_rates),
        import finetuner.phases as phases  # inside the phase the CLI shows (after a few seconds: QUIET_S)

        now = phases.current()
        measured.append((now.name, now.predicted_s) if now is not None else None)
        return fresh

    monkeypatch.setattr(calibrate, "_measure", measure_now)
    args = ("plan", "--model", str(REPO / "data" / "demo_model"), "--gpu", "cpu",
            "--data", str(REPO / "data" / "alpaca_sample.json"), "--json")
    monkeypatch.setattr(os, "getloadavg", lambda: (cores * 3.0,) * 3)  # as busy as then: the cache is used
    r = cli_in_process(*args)
    assert r.returncode == 0, r.stderr
    assert not measured and json.loads(r.stdout)["speed_source"] == "the busy calibration"
    monkeypatch.setattr(os, "getloadavg", lambda: (cores * 0.5,) * 3)  # calmer now: measured again, said, cached
    r = cli_in_process(*args)
    assert r.returncode == 0, r.stderr
    assert measured == [("calibrate", 26.1)] and json.loads(r.stdout)["speed_source"] == "the fresh calibration"
    assert calibrate.load(cache).source == "the fresh calibration"

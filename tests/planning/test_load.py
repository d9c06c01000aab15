"""A calibration records the load it was made under; the estimate says when the machine is busier now
(finetuner/planning/load.py): the rule's arithmetic, and `finetuner estimate` with a calibration file
recorded under another load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from finetuner.planning.load import busier_note, growth
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
    cores = os.cpu_count() or 1
    d = json.loads(SPEED.read_text())
    d["details"] = {**d["details"], "load_average": cores / 2, "cores": cores, "timed_by": "wall clock"}
    speed_file = tmp_path / "speed.json"
    speed_file.write_text(json.dumps(d))
    monkeypatch.setenv("FINETUNER_SPEED_FILE", str(speed_file))
    monkeypatch.setattr(os, "getloadavg", lambda: (cores * 3.0, cores * 3.0, cores * 3.0))  # the load now
    r = cli_in_process("estimate", str(REPO / "recipes" / "demo_cpu.yaml"))
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert (f"Note: the machine is busier now: load {cores * 3.0:.1f} on {cores} cores (load {cores / 2:.1f} at "
            f"calibration), so times may be up to 3.0x longer than planned." in text), text
    r = cli_in_process("estimate", str(REPO / "recipes" / "demo_cpu.yaml"), "--json")
    assert "3.0x longer" in json.loads(r.stdout)["time"]["load_note"]
    monkeypatch.setattr(os, "getloadavg", lambda: (cores * 0.9,) * 3)  # below the cores: nothing to say
    r = cli_in_process("estimate", str(REPO / "recipes" / "demo_cpu.yaml"), "--json")
    assert json.loads(r.stdout)["time"]["load_note"] is None
    monkeypatch.setattr(os, "getloadavg", lambda: (cores * 3.0,) * 3)
    r = cli_in_process("plan", "--model", str(REPO / "data" / "demo_model"), "--gpu", "cpu",
                       "--data", str(REPO / "data" / "alpaca_sample.json"), "--json")
    assert r.returncode == 0, r.stderr
    assert any(n.startswith("The machine is busier now: ") and "3.0x longer" in n for n in json.loads(r.stdout)["notes"])

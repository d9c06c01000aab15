"""The one way finetuner writes a size and a duration (finetuner/units.py), at their edges."""

from __future__ import annotations

import math

import pytest

from finetuner.units import DAY_S, GiB, YEAR_S, clock_text, duration_text, gib_text, in_gib


def test_a_size_is_written_in_gib():
    assert gib_text(7.45 * GiB) == "7.45 GiB" and gib_text(GiB, 1) == "1.0 GiB"
    assert gib_text(1234.4 * GiB, 0, grouped=True) == "1,234 GiB"
    assert gib_text(7.45 * GiB, unit=False) == "7.45" and in_gib(3 * GiB / 2) == 1.5  # a table's cell, a chart's value


def test_no_size_is_divided_by_hand():
    """Sizes are written through finetuner.units alone: no ``/ GiB`` outside it in finetuner/ or ui/ (issue 57)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = [f"{p.relative_to(root)}:{i}" for pkg in ("finetuner", "ui") for p in sorted((root / pkg).rglob("*.py"))
             if p.name != "units.py" for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"/ GiB\b", line)]
    assert not found, found


@pytest.mark.parametrize("seconds, text", [
    (0, "0 s"), (0.42, "0.42 s"), (0.994, "0.99 s"), (0.996, "1.0 s"),  # two digits below 10 s
    (4.24, "4.2 s"), (9.94, "9.9 s"), (9.96, "10 s"),  # 9.96 rounds to 10 s, not "10.0 s"
    (59.4, "59 s"), (59.6, "1 min 00 s"),  # rounded before it is split: never "60 s"
    (200, "3 min 20 s"), (3599.4, "59 min 59 s"), (3599.6, "1 h 00 min"), (3600, "1 h 00 min"),
    (3659, "1 h 01 min"),  # the minutes rounded, not cut
    (7500, "2 h 05 min"), (2 * DAY_S - 1, "48 h 00 min"),
    (2 * DAY_S, "2.0 days"), (4.25 * DAY_S, "4.2 days"),  # past two days, in days
    (YEAR_S, "1 year"), (12.4 * YEAR_S, "12 years"),  # past a year (a bound no run reaches), in years
    (None, "?"), (math.inf, "?"), (math.nan, "?"),  # not known
])
def test_a_duration_is_written_as_a_person_reads_it(seconds, text):
    assert duration_text(seconds) == text


@pytest.mark.parametrize("seconds, text", [
    (0, "0:00:00"), (-3, "0:00:00"),  # an ETA already past is not negative
    (59.4, "0:00:59"), (59.6, "0:01:00"), (65.4, "0:01:05"), (3600, "1:00:00"),
    (2 * DAY_S + 61, "48:01:01"),  # hours not wrapped into days
])
def test_the_progress_clock_ticks_in_hours_minutes_and_seconds(seconds, text):
    assert clock_text(seconds) == text

"""Units of size and time, and the one way each is written: a size in GiB (the planner, memory model, CLI and UI
all say sizes in binary gibibytes, the unit of the CUDA runtime's free-memory query and ``nvidia-smi``), a
duration as a person reads it (:func:`duration_text`: predictions and measured times) and a duration as the
progress bars tick (:func:`clock_text`: elapsed and ETA)."""

from __future__ import annotations

import math

KiB = 1024
MiB = 1024**2
GiB = 1024**3

DAY_S = 24 * 3600
YEAR_S = 365 * DAY_S


def in_gib(n: float) -> float:
    """``n`` bytes as a number of GiB (a chart's value, a JSON field, a card's size)."""
    return n / GiB


def gib_text(n: float, digits: int = 2, grouped: bool = False, unit: bool = True) -> str:
    """``n`` bytes in GiB with ``digits`` decimals (``grouped``: thousands separated), e.g. ``"7.45 GiB"``; without
    the ``unit`` where a table's column says it (``"7.45"``)."""
    return f"{in_gib(n):{',' if grouped else ''}.{digits}f}" + (" GiB" if unit else "")


def duration_text(seconds: float | None) -> str:
    """``0.42 s``, ``4.2 s``, ``12 s``, ``3 min 20 s``, ``2 h 05 min``, ``4.2 days``, ``12 years``: a time as a
    person reads it, to the precision it is known (``?``: not known). Rounded before it is split, so 59.6 s is
    ``1 min 00 s``, not ``60 s``; past two days in days, past a year in years (a bound that no run reaches)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    if seconds >= YEAR_S:
        years = f"{seconds / YEAR_S:,.0f}"
        return f"{years} year{'' if years == '1' else 's'}"
    if seconds >= 2 * DAY_S:
        return f"{seconds / DAY_S:,.1f} days"
    if seconds < 9.95:  # two digits: 0.42 s, 4.2 s (0.995 and up round to 1.0 s, 9.95 and up to 10 s)
        return f"{seconds:.2g} s" if seconds < 0.995 else f"{seconds:.1f} s"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    h, m = divmod(round(seconds / 60), 60)
    return f"{h} h {m:02d} min"


def clock_text(seconds: float) -> str:
    """``0:01:05``: a time as the progress bars and lines tick it (hours not wrapped into days; below 0: ``0:00:00``)."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"

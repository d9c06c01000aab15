"""The machine's load now against its load when the CPU was calibrated: how much longer times may be.

A calibration (:mod:`finetuner.planning.calibrate`) records the 1-minute load average and the core count
when it was made (``details["load_average"]``, ``details["cores"]``) and whether its rates were timed
by the wall clock or by the process's CPU time (``details["timed_by"]``). Linux's load average counts the
tasks that run or wait to run; while it is above the cores, the scheduler shares them fairly, so a
step gets about ``cores / load`` of the time it would have on its own and takes ``load / cores`` times
as long (no slower than alone while the load is below the cores: the share is ``max(1, load / cores)``).
A calibration timed by the wall clock under a load carries that load's share in its rates already; one
timed by CPU time (one torch thread on a CPU) carries none. The times may grow by the ratio of the
shares, now against then; said only when the load now is above the cores and that ratio is above 1.
Only for a CPU: a GPU's step waits for the device, whose work the load average does not count.

The other way round, a calibration made under a load the machine no longer has (:func:`stale_under_load`) reads
rates slower than the machine's and plans times too long (one made at load 4.5 on 2 cores planned a tool-calling run
at 2 min 08 s a step that took 28 s at load 1.3); it is measured again (:func:`finetuner.planning.calibrate.cached`).
"""

from __future__ import annotations

import os

from finetuner.planning.speed import DeviceSpeed


def load_now() -> tuple[float, int]:
    """This machine's 1-minute load average and its core count (``os.cpu_count``: the load counts every core)."""
    return os.getloadavg()[0], os.cpu_count() or 1


def share(load: float, cores: int) -> float:
    """How many times longer a task takes under ``load`` on ``cores`` than alone: ``max(1, load / cores)``."""
    return max(1.0, load / max(cores, 1))


def growth(speed: DeviceSpeed, load: float, cores: int) -> float:
    """How many times longer than ``speed`` plans the times may be under ``load`` on ``cores`` now."""
    d = speed.details or {}
    then = 1.0
    if d.get("timed_by") == "wall clock" and d.get("load_average") is not None and d.get("cores"):
        then = share(float(d["load_average"]), int(d["cores"]))
    return share(load, cores) / then


def busier_note(speed: DeviceSpeed, load: float, cores: int, threads: int | None = None) -> str | None:
    """The words a plan adds when the machine is busier now than at calibration (load above the cores),
    else None. ``threads``: the run's own threads, counted in ``load`` (the rest is other processes')."""
    if speed.platform != "cpu" or load <= cores:
        return None
    times = growth(speed, load, cores)
    if times <= 1.0:
        return None
    d = speed.details or {}
    parts = [f"other processes {load - threads:.1f}, this run's {threads} thread{'s' if threads != 1 else ''}"] if threads else []
    if d.get("load_average") is not None:
        parts.append(f"load {d['load_average']:.1f} at calibration")
    then = f" ({'; '.join(parts)})" if parts else ""
    return (f"the machine is busier now: load {load:.1f} on {cores} cores{then}, so times may be up to "
            f"{times:.1f}x longer than planned")


def note_now(speed: DeviceSpeed) -> str | None:
    """:func:`busier_note` for this machine's load now, as the threads were chosen for it
    (:func:`finetuner.threads.planned`: the other processes' load it measured, plus the threads the run takes): what
    the plan, ``finetuner estimate`` and a run's ``start`` event say beside the times planned with ``speed``."""
    from finetuner.threads import planned

    choice = planned()
    return busier_note(speed, choice.load + choice.threads, choice.cores, choice.threads)


#: how many times longer the calibration's share of the machine was than now's before it is measured again
STALE_SHARE = 1.5


def stale_under_load(speed: DeviceSpeed, load: float, cores: int) -> bool:
    """Whether ``speed`` (a CPU calibration timed by the wall clock) was made under a load whose share of the
    machine was over :data:`STALE_SHARE` times what it is at ``load`` now: its rates are too slow for the machine now."""
    if speed.platform != "cpu":
        return False
    return growth(speed, load, cores) < 1.0 / STALE_SHARE

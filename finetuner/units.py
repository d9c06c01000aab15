"""Units of size and the one way a size in GiB is written (the planner, memory model, CLI and UI all
say sizes in binary gibibytes, the unit of the CUDA runtime's free-memory query and ``nvidia-smi``)."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def gib_text(n: float, digits: int = 2, grouped: bool = False) -> str:
    """``n`` bytes in GiB with ``digits`` decimals (``grouped``: thousands separated), e.g. ``"7.45 GiB"``."""
    return f"{n / GiB:{',' if grouped else ''}.{digits}f} GiB"

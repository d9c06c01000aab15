"""Seconds this process has spent in Python's garbage collector (``gc.callbacks``): tests/conftest.py's junit
property ``gc_s`` per test, for whoever looks for why a test is slower in the whole suite than alone."""
from __future__ import annotations

import gc
import time


class GcClock:
    def __init__(self):
        self.seconds, self.began = 0.0, 0.0
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self.began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self.began


CLOCK = GcClock()

"""Measurement helpers shared by the benchmarks."""

from __future__ import annotations

import threading
import time

import psutil


class PeakRSS:
    """Highest resident set size sampled while the block runs, minus the RSS before it (``.delta``, bytes).

    tracemalloc cannot see torch's allocator, so the process RSS is sampled from a thread every ``interval`` seconds.
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.process, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.base = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.delta = max(self.peak - self.base, 1)

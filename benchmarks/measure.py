"""Measurement helpers shared by the benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def run_variants(script: str | Path, variants: list[str], args: list | tuple = (),
                 repeats: int = 1) -> dict[str, list[dict]]:
    """Runs ``python script --variant V *args`` once per variant and repeat, each in a fresh Python process.

    A fresh process per measurement means no variant inherits another's allocator growth, warmed caches or peak RSS
    (in one process the first variant pays for growth the later ones reuse). Repeats interleave the variants and
    reverse their order every other round (A B, B A, A B, ...), so slow drift of the machine's load hits all alike.
    The child prints one JSON object as the last line of its stdout; returns ``{variant: [that object per repeat]}``.
    A failing child ends the benchmark with its stderr's tail.
    """
    results = {variant: [] for variant in variants}
    for round_ in range(repeats):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            cmd = [sys.executable, str(script), "--variant", variant, *map(str, args)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{Path(script).name} --variant {variant} failed (exit {proc.returncode}):\n"
                                 f"{proc.stderr[-3000:]}")
            results[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def step_timer():
    """A ``TrainerCallback`` whose ``.times`` holds each optimizer step's wall seconds (begin to end of the step)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    return StepTimer()

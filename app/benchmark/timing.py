"""Timing loops, the run's wall-clock budget, and the flat row every measurement becomes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np


class Budget:
    """Wall-clock budget of the whole run: parts start only while enough is left, and timed
    loops stop early (after ``MIN_ITERS``) once a row has used its share or the run its budget."""

    MIN_ITERS = 3

    def __init__(self, seconds: float, row_max_s: float) -> None:
        self.start = time.perf_counter()
        self.seconds = float(seconds)
        self.row_max_s = float(row_max_s)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def row_deadline(self) -> float:
        return time.perf_counter() + max(0.0, min(self.row_max_s, self.left()))

    def measure(self, fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
        """Wall time (ms) of ``iters`` calls after ``warmup``; cut short by the row's time share."""
        deadline = self.row_deadline()
        for _ in range(warmup):
            fn()
            if time.perf_counter() > deadline:
                break
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            times.append((t1 - t0) * 1e3)
            if t1 > deadline and len(times) >= self.MIN_ITERS:
                break
        return times


def row(system: str, backend: str, precision: str, input_: str, batch: int, times_ms: list[float], **extra) -> dict:
    """One measurement: p50/p99 of the per-call times, img/s = batch / mean time."""
    times = sorted(times_ms)
    mean = statistics.fmean(times)
    return {
        "system": system,
        "backend": backend,
        "precision": precision,
        "input": input_,
        "batch": batch,
        "p50_ms": round(statistics.median(times), 4),
        "p99_ms": round(float(np.percentile(times, 99)), 4),
        "img_per_s": round(batch * 1e3 / mean, 1) if mean > 0 else None,
        "iters": len(times),
        **extra,
    }


def median_of(dicts: list[dict], key: str) -> float | None:
    vals = [d[key] for d in dicts if key in d]
    return round(statistics.median(vals), 4) if vals else None


def batch_of(items: list, n: int) -> list:
    return [items[i % len(items)] for i in range(n)]


def overhead_pct(value_ms: float, bare_ms: float) -> float | None:
    """How much slower ``value_ms`` is than ``bare_ms``, in percent of the bare time."""
    return round((value_ms - bare_ms) / bare_ms * 100.0, 2) if bare_ms > 0 else None

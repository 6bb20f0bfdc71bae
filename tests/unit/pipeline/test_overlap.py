"""The runner that keeps several batches in flight: results in order, never more than
``depth`` calls at once, the consumer's work overlapping the next calls, errors surfacing."""

from __future__ import annotations

import threading
import time

import pytest

from app.pipeline.overlap import run_overlapped


class _Probe:
    """A call that sleeps (releasing the GIL, as a GPU wait does) and records concurrency."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.started: list[int] = []

    def __call__(self, item: int) -> int:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
            self.started.append(item)
        time.sleep(self.delay * (1 + item % 3))  # uneven durations: finishing order differs
        with self.lock:
            self.active -= 1
        return item * item


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_results_in_order_and_at_most_depth_at_once(depth):
    probe = _Probe()
    assert list(run_overlapped(probe, range(12), depth)) == [i * i for i in range(12)]
    assert probe.peak == min(depth, 12)
    assert sorted(probe.started) == list(range(12))


def test_next_batch_starts_before_the_consumer_is_done():
    """While the consumer still holds result k, call k + depth starts (no sleeps: events)."""
    started = {i: threading.Event() for i in range(6)}

    def fn(i: int) -> int:
        started[i].set()
        return i

    checked = []
    for k in run_overlapped(fn, range(6), 2):
        if k + 2 < 6:  # the consumer has not asked for result k + 1: call k + 2 must start anyway
            assert started[k + 2].wait(timeout=30), f"call {k + 2} did not start while result {k} was held"
            checked.append(k + 2)
    assert checked == [2, 3, 4, 5]


def test_an_error_surfaces_at_its_item():
    def fn(i):
        if i == 3:
            raise ValueError("bad batch")
        return i

    out = []
    with pytest.raises(ValueError, match="bad batch"):
        for r in run_overlapped(fn, range(6), 3):
            out.append(r)
    assert out == [0, 1, 2]

"""CPU-side logic of the GPU pipeline: batch splitting, the lane/capture gate, driver loading."""

from __future__ import annotations

import threading
import time

import pytest

from app.errors import DeviceError
from app.gpu.driver import CudaDriver
from app.gpu.pipeline import _Gate, bucket_sizes, split_even


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


@pytest.mark.parametrize("n,parts", [(1, 8), (16, 8), (17, 8), (128, 15), (5, 1), (7, 3)])
def test_split_even_covers_everything_once(n, parts):
    pieces = split_even(n, parts)
    assert [i for r in pieces for i in r] == list(range(n))
    assert len(pieces) == min(n, parts)
    sizes = [len(r) for r in pieces]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def _started(target) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_gate_shared_holders_run_together():
    gate = _Gate()
    inside = threading.Barrier(3, timeout=5)  # fails (BrokenBarrierError) unless all 3 hold it at once

    def run():
        with gate.shared():
            inside.wait()

    threads = [_started(run) for _ in range(3)]
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert not inside.broken


def test_gate_exclusive_waits_for_shared_and_blocks_new_shared():
    gate = _Gate()
    events: list[str] = []
    gate.acquire_shared()

    def exclusive():
        with gate.exclusive():
            events.append("exclusive")

    def late_shared():
        with gate.shared():
            events.append("late shared")

    t_ex = _started(exclusive)
    time.sleep(0.1)
    assert events == []  # the capture waits for the batch in flight
    t_sh = _started(late_shared)
    time.sleep(0.1)
    assert events == []  # a waiting capture goes before a new batch
    gate.release_shared()
    t_ex.join(5)
    t_sh.join(5)
    assert events == ["exclusive", "late shared"]


def test_gate_two_runs_that_both_need_a_capture_do_not_deadlock():
    """The pattern of GpuPipeline._capture_while_shared, in two threads at once."""
    gate = _Gate()
    both_shared = threading.Barrier(2, timeout=5)
    captures: list[int] = []

    def run(k):
        gate.acquire_shared()
        try:
            both_shared.wait()
            gate.release_shared()
            try:
                with gate.exclusive():
                    captures.append(k)
            finally:
                gate.acquire_shared()
        finally:
            gate.release_shared()

    threads = [_started(lambda k=k: run(k)) for k in range(2)]
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert sorted(captures) == [0, 1]


def test_driver_missing_library_is_a_device_error():
    with pytest.raises(DeviceError, match="cannot load"):
        CudaDriver("libcuda-does-not-exist.so.1")


def test_driver_library_without_cuda_symbols_is_a_device_error():
    with pytest.raises(DeviceError, match="has no cuGetErrorName"):
        CudaDriver("libc.so.6")

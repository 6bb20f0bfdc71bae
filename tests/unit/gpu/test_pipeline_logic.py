"""CPU-side logic of the GPU pipeline: buckets, batch splitting, the capture gate, driver loading."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from app.errors import DeviceError
from app.gpu.driver import CudaDriver
from app.gpu.gate import Gate
from app.gpu.pack import bucket_sizes, split_even


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
    gate = Gate()
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
    gate = Gate()
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
    gate = Gate()
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


@pytest.mark.parametrize("parts", [1, 3, 8])
@pytest.mark.parametrize("shapes", [[(480, 640)], [(7, 5), (480, 640), (1, 1), (300, 200)], [(1080, 1920)] * 3])
def test_copy_frames_packs_every_byte_at_its_offset(parts, shapes):
    """Frames split by rows over host threads land exactly where the params say, and nothing
    outside them is written (views of non-contiguous frames included)."""
    from concurrent.futures import ThreadPoolExecutor

    from app.gpu.pack import copy_frames

    rng = np.random.default_rng(len(shapes) * 10 + parts)
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    frames[0] = frames[0][:, ::-1]  # a flipped view: not contiguous
    copies, offset = [], 64
    for img in frames:
        copies.append((offset, img))
        offset += img.nbytes + 16
    host = np.full(offset + 64, 7, np.uint8)
    with ThreadPoolExecutor(4) as pool:
        copy_frames(host, copies, pool.map, parts)
    expected = np.full_like(host, 7)
    for off, img in copies:
        expected[off : off + img.nbytes] = np.ascontiguousarray(img).reshape(-1)
    np.testing.assert_array_equal(host, expected)

"""The CUDA simulator as the kernel tests use it (tests/conftest.py makes its shared arrays atomic).

Without that, threads that reach a ``cuda.shared.array`` line together can each get their own
array (the first test below then fails), and a kernel thread once read such a private copy's
garbage in CI.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from numba import cuda

from app.gpu.rounding import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="tests the CUDA simulator; on a GPU shared arrays are static")


def _arrays_seen_by_threads_released_together(threads: int = 64) -> int:
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    shared = FakeCUDAShared(0)
    barrier = threading.Barrier(threads)
    got: list[int] = [0] * threads

    def thread(i: int) -> None:
        barrier.wait()
        got[i] = id(shared.array(1, np.int32))

    pool = [threading.Thread(target=thread, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return len(set(got))


def test_threads_released_together_share_one_array_per_line():
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows at once
    try:
        counts = [_arrays_seen_by_threads_released_together() for _ in range(100)]
    finally:
        sys.setswitchinterval(interval)
    assert counts == [1] * 100


def test_a_kernel_still_gets_one_array_per_declaring_line():
    @cuda.jit
    def kernel(out):
        first = cuda.shared.array(1, np.int32)
        second = cuda.shared.array(1, np.int32)
        if cuda.threadIdx.x == 0:
            first[0] = 7
            second[0] = 9
        cuda.syncthreads()
        out[cuda.threadIdx.x, 0] = first[0]
        out[cuda.threadIdx.x, 1] = second[0]

    out = np.zeros((32, 2), np.int32)
    kernel[1, 32](out)
    assert (out[:, 0] == 7).all() and (out[:, 1] == 9).all()

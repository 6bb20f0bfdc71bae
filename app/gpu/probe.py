"""Is there an NVIDIA GPU? Answered through the driver API with ctypes, so that asking does not
import torch, numba or CuPy (``--backend auto`` on a CPU machine must stay light)."""

from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(lib)
            break
        except OSError:
            continue
    else:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value

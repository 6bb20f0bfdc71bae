"""Arithmetic with one rounding per operation, on the GPU exactly as on the CPU.

NVVM contracts ``a * b + c`` into a fused multiply-add even without fastmath, which rounds
once instead of twice and so differs from NumPy and OpenCV in the last bit. The kernels that
must match a CPU reference bit for bit (NMS IoU, letterbox coordinates) do their arithmetic
through libdevice's ``*_rn`` intrinsics, which are never fused. The CUDA simulator has no
libdevice; there plain NumPy scalars give the same single roundings.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

try:  # numba-cuda keeps its config in numba.cuda.core; plain numba in numba.core
    from numba.cuda.core import config as _cuda_config
except ImportError:  # pragma: no cover - older layouts
    from numba.core import config as _cuda_config

SIMULATOR = bool(_cuda_config.ENABLE_CUDASIM)

if SIMULATOR:

    @cuda.jit(device=True)
    def fadd(a, b):
        return np.float32(a) + np.float32(b)

    @cuda.jit(device=True)
    def fsub(a, b):
        return np.float32(a) - np.float32(b)

    @cuda.jit(device=True)
    def fmul(a, b):
        return np.float32(a) * np.float32(b)

    @cuda.jit(device=True)
    def fdiv(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):  # 0/0 -> NaN, as in the reference
            return np.float32(a) / np.float32(b)

    @cuda.jit(device=True)
    def dmul(a, b):
        return np.float64(a) * np.float64(b)

    @cuda.jit(device=True)
    def dsub(a, b):
        return np.float64(a) - np.float64(b)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def fadd(a, b):
        return libdevice.fadd_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def fsub(a, b):
        return libdevice.fsub_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def fmul(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def fdiv(a, b):
        return libdevice.fdiv_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def dmul(a, b):
        return libdevice.dmul_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def dsub(a, b):
        return libdevice.dadd_rn(a, -b)  # libdevice has no dsub; negation is exact


def quiet_low_occupancy_warnings() -> None:
    """Small batches launch small grids by design (batch 1: a few dozen blocks), and Numba
    warns on every such launch (``NumbaPerformanceWarning: Grid size 66 ...``); turn that off."""
    try:
        from numba.cuda.core import config
    except ImportError:  # numba-cuda before its own config module
        from numba import config
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

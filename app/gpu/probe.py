"""Facts about the machine's NVIDIA GPUs, shared by the engine builder and the runtime.

``cuda_device_count`` asks the driver API through ctypes, so that asking does not import torch,
numba or CuPy (``--backend auto`` on a CPU machine must stay light); ``retain_primary_context``
makes the device's CUDA context through it too, with the GIL free."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

from app.errors import BackendUnavailable, InvalidParameter


def libcuda() -> Any:
    """The CUDA driver library through ctypes, or None where there is none. A call through it lets
    go of the GIL while the driver works."""
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(lib)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    cuda = libcuda()
    if cuda is None:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def retain_primary_context(device: int) -> Callable[[], None] | None:
    """Hold CUDA device ``device``'s primary context (the one torch, Numba and nvImageCodec share),
    made now if the process has none; the call that lets go of this hold, or None where there is
    no driver or no such device.

    Why: making the context is the driver's longest step of a start, and a library that makes it
    inside its import (nvImageCodec) holds the GIL all that time, so every other thread of the
    process waits. Made here, through ctypes, the GIL is free meanwhile, and the library then
    finds it made: ``predict``'s first result came 0.38 s sooner on an H100
    (``bench/results/2026-12-06-nvidia-h100-issue45-session8-README.md``)."""
    cuda = libcuda()
    if cuda is None:
        return None
    handle, context = ctypes.c_int(0), ctypes.c_void_p()
    if (cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(handle), int(device)) != 0
            or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle) != 0):
        return None
    release = getattr(cuda, "cuDevicePrimaryCtxRelease_v2", None) or cuda.cuDevicePrimaryCtxRelease
    return functools.partial(release, handle)


def gpu_identity(device: int = 0) -> tuple[str, str]:
    """``(GPU name, "major.minor" compute capability)`` of CUDA device ``device``.

    TensorRT's API does not report either, so ask torch (present in the GPU image) or CuPy.
    """
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        if device >= torch.cuda.device_count():
            raise InvalidParameter(f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)")
        major, minor = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"{major}.{minor}"
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable("no CUDA device found (torch sees none and CuPy is not installed)") from exc
    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return name, f"{props['major']}.{props['minor']}"

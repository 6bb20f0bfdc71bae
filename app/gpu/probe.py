"""Facts about the machine's NVIDIA GPUs, shared by the engine builder and the runtime.

``cuda_device_count`` asks the driver API through ctypes, so that asking does not import torch,
numba or CuPy (``--backend auto`` on a CPU machine must stay light)."""

from __future__ import annotations

import ctypes
import functools

from app.errors import BackendUnavailable, InvalidParameter


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

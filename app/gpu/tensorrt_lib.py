"""The TensorRT library, shared by the engine builder and the runtime: imported lazily, checked
to be NVIDIA's (10.x or 11.x), and one logger per process (as Polygraphy does)."""

from __future__ import annotations

import functools
from typing import Any

from app.errors import BackendUnavailable

INSTALL_HINT = "pip install 'yolopipe[tensorrt-cu13]' (or tensorrt-cu12) on a machine with an NVIDIA GPU"


def import_tensorrt() -> Any:
    """``tensorrt``, or ``BackendUnavailable`` with the install hint (the CLI exits 2 on it)."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BackendUnavailable("TensorRT is not installed (the tensorrt Python package is missing)", hint=INSTALL_HINT) from exc
    if not hasattr(trt, "Builder") or not hasattr(trt, "__version__"):
        # e.g. a folder named tensorrt on sys.path (tests/tensorrt with pytest's pythonpath) or
        # PyPI's placeholder package: importable, but not NVIDIA's library
        raise BackendUnavailable(
            f"TensorRT is not installed (the 'tensorrt' module at {getattr(trt, '__path__', None) or getattr(trt, '__file__', '?')} "
            "is not NVIDIA TensorRT)",
            hint=INSTALL_HINT,
        )
    major = int(str(trt.__version__).split(".")[0])
    if major < 10:
        raise BackendUnavailable(f"TensorRT {trt.__version__} is too old; yolopipe needs 10.x or 11.x", hint=INSTALL_HINT)
    return trt


@functools.lru_cache(maxsize=1)
def trt_logger() -> Any:
    """One logger for the process (Polygraphy does the same); warnings and errors only."""
    trt = import_tensorrt()
    return trt.Logger(trt.Logger.WARNING)

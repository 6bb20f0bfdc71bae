"""The inference worker and its device: the warm-up before serving, and telling a device context
lost for good (the process must be restarted) from an ordinary failure of one batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from app.pipeline.detector import Detector

# What CUDA says when the context is lost for good: nothing in this process can use the
# device again, so the process must be restarted (retrying batches would fail them all).
_STICKY_DEVICE_ERRORS = (
    "illegal memory access", "illegal address", "illegal instruction", "misaligned address",
    "unspecified launch failure", "device-side assert", "launch failed", "uncorrectable ecc",
    "context is destroyed", "cuda_error_illegal", "cuda_error_launch_failed", "cuda_error_ecc",
    "cuda_error_hardware_stack_error", "hardware stack error", "cuda_error_assert",
)


def is_sticky_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the device context is lost for good."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if any(sign in text for sign in _STICKY_DEVICE_ERRORS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def warmup(detector: Detector, batch_sizes: Sequence[int], progress: Callable[[str], None] | None = None,
           buckets: Sequence[int] = ()) -> float:
    """Run each batch size once on gray images, so the first request pays no setup; the
    seconds per image of the largest batch (the first estimate admission works with).

    ``buckets``: the pipeline's batch buckets (``Pipeline.buckets``), prepared one at a time so
    that progress names each (on a GPU each is compiled on first use, or loaded from the compile
    cache, and captured as a CUDA graph: the slow part of a start); none: the pipeline's own
    warm-up."""
    say = progress or (lambda text: None)
    if buckets:
        for k, b in enumerate(buckets, 1):
            say(f"compiling and capturing batch bucket {b} ({k} of {len(buckets)})")
            detector.pipeline.warmup([b])
    else:
        say("warming up the pipeline")
        detector.pipeline.warmup()
    size = detector.meta.imgsz
    image = np.full((size, size, 3), 114, np.uint8)
    seconds = 0.0
    for k, n in enumerate(batch_sizes, 1):
        say(f"warming up batch size {n} ({k} of {len(batch_sizes)})")
        t0 = time.perf_counter()
        detector.run([image] * n, detector.params())
        seconds = (time.perf_counter() - t0) / n
    return seconds

"""The inference worker and its device: the warm-up before serving, and telling a device context
lost for good (the process must be restarted) from an ordinary failure of one batch."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from app.pipeline.detector import Detector

log = logging.getLogger("yolopipe.serving")

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

    ``buckets``: the pipeline's batch buckets (``Detector.buckets``). The largest is captured
    first, on every slot: it takes a batch of any size (the service's pipeline runs a batch in the
    smallest captured bucket that holds it: ``pad_to_captured``), so the worker can serve as soon
    as it is captured. The others are captured after that by a thread of their own, smallest first
    (single images are the common batch of a quiet service), while the first batches run; none:
    the pipeline's own warm-up, all at once."""
    say = progress or (lambda text: None)
    if buckets:
        largest, rest = buckets[-1], sorted(set(buckets) - {buckets[-1]})
        say(f"capturing batch bucket {largest}, which takes every batch until the smaller ones are captured")
        detector.warmup([largest])
        threading.Thread(target=_capture_rest, args=(detector, rest), name="yolopipe-capture", daemon=True).start()
    else:
        say("warming up the pipeline")
        detector.warmup()
        _decode_progressive(detector)
    size = detector.meta.imgsz
    image = np.full((size, size, 3), 114, np.uint8)
    seconds = 0.0
    for k, n in enumerate(batch_sizes, 1):
        say(f"warming up batch size {n} ({k} of {len(batch_sizes)})")
        t0 = time.perf_counter()
        detector.run([image] * n, detector.params())
        seconds = (time.perf_counter() - t0) / n
    return seconds


def _capture_rest(detector: Detector, buckets: Sequence[int]) -> None:
    """The smaller buckets' graphs, one bucket at a time (each capture pauses the batches for its
    few milliseconds), while the service runs; a pipeline closed meanwhile ends it. Then the
    JPEG decoders' fallback (``_decode_progressive``)."""
    started = time.perf_counter()
    for b in buckets:
        try:
            detector.warmup([b])
        except Exception as exc:  # noqa: BLE001 - closed, or a capture failed: batches still run on the larger bucket
            log.warning("capturing batch bucket %d in the background stopped: %s: %s", b, type(exc).__name__, exc)
            return
    if buckets:
        log.info("batch buckets %s captured in the background in %.1f s", ", ".join(map(str, buckets)),
                 time.perf_counter() - started)
    _decode_progressive(detector)


def _decode_progressive(detector: Detector) -> None:
    """One small progressive JPEG through the pipeline's own decoders, where it decodes JPEGs: a
    hardware JPEG decoder leaves progressive JPEGs to nvImageCodec's default chain, which is made
    on its first need (``app.gpu.early_decoder``), so that no request pays for making it."""
    if not detector.decodes_jpeg:
        return
    import cv2

    _, encoded = cv2.imencode(".jpg", np.full((64, 64, 3), 114, np.uint8), [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])
    try:
        detector.run([detector.encoded(encoded.tobytes())], detector.params())
    except Exception as exc:  # noqa: BLE001 - closed meanwhile, or no chain: such JPEGs still decode (OpenCV)
        log.warning("decoding a progressive JPEG to warm up stopped: %s: %s", type(exc).__name__, exc)

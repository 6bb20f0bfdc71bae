"""Dynamic batching: concurrent requests become one detector batch.

The path of one image::

    event loop: admit (bounded, else Overloaded at once)
      → decode thread pool: detector.prepare (CPU decode; JPEG bytes pass through for a GPU pipeline)
      → queue → worker thread: detector.detect on up to max_batch images with equal parameters
      → event loop: the request's future gets its result

One worker thread owns the detector, because the GPU pipeline is not thread-safe. While it
runs a batch, decoded images keep arriving in the queue, so the next batch is already
assembled when the current one ends; ``max_wait_ms`` only holds back a batch that is not full
and whose oldest image has waited less than that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.api.metrics import Metrics
from app.errors import DeviceError, Overloaded, RequestTimeout, YolopipeError
from app.pipeline.detector import Detector, ImageResult
from app.types import DetectParams

log = logging.getLogger("yolopipe.api")

# Timing keys the batcher itself reports; a pipeline stage of the same name gets a prefix.
_BATCHER_TIMINGS = frozenset({"decode_ms", "queue_ms", "batch_ms", "batch_size", "total_ms"})


@dataclass
class Slot:
    """One image on its way through the batcher."""

    data: bytes
    params: DetectParams
    future: asyncio.Future
    admitted_at: float = field(default_factory=time.perf_counter)
    prepared: Any = None
    decoded_at: float = 0.0
    enqueued: bool = False
    cancelled: bool = False  # the request gave up (timeout, disconnect): skip it if not started
    released: bool = False  # its place in the bounded queue was given back


@dataclass
class SlotResult:
    result: ImageResult
    timings: dict[str, float]


class DynamicBatcher:
    def __init__(
        self,
        detector: Detector,
        *,
        max_batch: int,
        max_wait_ms: float,
        max_queue: int,
        request_timeout_s: float,
        metrics: Metrics,
        decode_threads: int | None = None,
    ) -> None:
        self.detector = detector
        # The pipeline may take fewer images per call than asked (the CPU pipeline caps it).
        self.max_batch = max(1, min(max_batch, detector.pipeline.max_batch))
        self.max_wait_s = max_wait_ms / 1e3
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self._decode_pool = ThreadPoolExecutor(
            max_workers=decode_threads or min(8, os.cpu_count() or 2), thread_name_prefix="yolopipe-decode"
        )
        self._queue: deque[Slot] = deque()
        self._cond = threading.Condition()
        self._closing = False  # refuse new requests; admitted ones still finish
        self._stop = False  # the worker exits once the queue is empty
        self._admitted = 0  # images admitted and not yet released (touched on the event loop only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: threading.Thread | None = None
        metrics.queue_depth.set_function(lambda: self._admitted)

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self, warmup: Callable[[Detector], None] | None = None) -> None:
        """Start the worker thread; ``warmup`` runs first on that same thread (CUDA state is per thread)."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._worker = threading.Thread(
            target=self._worker_main, args=(warmup, ready), name="yolopipe-batcher", daemon=True
        )
        self._worker.start()
        await ready  # re-raises a warm-up failure

    async def close(self) -> None:
        """Refuse new work, let admitted work finish (bounded by the request timeout), stop the worker."""
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s + 1.0
        while self._admitted > 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.join)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def queued(self) -> int:
        return self._admitted

    # --- the request side (event loop) ---------------------------------------------------
    async def submit(self, images: Sequence[bytes], params: DetectParams) -> list[SlotResult]:
        """Detections for each image, in order; per-image errors inside. Raises Overloaded/RequestTimeout."""
        if self._closing:
            self.metrics.rejected.labels("shutting_down").inc()
            raise Overloaded("the server is shutting down")
        if self._admitted + len(images) > self.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise Overloaded(
                f"the queue is full ({self._admitted} of {self.max_queue} images waiting); retry shortly"
            )
        loop = asyncio.get_running_loop()
        slots = [Slot(bytes(data), params, loop.create_future()) for data in images]
        self._admitted += len(slots)
        try:
            return await asyncio.wait_for(self._process(slots), timeout=self.request_timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no result within {self.request_timeout_s:g} s") from None
        finally:
            for slot in slots:
                slot.cancelled = True  # no-op for finished slots; queued ones are skipped by the worker
                if not slot.enqueued:
                    self._release(slot)

    async def _process(self, slots: list[Slot]) -> list[SlotResult]:
        # Decode every image of the request, then queue them together: the images of one batch
        # request run in one detector batch (up to max_batch) instead of trickling in.
        early = await asyncio.gather(*(self._decode(slot) for slot in slots))
        with self._cond:
            for slot, failed in zip(slots, early):
                if failed is None:
                    slot.enqueued = True
                    self._queue.append(slot)
            self._cond.notify()
        return [failed if failed is not None else await slot.future for slot, failed in zip(slots, early)]

    async def _decode(self, slot: Slot) -> SlotResult | None:
        """Decode on the CPU pool; None when the image is ready to queue, else its failed result."""
        loop = asyncio.get_running_loop()
        try:
            slot.prepared = await loop.run_in_executor(self._decode_pool, self.detector.prepare, slot.data)
        except YolopipeError as exc:
            slot.decoded_at = time.perf_counter()
            self.metrics.images.labels("invalid").inc()
            self._release(slot)
            return SlotResult(ImageResult(error=exc), self._timings(slot, None))
        slot.decoded_at = time.perf_counter()
        self.metrics.stage_latency.labels("decode").observe(slot.decoded_at - slot.admitted_at)
        slot.data = b""  # the prepared form is all we need from here on
        return None

    def _release(self, slot: Slot) -> None:
        if not slot.released:
            slot.released = True
            self._admitted -= 1

    @staticmethod
    def _timings(slot: Slot, batch: dict[str, float] | None) -> dict[str, float]:
        t = {"decode_ms": round((slot.decoded_at - slot.admitted_at) * 1e3, 3)}
        if batch is not None:
            t.update({"queue_ms": round((batch["start"] - slot.decoded_at) * 1e3, 3)})
            t.update({k: v for k, v in batch.items() if k != "start"})
        return t

    # --- the worker side (its own thread) ------------------------------------------------
    def _worker_main(self, warmup: Callable[[Detector], None] | None, ready: asyncio.Future) -> None:
        assert self._loop is not None
        try:
            if warmup is not None:
                warmup(self.detector)
        except BaseException as exc:  # noqa: BLE001 (handed to start(), which raises it in the lifespan)
            self._loop.call_soon_threadsafe(_set_exception, ready, exc)
            return
        self._loop.call_soon_threadsafe(_set_result, ready, None)
        while True:
            batch, dropped = self._next_batch()
            if dropped:
                self._loop.call_soon_threadsafe(self._release_all, dropped)
            if batch is None:
                return
            if batch:
                self._run_batch(batch)

    def _next_batch(self) -> tuple[list[Slot] | None, list[Slot]]:
        """Wait for work; return up to max_batch live slots sharing the oldest one's parameters.

        ``None`` means stopped and drained. Cancelled slots found on the way come back as
        ``dropped`` so their places are released.
        """
        with self._cond:
            while not self._queue and not self._stop:
                self._cond.wait()
            if not self._queue:
                return None, []
            deadline = self._queue[0].decoded_at + self.max_wait_s
            while len(self._queue) < self.max_batch and not self._closing:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            params = self._queue[0].params
            batch: list[Slot] = []
            dropped: list[Slot] = []
            kept: deque[Slot] = deque()
            while self._queue:
                slot = self._queue.popleft()
                if slot.cancelled:
                    dropped.append(slot)
                elif len(batch) < self.max_batch and slot.params == params:
                    batch.append(slot)
                else:
                    kept.append(slot)
            self._queue = kept
            return batch, dropped

    def _run_batch(self, batch: list[Slot]) -> None:
        m = self.metrics
        start = time.perf_counter()
        for slot in batch:
            m.stage_latency.labels("queue").observe(start - slot.decoded_at)
        m.batch_size.observe(len(batch))
        try:
            results = self.detector.detect([s.prepared for s in batch], batch[0].params)
        except DeviceError as exc:  # the GPU pipeline's own wrapping of a CUDA failure
            log.error("batch of %d failed on the device: %s", len(batch), exc)
            m.device_errors.inc()
            results = [ImageResult(error=exc) for _ in batch]
        except YolopipeError as exc:
            log.warning("batch of %d failed: %s", len(batch), exc)
            results = [ImageResult(error=exc) for _ in batch]
        except Exception as exc:  # the accelerator failed (e.g. out of memory): fail this batch, keep serving
            log.error("batch of %d failed on the device", len(batch), exc_info=exc)
            m.device_errors.inc()
            error = DeviceError(f"the device failed while running this batch ({type(exc).__name__}); retry")
            results = [ImageResult(error=error) for _ in batch]
        end = time.perf_counter()
        m.stage_latency.labels("batch").observe(end - start)
        timings: dict[str, float] = {"start": start, "batch_ms": round((end - start) * 1e3, 3), "batch_size": len(batch)}
        stage_ms = getattr(self.detector.pipeline, "last_timings", None) or {}
        for name, ms in stage_ms.items():
            if name in _BATCHER_TIMINGS:  # e.g. the GPU pipeline's own decode_ms (nvJPEG)
                name = f"pipeline_{name}"
            m.stage_latency.labels(name.removesuffix("_ms")).observe(ms / 1e3)
            timings[name] = round(float(ms), 3)
        for slot in batch:
            slot.prepared = None
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, batch, results, timings)

    def _deliver(self, batch: list[Slot], results: list[ImageResult], timings: dict[str, float]) -> None:
        for slot, result in zip(batch, results):
            self._release(slot)
            self.metrics.images.labels("ok" if result.error is None else "failed").inc()
            if not slot.future.done():
                slot.future.set_result(SlotResult(result, self._timings(slot, timings)))

    def _release_all(self, slots: list[Slot]) -> None:
        for slot in slots:
            self._release(slot)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def warmup_detector(detector: Detector, batch_sizes: Sequence[int] = (1,)) -> None:
    """Run the detector once per batch size on gray images, so the first request pays no setup."""
    capture = getattr(detector.pipeline, "warmup", None)
    if callable(capture):  # the GPU pipeline captures one CUDA graph per batch-size bucket
        capture()
    size = detector.meta.imgsz
    image = np.full((size, size, 3), 114, np.uint8)
    for n in batch_sizes:
        detector.detect([image] * n, detector.params())

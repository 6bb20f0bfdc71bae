"""The inference worker's dynamic batcher: images from every HTTP worker become detector batches
(``Detector.run``), of up to the detector's ``RunShape.max_batch`` images, each waiting at most
its ``max_wait_ms`` for a batch to fill.

* **Admission in time.** ``admit`` refuses at once (``Overloaded`` → 503) when the work
  already admitted, at the measured seconds per image (an EWMA over recent batches), would
  not be done within the budget. An empty queue always admits.
* **Fair, by shape.** Images wait in one queue per request, and a batch takes one image from
  each request in turn (round-robin), of one group: equal parameters and one model input size
  (under a rect letterbox, from the header the HTTP worker read; ``rounds``), so a big
  ``/v1/detect/batch`` request never holds single images back by more than one batch; the HTTP
  side also keeps only ``request_window`` images of one request here at a time.
* **Lazy decode.** Bytes stay in the HTTP worker's ring until their image is answered; once
  their batch is formed they are read there, in place, with the header the HTTP worker read
  (``EncodedImage`` over a view of the ring: never copied, never parsed again), decoded (CPU
  pool; a JPEG passes through to a GPU pipeline that decodes it within the batch's run);
  decoded pixels exist only for the batches running.
* **Batches in flight.** One thread per batch in flight (``RunShape.in_flight``), each forming
  and running its own batch.

Every admitted image is answered exactly once through ``deliver`` (a result, its own error,
or why it was dropped: deadline passed, request cancelled, shutting down), because the answer
is what frees its bytes in the ring. A batch thread that meets an unexpected exception logs it,
answers that batch with an error and goes on. An error that leaves the device unusable (a
dead CUDA context: every later batch would fail too) makes the batcher refuse new work,
answer what it holds and call ``on_fatal``, so that its process drains and is restarted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.contracts import DetectedBatch, EncodedImage
from app.errors import DeviceError, Overloaded, RequestTimeout, YolopipeError
from app.ipc.answers import Answers
from app.ipc.wire import DRAINING, READY, ImageRef, Load, over_budget, queued_seconds
from app.pipeline.detector import Detector
from app.service.inference.answers import answers_of, failed_answers
from app.service.inference.rounds import take_round_robin
from app.service.inference.warmup import is_sticky_device_error, warmup

log = logging.getLogger("yolopipe.serving")

_EWMA_WEIGHT = 0.2  # of the newest batch: about the last five batches count


@dataclass(slots=True)
class Job:
    """One admitted image. ``owner`` is who gets the answer (an HTTP worker's connection)."""

    owner: Hashable
    ref: ImageRef
    data: Any  # a view of the bytes in the owner's ring until decoded (or a stream's BGR frame)
    admitted_at: float = field(default_factory=time.perf_counter)
    decode_ms: float = 0.0
    group: Hashable = None  # what it may share a batch by: its parameters and input size (set when admitted)

    @property
    def key(self) -> tuple[Hashable, int]:
        return self.owner, self.ref.req_id


# The answers of ``jobs`` (in their order); called from a batch thread.
Deliver = Callable[[list[Job], Answers], None]


class Batcher:
    def __init__(self, detector: Detector, *, budget_s: float, deliver: Deliver, metrics: Any, generation: int = 0,
                 decode_threads: int = 4) -> None:
        """Batches of up to ``detector.shape.max_batch`` images, ``in_flight`` at once, each waiting
        at most ``max_wait_ms`` to fill (the run shape ``app.runtime`` clamped)."""
        self.detector = detector
        self.max_batch = detector.shape.max_batch
        self.max_wait_s = detector.shape.max_wait_ms / 1e3
        self.budget_s = budget_s
        # batches run at once (a thread each): on the GPU, one batch's decode and upload beside another's graph
        self.in_flight = detector.shape.in_flight
        self.generation = generation
        self._deliver = deliver
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="yolopipe-decode")
        self._cond = threading.Condition()
        self._requests: OrderedDict[tuple[Hashable, int], deque[Job]] = OrderedDict()
        self._queued = 0  # jobs waiting in _requests
        self._pending = 0  # admitted and not yet answered (queued + running)
        self._seconds_per_image = 0.0
        self._closing = False
        self._stop = False
        self._threads: list[threading.Thread] = []
        self.on_load_change: Callable[[Load], None] | None = None
        self.on_fatal: Callable[[str], None] | None = None  # the device is unusable: restart the process
        self.fatal: str | None = None

    # --- lifecycle -----------------------------------------------------------------------
    def start(self, warmup_sizes: Sequence[int] = (1,), progress: Callable[[str], None] | None = None,
              buckets: Sequence[int] = ()) -> None:
        """Warm the detector up (on the first batch thread: CUDA state is per thread), then serve.
        ``progress`` hears each warm-up step; ``buckets``: see ``warmup``."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def first_thread() -> None:
            try:
                self._seconds_per_image = warmup(self.detector, warmup_sizes, progress, buckets)
            except BaseException as exc:  # noqa: BLE001 (raised by start() in the caller's thread)
                failure.append(exc)
                ready.set()
                return
            ready.set()
            self._batch_loop()

        self._threads = [threading.Thread(target=first_thread, name="yolopipe-batch-0", daemon=True)]
        self._threads[0].start()
        ready.wait()
        if failure:
            raise failure[0]
        for i in range(1, self.in_flight):
            t = threading.Thread(target=self._batch_loop, name=f"yolopipe-batch-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        self._publish()

    def close(self, drain_s: float) -> None:
        """Refuse new work, finish what was admitted (at most ``drain_s``), stop the batch threads."""
        with self._cond:
            self._closing = True
            deadline = time.monotonic() + drain_s
            while self._pending and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._stop = True
            dropped = self._drain_queue()
            self._cond.notify_all()
        self._answer(dropped, Overloaded("the server is shutting down; retry"))
        for t in self._threads:
            t.join(timeout=drain_s + 5)
        self.metrics.write()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the IO side (the worker's event loop) ---------------------------------------------
    def load(self) -> Load:
        state = DRAINING if self._closing or self.fatal else READY
        return Load(self.generation, state, self._pending, self._seconds_per_image, self.in_flight)

    def admit(self, job: Job) -> YolopipeError | None:
        """Queue ``job``; or the error to answer it with at once."""
        return self.admit_many([job])[0]

    def admit_many(self, jobs: list[Job]) -> list[YolopipeError | None]:
        """Queue each of ``jobs`` (what one read from a socket brought), under one lock; per job
        None or the error to answer it with at once."""
        refused: list[YolopipeError | None] = []
        with self._cond:
            was_queued = self._queued
            for job in jobs:
                refused.append(self._admit_one(job))
            # Wake a batch thread only when it has something to do: an idle one for the first job,
            # a filling one when a whole batch is there (else it waits out max_wait by itself).
            if self._queued and (not was_queued or self._queued >= self.max_batch > was_queued):
                self._cond.notify()
        self._publish()
        return refused

    def _admit_one(self, job: Job) -> YolopipeError | None:
        if self._closing or self.fatal:
            return Overloaded("the server is shutting down; retry")
        queued_s = queued_seconds(self._pending + 1, self._seconds_per_image, self.in_flight)
        if self._pending and queued_s > self.budget_s:
            return over_budget(queued_s, self.budget_s)
        self._pending += 1
        self._queued += 1
        job.group = (job.ref.params, self._input_size(job))
        queue = self._requests.get(job.key)
        if queue is None:
            self._requests[job.key] = queue = deque()
        queue.append(job)
        return None

    def _input_size(self, job: Job) -> tuple[int, int] | None:
        """The model input size ``job``'s image will run at: from a stream frame's shape, or the
        header the HTTP worker read (turned by its EXIF orientation); None where neither is known
        yet (the detector reads it, and runs it at its size whatever its batch)."""
        if isinstance(job.data, np.ndarray):
            return self.detector.input_size(*job.data.shape[:2])
        header = job.ref.header
        return None if header is None else self.detector.input_size(*header.upright_size)

    def cancel(self, owner: Hashable, req_id: int) -> None:
        """The request is over (failed or timed out): answer its queued images without running them."""
        with self._cond:
            queue = self._requests.pop((owner, req_id), None)
            dropped = list(queue or ())
            self._forget(len(dropped))
        self._answer(dropped, Overloaded("the request was cancelled"))

    def drop_owner(self, owner: Hashable) -> None:
        """The HTTP worker went away: forget its queued images (nobody is left to answer)."""
        with self._cond:
            dropped = 0
            for key in [k for k in self._requests if k[0] == owner]:
                dropped += len(self._requests.pop(key))
            self._forget(dropped)
        self._publish()

    # --- the batch threads -------------------------------------------------------------------
    def _batch_loop(self) -> None:
        while True:
            if not self._queued:  # about to wait for work: what the batches observed is written first
                self.metrics.write()
            batch, expired = self._next_batch()
            self._answer(expired, RequestTimeout("the request's deadline passed while it waited"))
            if batch is None:
                return
            if batch:
                self._run(batch)

    def _run(self, batch: list[Job]) -> None:
        """Run one batch and answer every job of it, whatever happens: a batch thread must not die."""
        start = time.perf_counter()
        try:
            answers = self._compute(batch, start)
        except Exception as exc:  # noqa: BLE001 (a bug or a decoder's surprise: fail this batch, serve on)
            log.error("a batch thread failed on a batch of %d; answering it with an error", len(batch), exc_info=exc)
            self.metrics.device_errors.inc()
            error = DeviceError(f"the inference worker failed on this batch ({type(exc).__name__}); retry")
            answers = failed_answers(batch, [error] * len(batch))
            self._check_sticky(exc)
        ok = len(batch) - len(answers.detected.errors)
        end = time.perf_counter()
        with self._cond:
            if ok:
                sample = (end - start) / ok
                spi = self._seconds_per_image
                self._seconds_per_image = sample if spi == 0 else spi + _EWMA_WEIGHT * (sample - spi)
            self._pending -= len(batch)
            idle = not self._pending
            self._wake_closer()
        if idle:  # the last admitted work: what the batches observed is written before its answers go
            self.metrics.write()
        for job in batch:
            job.data = None
        self._safe_deliver(batch, answers)
        self._publish()

    def _next_batch(self) -> tuple[list[Job] | None, list[Job]]:
        """Wait for work; up to max_batch jobs of one group, one per request in turn (``rounds``).
        ``None`` once stopped. Jobs whose deadline passed come back separately."""
        with self._cond:
            while not self._queued and not self._stop:
                self._cond.wait()
            if not self._queued:
                return None, []
            oldest = min(q[0].admitted_at for q in self._requests.values())
            deadline = oldest + self.max_wait_s
            while self._queued < self.max_batch and not self._closing:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self._take_round_robin()

    def _take_round_robin(self) -> tuple[list[Job], list[Job]]:
        batch, expired = take_round_robin(self._requests, self.max_batch, time.monotonic())
        self._queued -= len(batch) + len(expired)
        self._pending -= len(expired)
        if self._queued:  # work left over: another batch thread starts forming the next batch
            self._cond.notify()
        return batch, expired

    def _compute(self, batch: list[Job], start: float) -> Answers:
        """Every job's answer, as arrays: rows go from the detector to the wire in one go per batch."""
        prepared = self._prepare(batch)
        run_start = time.perf_counter()
        detected = self._detect(prepared, batch[0].ref.params)
        end = time.perf_counter()
        failed = len(detected.errors)
        # Times only (the run's facts, its bucket and slot, are never latencies).
        self.metrics.observe_batch([start - j.admitted_at for j in batch], [j.decode_ms / 1e3 for j in batch],
                                   sum(not isinstance(p, YolopipeError) for p in prepared), end - run_start,
                                   detected.timings, len(batch) - failed, failed)
        return answers_of(batch, start, detected, (end - run_start) * 1e3)

    def _prepare(self, batch: list[Job]) -> list[Any]:
        """Decoded pixels (or the JPEG, with its header, for a pipeline that decodes it) or the
        image's error. Decodes go to the pool; the rest is done here."""
        on_pool = [not self._passes_through(j) for j in batch]
        if sum(on_pool) > 1:
            futures = {i: self._pool.submit(self._prepare_one, j) for i, j in enumerate(batch) if on_pool[i]}
            out = [futures[i].result() if i in futures else self._prepare_one(j) for i, j in enumerate(batch)]
        else:
            out = [self._prepare_one(j) for j in batch]
        for job in batch:
            job.data = None  # nothing reads the ring from here on
        return out

    def _passes_through(self, job: Job) -> bool:
        """Nothing to decode here: a stream's frame, or a JPEG (its header read by the HTTP
        worker) that the pipeline decodes itself."""
        header = job.ref.header
        if isinstance(job.data, np.ndarray):
            return True
        return header is not None and self.detector.gpu_decodes(header)

    def _prepare_one(self, job: Job) -> Any:
        t0 = time.perf_counter()
        try:
            data = job.data
            if not isinstance(data, np.ndarray):  # a view of the bytes in the owner's ring
                # Read in place with the header that came with them, never copied (decoded here, or
                # in the batch's run): the ring keeps them until the image is answered.
                header = job.ref.header
                data = bytes(data) if header is None else EncodedImage(np.frombuffer(data, np.uint8), header)
            return self.detector.prepare(data)
        except YolopipeError as exc:
            return exc
        finally:
            job.decode_ms = (time.perf_counter() - t0) * 1e3

    def _detect(self, items: list[Any], params: Any) -> DetectedBatch:
        """One ``Detector.run_prepared`` of prepared items (a batch is never over the run's max_batch):
        each item's rows or error, and the run's stage timings; a run that fails as a whole
        fails each of its items."""
        try:
            return self.detector.run_prepared(items, params)
        except YolopipeError as exc:
            if isinstance(exc, DeviceError):
                self.metrics.device_errors.inc()
            log.warning("batch of %d failed: %s", len(items), exc)
            return DetectedBatch.failed([x if isinstance(x, YolopipeError) else exc for x in items])
        except Exception as exc:  # the accelerator failed (e.g. out of memory): fail this batch, keep serving
            log.error("batch of %d failed on the device", len(items), exc_info=exc)
            self.metrics.device_errors.inc()
            error = DeviceError(f"the device failed while running this batch ({type(exc).__name__}); retry")
            self._check_sticky(exc)
            return DetectedBatch.failed([x if isinstance(x, YolopipeError) else error for x in items])

    def _check_sticky(self, exc: BaseException) -> None:
        """A dead device context: refuse new work, answer the queue, have the process restarted."""
        if not is_sticky_device_error(exc):
            return
        with self._cond:
            if self.fatal is not None:
                return
            self.fatal = f"{type(exc).__name__}: {exc}"
            dropped = self._drain_queue()
        log.critical("the device is unusable (%s); this inference worker stops and is restarted", self.fatal)
        self._answer(dropped, DeviceError("the inference worker's device failed; it is restarting, retry"))
        if self.on_fatal is not None:
            self.on_fatal(self.fatal)

    # --- bookkeeping -----------------------------------------------------------------------
    def _answer(self, jobs: list[Job], error: YolopipeError) -> None:
        if jobs:
            answers = failed_answers(jobs, [error] * len(jobs))
            for job in jobs:
                job.data = None
            self._safe_deliver(jobs, answers)
            self._publish()

    def _safe_deliver(self, jobs: list[Job], answers: Answers) -> None:
        try:
            self._deliver(jobs, answers)
        except Exception as exc:  # noqa: BLE001 (e.g. the event loop closed while stopping)
            log.error("could not deliver %d answer(s)", len(jobs), exc_info=exc)

    def _forget(self, n: int) -> None:
        self._queued -= n
        self._pending -= n
        self._wake_closer()

    def _wake_closer(self) -> None:
        """Less admitted work (lock held): only ``close`` waits on it, no batch thread is woken."""
        if self._closing:
            self._cond.notify_all()

    def _drain_queue(self) -> list[Job]:
        jobs = [j for q in self._requests.values() for j in q]
        self._requests.clear()
        self._forget(len(jobs))
        return jobs

    def _publish(self) -> None:
        self.metrics.set_pending(self._pending)
        if self.on_load_change is not None:
            self.on_load_change(self.load())

"""The NVDEC captures of many streams read by a few threads: a ``DecodePool``.

A thread per stream (128 cameras: 128 threads, each waking 30 times a second to decode one
frame) spends the GIL on its own bookkeeping and asks NVDEC for one frame at a time; more
decoding threads than NVDEC engines only queue on them. A pool of ``workers`` threads (about two
per engine, ``app.config.NVDEC_THREADS``) serves every stream instead: each worker owns the
captures given to it (a new one goes to the worker with the fewest) and loops over them:

* a stream read at its source rate (a file as a camera, ``Stream.period``): its frames are
  decoded up to ``AHEAD`` frames before they are due, a decode call's batch at a time, and each
  is handed to the stream when it is due (it is *read* then: latency counts from there, as a
  camera's frame counts from when it arrives);
* a stream read as fast as possible: as many frames as its buffer has room for, a batch at a time;

then sleeps until the next frame is due or, with a stream waiting for room, ``POLL_S``.

A decode call that does not come back (a live source's packets that stopped coming, while its
read waits out the source's timeout; a decoder that hangs) holds only its own stream: once it has
run ``STALL_S``, its worker counts as stalled, new streams go to other workers, and the first
other worker that looks hands the stalled worker's other captures to the least busy workers.
Time a call spends waiting for a capture to let go of the device (``open_since``: the device
gate's) does not count: every decode call waits then, and none of them is stalled. A worker whose thread
ends (its device could not be made current) fails the streams it held, and a new stream gets a
new worker in its place: no stream waits on a thread that is gone.

The stream's own thread opens the capture, hands it over (``read``: first ``prepare(cap)``, where
the runner makes the GPU pipeline ready for the capture's frame size, so that no graph is
captured while the pool decodes) and waits until it ends, the
stream is stopped or the capture fails; it then closes, reconnects or ends as it does for
captures it reads itself (``app.predict.stream_source``). A capture here is anything with
``read(count) -> [frames]`` ([] at its end): ``app.predict.sources.NvdecCapture``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from app.errors import DeviceError

log = logging.getLogger("yolopipe.predict")

AHEAD = 8  # frames decoded before they are due, per stream read at its rate
POLL_S = 0.002  # an idle worker's look for room in the buffers of streams read as fast as possible
IDLE_S = 0.1
STALL_S = 1.0  # a decode call running this long stalls its worker: its other captures move (module docstring)


class _Reading:
    """One capture being read into one stream."""

    def __init__(self, stream: Any, cap: Any, index: int, batch: int) -> None:
        self.stream, self.cap, self.index, self.batch = stream, cap, index, batch
        self.first, self.period = index, stream.period
        self.started = 0.0  # when the first frame was decoded: the schedule starts there, as a camera's
        self.ahead: deque[tuple[int, Any]] = deque()  # (source index, frame) decoded, not yet due
        self.ended = False
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.worker: _Worker | None = None  # the worker reading it (another takes it over from a stalled one)

    def due(self, index: int) -> float:
        return self.started + (index - self.first) * self.period

    def serve(self, now: float) -> bool:
        """Hand over the frames due; decode more if it is time. Whether it decoded."""
        stream = self.stream
        while self.ahead and self.due(self.ahead[0][0]) <= now:
            stream.keep(*self.ahead.popleft())
        if self.ended:
            return False
        if self.period:
            count = AHEAD - len(self.ahead) if len(self.ahead) <= AHEAD // 2 else 0
        else:
            count = min(stream.room(), self.batch)
        if count <= 0:
            return False
        frames = self.cap.read(count)
        if not frames:
            self.ended = True
        if frames and not self.started:
            self.started = time.monotonic()
        for frame in frames:
            index, self.index = self.index, self.index + 1
            if index % stream.vid_stride:
                continue
            if self.period:
                self.ahead.append((index, frame))
            else:
                stream.keep(index, frame)
        if self.period:  # any already due (a stream behind its schedule) go now
            now = time.monotonic()
            while self.ahead and self.due(self.ahead[0][0]) <= now:
                stream.keep(*self.ahead.popleft())
        return True

    @property
    def finished(self) -> bool:
        return self.stream.stopped or (self.ended and not self.ahead)

    def wake_at(self, now: float) -> float:
        """When this reading next needs its worker."""
        if self.ahead:
            return self.due(self.ahead[0][0])
        if self.ended:
            return now + IDLE_S
        return now + POLL_S  # a stream read as fast as possible: look for room again soon


class _Worker:
    def __init__(self, name: str, on_device: Any, peers: Callable[[], list[_Worker]],
                 open_since: Callable[[], float]) -> None:
        self.name = name
        self.readings: list[_Reading] = []
        self._wake = threading.Condition()  # guards readings, serving and the readings' worker
        self._closed = False
        self.gone = False  # its thread ended
        self.failure: BaseException | None = None  # why, where it failed
        self.serving: _Reading | None = None  # the reading whose decode call runs now, since serving_since
        self.serving_since = 0.0
        self._on_device = on_device
        self._peers = peers
        self._open_since = open_since
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, readings: list[_Reading]) -> None:
        with self._wake:
            if self.gone:  # ended since it was chosen: nothing would read them
                for reading in readings:
                    reading.error = self._ended()
                    reading.done.set()
                return
            for reading in readings:
                reading.worker = self
            self.readings.extend(readings)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stalled(self, now: float) -> bool:
        """Whether its decode call has run over ``STALL_S``, time waiting for a capture left out."""
        return self.serving is not None and now - max(self.serving_since, self._open_since()) > STALL_S

    def usable(self, now: float) -> bool:
        return not self.gone and not self.stalled(now)

    def _run(self) -> None:
        try:
            with self._on_device():
                self._loop()
        except BaseException as exc:  # noqa: BLE001 - its streams fail below; none waits on a thread that is gone
            self.failure = exc
            log.error("decode thread %s ended: %s: %s", self.name, type(exc).__name__, exc)
        with self._wake:
            self.gone = True
            readings, self.readings = self.readings, []
        for reading in readings:
            if self.failure is not None and reading.error is None:
                reading.error = self._ended()
            reading.done.set()

    def _ended(self) -> DeviceError:
        why = f" ({type(self.failure).__name__}: {self.failure})" if self.failure is not None else ""
        return DeviceError(f"the decode thread {self.name} ended{why}")

    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._closed:
                    return
            self._take_over_stalled()
            with self._wake:
                readings = list(self.readings)
            now = time.monotonic()
            decoded, wake = False, now + IDLE_S
            for reading in readings:
                with self._wake:
                    if reading.worker is not self:  # taken over while this worker was stalled
                        continue
                    self.serving, self.serving_since = reading, time.monotonic()
                try:
                    decoded |= reading.serve(now)
                except Exception as exc:  # noqa: BLE001 - the stream's thread raises it as its failure
                    reading.error = exc
                finally:
                    with self._wake:
                        self.serving = None
                if reading.error is not None or reading.finished:
                    self._finish(reading)
                else:
                    wake = min(wake, reading.wake_at(now))
            if not decoded:
                with self._wake:
                    if not self._closed:
                        self._wake.wait(max(0.0, wake - time.monotonic()))

    def _take_over_stalled(self) -> None:
        """The captures of a stalled worker but the one it is stuck in, each handed to the least
        busy worker that is not stalled (this one among them)."""
        now = time.monotonic()
        peers = self._peers()
        for peer in peers:
            if peer is self or not peer.stalled(now):  # read without its lock first: the usual answer is no
                continue
            with peer._wake:
                if not peer.stalled(now):
                    continue
                moved = [r for r in peer.readings if r is not peer.serving]
                peer.readings = [r for r in peer.readings if r is peer.serving]
                for reading in moved:
                    reading.worker = self  # in transit: its old worker skips it from now on
            if not moved:
                continue
            log.warning("decode thread %s stalled (a decode call running over %.0f s): its %d other stream(s) "
                        "go to other threads", peer.name, STALL_S, len(moved))
            takers = [w for w in peers if w is self or w.usable(now)]
            for reading in moved:
                _least_busy(takers).add([reading])

    def _finish(self, reading: _Reading) -> None:
        with self._wake:
            if reading in self.readings:
                self.readings.remove(reading)
        reading.done.set()


def _least_busy(workers: list[_Worker]) -> _Worker:
    return min(workers, key=lambda w: len(w.readings))


class DecodePool:
    """``workers`` threads reading the captures of many streams (see the module docstring);
    ``on_device``: a context manager each worker runs in (the GPU's device made current);
    ``prepare(cap)``: called on a stream's thread before its capture is read; ``open_since()``:
    since when the device has been free of captures (``CudaDevice.open_since``; None: always)."""

    def __init__(self, workers: int, *, batch: int = 8, on_device: Any = None,
                 prepare: Callable[[Any], None] | None = None, open_since: Callable[[], float] | None = None) -> None:
        import contextlib

        if workers < 1:
            raise ValueError(f"a decode pool needs at least one worker, got {workers}")
        self.size, self.batch = workers, batch
        self._on_device = on_device or contextlib.nullcontext
        self._prepare = prepare
        self._open_since = open_since or (lambda: 0.0)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._names = itertools.count()  # workers started, for their names

    def read(self, stream: Any, cap: Any, index: int) -> int:
        """Read ``cap``'s frames into ``stream`` from frame ``index`` on, until it ends or the
        stream stops (called on the stream's own thread, which waits); the next frame's index.
        A failure of the reading (a frame over the pixel limit, a decode error) or of ``prepare``
        is raised here."""
        if self._prepare is not None:
            self._prepare(cap)
        reading = _Reading(stream, cap, index, self.batch)
        with self._lock:
            if self._closed:
                return index
            self._workers = [w for w in self._workers if not w.gone]  # a thread that ended is replaced
            now = time.monotonic()
            usable = [w for w in self._workers if w.usable(now)]
            # A new worker up to the pool's size; past it only while every worker is stalled (at
            # most as many again: each one stalled holds a stream of its own).
            if len(self._workers) < self.size or (not usable and len(self._workers) < 2 * self.size):
                self._workers.append(_Worker(f"yolopipe-decode-{next(self._names)}", self._on_device, self._peers,
                                             self._open_since))
                worker = self._workers[-1]
            else:
                worker = _least_busy(usable or self._workers)
            worker.add([reading])
        reading.done.wait()
        if reading.error is not None:
            raise reading.error
        return reading.index

    def _peers(self) -> list[_Worker]:
        with self._lock:
            return list(self._workers)

    def close(self) -> None:
        """Stop the workers; every stream waiting on one gets its capture back."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for worker in workers:
            worker.close()
        for worker in workers:
            worker.join(5.0)

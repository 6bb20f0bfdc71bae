"""An HTTP worker's side of the inference workers: connections, routing, admission, answers.

One connection per inference worker, each with its own shared-memory ring; a lost
connection fails the images waiting on it at once (503) and is re-made as soon as the worker
is back. A request is admitted as a whole (``admit``): when all its images, behind the work
queued at the workers and the images this HTTP worker has yet to send, would not be done
within the budget at the workers' measured rate, it is refused here (503) before any image is
sent. Each image goes to the least loaded worker (queued seconds from its status block). A
request keeps at most ``window`` images at the workers, sending the next as each answer
comes, so one large batch request cannot fill the queue alone; the inference worker's batcher
still refuses an image that finds its queue over the budget (the backstop).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from app.contracts import DetectParams
from app.errors import DeviceError, Overloaded, RequestTimeout, YolopipeError
from app.imaging.headers import ImageHeader
from app.ipc import wire
from app.ipc.answers import Answers, read_answers
from app.ipc.layout import RunLayout
from app.ipc.ring import Ring
from app.settings import Settings

log = logging.getLogger("yolopipe.serving")

_RECONNECT_S = 0.1
_GRACE_S = 0.5  # past the deadline, the worker's own timeout answer normally arrives first
SERVER_SIDE = (Overloaded, DeviceError, RequestTimeout)  # these fail the whole request


class _Request:
    """One HTTP request's images on their way: sent ``window`` at a time, answered in any order."""

    def __init__(self, client: InferenceClient, images: list[bytes], params: DetectParams, deadline: float,
                 headers: list[ImageHeader] | None = None) -> None:
        self.client = client
        self.id = next(client._ids)
        self.images: list[bytes] | None = images  # None once it failed: nothing more is sent
        self.headers = headers
        self.params = params
        self.deadline = deadline
        self.count = len(images)
        self.shares: list[Answers] = []  # its images' answers, a share of each batch they ran in
        self.sent = 0
        client._unsent += len(images)
        self.answered = 0
        self.links: set[_Link] = set()
        # Set (to None) once every image is answered or the request failed, ``error`` then says
        # why. The error is kept here, not in the future: a future's exception raised in the
        # awaiting frame (which holds this request) would be a cycle holding the image bytes.
        self.done = asyncio.get_running_loop().create_future()
        self.error: YolopipeError | None = None

    def send_next(self) -> None:
        if self.done.done() or self.sent >= self.count:
            return
        index = self.sent
        self.sent += 1
        self.client._unsent -= 1
        try:
            link = self.client.pick()
            link.send(self, index)
        except YolopipeError as exc:
            self.fail(exc.with_traceback(None))  # its traceback holds this frame, which holds self

    def answer(self, share: Answers) -> None:
        """Some of its images' answers (its share of one batch)."""
        if self.done.done():
            return
        for error in share.detected.errors.values():
            if isinstance(error, SERVER_SIDE):
                self.fail(error)
                return
        self.shares.append(share)
        self.answered += len(share)
        if self.answered == self.count:
            self.done.set_result(None)
            return
        for _ in range(len(share)):
            self.send_next()

    def fail(self, error: YolopipeError) -> None:
        if not self.done.done():
            self.stop(error)
            self.done.set_result(None)

    def stop(self, error: YolopipeError) -> None:
        """Nothing more is sent, and what the workers still hold is cancelled."""
        self.client._unsent -= self.count - self.sent  # never to be sent now
        self.sent = self.count
        self.error = error
        self.images = self.headers = None  # (the worker has its copies)
        for link in self.links:
            link.cancel(self.id)

    def time_out(self, timeout: float) -> None:
        self.fail(RequestTimeout(f"no result within {timeout:g} s"))


class _Link(asyncio.Protocol):
    """The connection to one inference worker, re-made whenever it is lost."""

    def __init__(self, client: InferenceClient, index: int) -> None:
        self.client = client
        self.index = index
        self.status = wire.StatusBlock(client.layout.status(index), writable=False)
        self.transport: asyncio.Transport | None = None
        self._out: list[bytes] = []  # frames to write at the end of this turn of the event loop
        self.ring: Ring | None = None
        self.reader = wire.FrameReader()
        self.waiting: dict[tuple[int, int], tuple[_Request, int]] = {}  # (req, index) → (request, ring offset)
        self.connected = False
        self.info: dict | None = None  # this worker's hello
        self._hello: asyncio.Future | None = None
        self._lost: asyncio.Future | None = None
        self._serial = itertools.count()

    async def keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.create_unix_connection(lambda: self, str(self.client.layout.socket(self.index)))
            except OSError:  # not started yet, or restarting
                await asyncio.sleep(_RECONNECT_S)
                continue
            # This connection's own objects: connection_lost may run during any await below and
            # clear the attributes (or a next connection replace them).
            ring, hello, lost, transport = self.ring, self._hello, self._lost, self.transport
            try:
                info = await asyncio.wait_for(asyncio.shield(hello), 30.0)
                ring.unlink()  # mapped on both sides now: nothing to leave behind
                if lost.done():  # lost right after its hello
                    raise ConnectionError("closed after hello")
                self.client.info = self.info = info
                self.connected = True
                await lost
            except (asyncio.TimeoutError, ConnectionError):
                transport.abort()
                await asyncio.sleep(_RECONNECT_S)
            except Exception as exc:  # noqa: BLE001 (this task must outlive any one connection)
                log.error("connection to inference worker %d failed", self.index, exc_info=exc)
                transport.abort()
                await asyncio.sleep(_RECONNECT_S)

    def connection_made(self, transport: Any) -> None:
        loop = asyncio.get_running_loop()
        self.transport = transport
        self._hello, self._lost = loop.create_future(), loop.create_future()
        self.reader = wire.FrameReader()
        self.ring = Ring(self.client.layout.ring(self.index, next(self._serial)), self.client.settings.ring_bytes)
        transport.write(wire.hello({"ring": str(self.ring.path)}))

    def connection_lost(self, exc: Exception | None) -> None:
        self.connected = False
        self.transport = None
        self._out = []  # the images they named are failed below
        waiting, self.waiting = self.waiting, {}
        if self.ring is not None:
            self.ring.close()  # the worker may still map it (if alive): a new connection gets a new ring
            self.ring = None
        error = DeviceError(f"inference worker {self.index} stopped while this request ran; retry")
        for request, _ in waiting.values():
            request.fail(error)
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(ConnectionError("closed before hello"))
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        for kind, body in self.reader.feed(data):
            if kind == wire.RESULTS:
                answers = read_answers(body)
                positions: dict[_Request, list[int]] = {}  # each waiting request's images in this batch
                keys = zip(answers.tickets["req_id"].tolist(), answers.tickets["index"].tolist())
                for position, key in enumerate(keys):
                    entry = self.waiting.pop(key, None)
                    if entry is None:
                        continue
                    request, offset = entry
                    self.ring.free(offset)
                    positions.setdefault(request, []).append(position)
                if positions:
                    for request, share in zip(positions, answers.split(list(positions.values()))):
                        request.answer(share)
            elif kind == wire.HELLO and self._hello is not None and not self._hello.done():
                self._hello.set_result(wire.read_hello(body))

    def send(self, request: _Request, index: int) -> None:
        data = request.images[index]
        offset = self.ring.put(data) if self.ring is not None else None
        if offset is None:
            raise Overloaded("too much image data is waiting for inference; retry shortly")
        self.waiting[(request.id, index)] = (request, offset)
        request.links.add(self)
        header = request.headers[index] if request.headers is not None else None
        self._write(wire.image(wire.ImageRef(request.id, index, offset, len(data), request.deadline, request.params,
                                             header)))

    def cancel(self, req_id: int) -> None:
        if self.transport is not None:
            self._write(wire.cancel(req_id))

    def _write(self, frame: bytes) -> None:
        """Frames go out together at the end of this turn of the event loop: the requests that
        send in one turn make one write (one system call, one wake-up of the worker), in order."""
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(frame)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and out:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.status.close()


class InferenceClient:
    def __init__(self, settings: Settings, layout: RunLayout) -> None:
        self.settings = settings
        self.layout = layout
        self.info: dict | None = None  # the first worker's hello: model, names, the run shape's limits
        self._ids = itertools.count(1)
        self._links: list[_Link] = []
        self._tasks: list[asyncio.Task] = []
        self._turn = itertools.count()
        self._unsent = 0  # images of admitted requests still waiting for their window here
        self.calls = 0  # detect calls begun, and those not yet over: what "quiet" means to a worker
        self.calls_in_flight = 0
        # Calls waiting for their answers, oldest first, each with the loop time it times out at
        # (every call gets the same timeout, so insertion order is expiry order), and the one
        # timer that wakes for the oldest: ``_time_out_overdue``.
        self._expiring: dict[_Request, float] = {}
        self._expiry_timer: asyncio.TimerHandle | None = None

    async def start(self, wait_s: float = 30.0) -> None:
        """Connect to every worker (in the background, for good); wait up to ``wait_s`` for one."""
        self._links = [_Link(self, i) for i in range(self.layout.workers)]
        self._tasks = [asyncio.create_task(link.keep_connected()) for link in self._links]
        deadline = time.monotonic() + wait_s
        while not self.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in self._links:
            link.close()
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None

    @property
    def max_batch(self) -> int:
        """Images per batch the inference workers run: their run shape's, as they clamped it (their
        hello says it). Before any hello, the settings' (until then every call is refused)."""
        return (self.info or {}).get("max_batch", self.settings.max_batch)

    @property
    def window(self) -> int:
        """Images of one request at the inference workers at once (``Settings.window`` of ``max_batch``)."""
        return self.settings.window(self.max_batch)

    @property
    def ready(self) -> bool:
        """An inference worker is ready (and the service's first start is over: it starts ready
        with every worker, and stays ready while one of them is)."""
        if self.layout.starting.exists():
            return False
        return any(link.connected and link.status.read().state == wire.READY for link in self._links)

    def workers(self) -> list[dict]:
        """Each inference worker as an operator sees it: ready, queued images, pid, device, what it
        is doing while it starts (its warm-up step), and once started, its start-up step by step."""
        out = []
        for i, link in enumerate(self._links):
            load = link.status.read() if link.connected else None
            info = link.info or {}
            ready = load is not None and load.state == wire.READY
            out.append({"worker": i, "ready": ready,
                        # the pid of a worker this process is connected to: a lost one's is gone
                        "queued_images": load.pending if load else 0, "pid": info.get("pid") if link.connected else None,
                        "device": info.get("device"), "restarts": info.get("generation", 0),
                        "phase": "" if ready else (link.status.read_phase() or "starting"),
                        "startup": info.get("startup"),
                        "standby_ready": link.status.read_standby() != 0})
        return out

    def pick(self) -> _Link:
        """The connected worker with the least queued work; Overloaded when none is ready."""
        best: tuple[float, int] | None = None
        chosen: _Link | None = None
        turn = next(self._turn)
        n = len(self._links)
        for k in range(n):
            link = self._links[(turn + k) % n]  # rotate, so that equal loads share the work
            if not link.connected:
                continue
            load = link.status.read()
            if load.state != wire.READY:
                continue
            # The work queued ahead of this image, counting what this HTTP worker sent that the
            # worker has not taken in yet (a batch request sends several before the status moves):
            # idle workers tie, and the rotation shares the work.
            ahead = max(load.pending, len(link.waiting))
            key = (wire.queued_seconds(ahead, load.seconds_per_image, load.in_flight), ahead)
            if best is None or key < best:
                best, chosen = key, link
        if chosen is None:
            raise _no_worker()
        return chosen

    def admit(self, images: int) -> None:
        """Overloaded, before anything is sent, when a request of ``images`` images would not be
        done within the budget: its images behind everything queued at the ready workers and
        everything this HTTP worker has yet to send, at the workers' measured rate (in-flight batches over
        seconds per image, summed). An idle server still takes a request of one image, however
        slow (the budget could refuse everything else); a larger one whose own work is over the
        budget is refused even then."""
        ahead, rate, unmeasured = self._unsent, 0.0, False
        for link in self._links:
            if not link.connected:
                continue
            load = link.status.read()
            if load.state != wire.READY:
                continue
            ahead += max(load.pending, len(link.waiting))
            if load.seconds_per_image > 0:
                rate += max(load.in_flight, 1) / load.seconds_per_image
            else:
                unmeasured = True  # no batch timed yet: nothing to judge by
        if rate == 0.0 and not unmeasured:
            raise _no_worker()
        if unmeasured or (images == 1 and ahead == 0):
            return
        seconds = (ahead + images) / rate
        if seconds > self.settings.budget_s:
            raise wire.over_budget(seconds, self.settings.budget_s, images=images, ahead=ahead)

    async def detect(self, images: list[bytes], params: DetectParams,
                     headers: list[ImageHeader] | None = None) -> Answers:
        """Each image's answer, in the request's order (its own error inside). ``headers``: each image's, as
        checked here; they travel with the bytes, so the inference worker does not read them
        again. Raises Overloaded, DeviceError or RequestTimeout when the request as a whole
        cannot be served."""
        self.calls += 1
        self.calls_in_flight += 1
        try:
            return await self._detect(images, params, headers)
        finally:
            self.calls_in_flight -= 1

    async def _detect(self, images: list[bytes], params: DetectParams,
                      headers: list[ImageHeader] | None) -> Answers:
        timeout = self.settings.request_timeout_s
        self.admit(len(images))
        request = _Request(self, images, params, time.monotonic() + timeout, headers)
        for _ in range(min(len(images), self.window)):
            request.send_next()
        self._expire_at(request, timeout + _GRACE_S)
        try:
            await request.done
        except asyncio.CancelledError:  # the client went away: stop the work it left queued
            if request.done.cancelled():  # (else every image was answered just before)
                request.stop(RequestTimeout("the client went away"))
            raise
        finally:
            self._expiring.pop(request, None)
        # Raised below, the error's traceback holds this frame (and ``images``): neither the
        # request (a worker may still answer its images) nor this frame may hold the error.
        shares, error, request.error = request.shares, request.error, None
        del request
        if error is None:
            return Answers.joined(shares)
        try:
            raise error
        finally:
            del error  # this frame (in its traceback) must not hold it: a cycle that holds ``images``

    def _expire_at(self, request: _Request, after_s: float) -> None:
        """Time ``request`` out ``after_s`` from now unless it is over by then (``_detect`` takes
        it off ``_expiring`` when it is). One timer for all calls, armed for the oldest, instead
        of a timer made and cancelled per call (under load, each answered call cost one)."""
        loop = asyncio.get_running_loop()
        self._expiring[request] = loop.time() + after_s
        if self._expiry_timer is None:
            self._expiry_timer = loop.call_at(self._expiring[request], self._time_out_overdue)

    def _time_out_overdue(self) -> None:
        """The timer: every call past its time is timed out, then the timer waits for the oldest left."""
        self._expiry_timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        timeout = self.settings.request_timeout_s
        while self._expiring:
            request, at = next(iter(self._expiring.items()))
            if at > now:
                self._expiry_timer = loop.call_at(at, self._time_out_overdue)
                return
            del self._expiring[request]
            request.time_out(timeout)


def _no_worker() -> Overloaded:
    return Overloaded("no inference worker is ready (starting or restarting); retry shortly")

"""The inference worker's stream host: the video streams of ``/v1/streams`` run here, and their
frames go through the worker's batcher (``BatcherFrames``), so they share batches with the
HTTP workers' images and with each other; their answers come back as arrays, never encoded (the
batcher's ``deliver`` hands this process's share over as it is). A frame the batcher refuses
(over its time budget) comes back as an error and is counted with the stream's drops. Each
processed frame's event is written once, as JSON text (``app.predict.streams.event_lines``).

Control and events come on the worker's streams socket (``app.ipc.streams`` has the protocol).
Events go to each subscriber through the event loop; a subscriber that reads slower than the
stream runs loses events (its socket buffer is bounded), never slows the stream or the others.
Per-stream fps, drops and latency go to the worker's metrics every second.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from app.contracts import DetectedBatch, DetectParams
from app.errors import InvalidParameter, YolopipeError
from app.ipc import wire
from app.ipc.answers import Answers
from app.ipc.streams import check_stream_source, stream_socket
from app.predict.streams import StreamFrame, StreamRunner, TrackIds, event_lines
from app.service.inference.batcher import Job

log = logging.getLogger("yolopipe.serving")

SUBSCRIBER_BUFFER_BYTES = 1 << 20  # events queued for one slow subscriber before its next ones are skipped


class StreamHost:
    def __init__(self, worker: int, settings: Any, detector: Any, layout: Any,
                 loop: asyncio.AbstractEventLoop, batcher: Any) -> None:
        self.worker, self.settings, self.detector, self.layout, self.loop = worker, settings, detector, layout, loop
        self.frames = BatcherFrames(batcher, DetectParams(), settings.budget_s)
        self.runner = StreamRunner(detector, DetectParams(), self._on_frames, max_streams=settings.max_streams,
                                   detect=self.frames.detect, open_timeout_s=settings.stream_open_timeout_s)
        self._subscribers: dict[str, set[asyncio.Transport]] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self.runner.run, kwargs={"until_done": False},
                                        name="yolopipe-streams", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._stop = threading.Event()
        self._metrics = _StreamMetrics(str(worker))

    async def start(self) -> None:
        path = stream_socket(self.layout, self.worker)
        path.unlink(missing_ok=True)
        self._server = await self.loop.create_unix_server(lambda: _Control(self), str(path))
        self._thread.start()
        threading.Thread(target=self._publish_metrics, name="yolopipe-stream-metrics", daemon=True).start()

    async def close(self) -> None:
        """On the event loop: stop listening, end every subscription, then stop the streams."""
        self._stop.set()
        if self._server is not None:
            self._server.close()
        for stream_id in list(self._subscribers):
            self._end(stream_id, "server stopping")
        self.runner.stop()
        await asyncio.to_thread(self._thread.join, 10)

    # --- requests (on the event loop) ----------------------------------------------------
    def handle(self, message: dict[str, Any], transport: asyncio.Transport) -> dict[str, Any] | None:
        op = message.get("op")
        if op == "list":
            return {"ok": True, "streams": [s.snapshot() for s in self.runner.streams()]}
        if op == "add":
            source = check_stream_source(message.get("source"), self.settings)
            stride, track = int(message.get("vid_stride", 1)), bool(message.get("track", False))
            # A file plays at its own frame rate, as a camera would (a server stream is not a batch job).
            stream = self.runner.add(source, stream_id=f"{self.worker}-{next(self._ids)}", vid_stride=stride,
                                     track=track, realtime=True)
            log.info("stream %s added: %s", stream.id, stream.shown)
            return {"ok": True, "stream": stream.snapshot()}
        if op == "delete":
            stream_id = str(message.get("id"))
            removed = self.runner.remove(stream_id)
            for t in self._subscribers.pop(stream_id, set()):
                t.write(wire.stream_message({"end": "removed"}))
                t.close()
            return {"ok": removed}
        if op == "events":
            stream_id = str(message.get("id"))
            if self.runner.get(stream_id) is None:
                return {"ok": False}
            transport.write(wire.stream_message({"ok": True}))
            self._subscribers.setdefault(stream_id, set()).add(transport)
            return None  # the answers are the events
        raise InvalidParameter(f"unknown stream operation {op!r}")

    def unsubscribe(self, transport: asyncio.Transport) -> None:
        for transports in self._subscribers.values():
            transports.discard(transport)

    # --- the runner thread -------------------------------------------------------------
    def _on_frames(self, frames: list[StreamFrame], answers: DetectedBatch, track_ids: TrackIds) -> None:
        watched = [k for k, f in enumerate(frames) if self._subscribers.get(f.stream.id)]
        if not watched:
            return
        if len(watched) < len(frames):
            frames, answers = [frames[k] for k in watched], answers.take(watched)
            track_ids = [track_ids[k] for k in watched]
        events = event_lines(frames, answers, track_ids, self.detector.names)
        for frame, event in zip(frames, events):
            self.loop.call_soon_threadsafe(self._send, frame.stream.id, wire.stream_event(event))

    def _send(self, stream_id: str, data: bytes) -> None:
        for t in list(self._subscribers.get(stream_id, ())):
            if t.is_closing():
                self._subscribers[stream_id].discard(t)
            elif t.get_write_buffer_size() < SUBSCRIBER_BUFFER_BYTES:
                t.write(data)

    def _publish_metrics(self) -> None:
        while not self._stop.wait(1.0):
            for stream in self.runner.streams():
                self._metrics.update(stream.snapshot())
            for stream_id in list(self._subscribers):
                stream = self.runner.get(stream_id)
                if stream is not None and stream.finished and stream.delivered:  # "end" after the last event
                    self.loop.call_soon_threadsafe(self._end, stream_id, stream.state)

    def _end(self, stream_id: str, state: str) -> None:
        for t in self._subscribers.pop(stream_id, set()):
            t.write(wire.stream_message({"end": state}))
            t.close()


class BatcherFrames:
    """Stream frames as jobs of the worker's batcher. It is the jobs' owner: the batcher's
    ``deliver`` hands it its share of each batch's answers (``take_answers``, on the batch's
    thread) as arrays, where an HTTP worker's share is encoded and sent."""

    def __init__(self, batcher: Any, params: DetectParams, budget_s: float) -> None:
        self.batcher, self.params, self.budget_s = batcher, params, budget_s
        self._waiting: dict[tuple[int, int], Future] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def detect(self, images: list[np.ndarray]) -> DetectedBatch:
        """Blocks the runner's thread until the batcher has answered every frame."""
        req_id = next(self._ids)
        deadline = time.monotonic() + self.budget_s
        futures = []
        for i, image in enumerate(images):
            future: Future = Future()
            with self._lock:
                self._waiting[(req_id, i)] = future
            futures.append(future)
            refused = self.batcher.admit(Job(self, wire.ImageRef(req_id, i, 0, 0, deadline, self.params), image))
            if refused is not None:
                with self._lock:
                    self._waiting.pop((req_id, i), None)
                future.set_result(DetectedBatch.failed([refused]))
        return DetectedBatch.concat([f.result() for f in futures])

    def take_answers(self, answers: Answers) -> None:
        """This owner's share of a batch's answers: each frame's own, to the runner waiting for it."""
        detected = answers.detected
        keys = zip(answers.tickets["req_id"].tolist(), answers.tickets["index"].tolist())
        for k, key in enumerate(keys):
            with self._lock:
                future = self._waiting.pop(key, None)
            if future is not None:
                future.set_result(detected.take([k]))


class _Control(asyncio.Protocol):
    def __init__(self, host: StreamHost) -> None:
        self.host = host
        self.reader = wire.FrameReader()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.host.unsubscribe(self.transport)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        for kind, body in self.reader.feed(data):
            if kind != wire.STREAM:
                self.transport.close()
                return
            try:
                answer = self.host.handle(wire.read_stream_message(body), self.transport)
            except YolopipeError as exc:
                answer = {"error": {"code": exc.code, "message": str(exc)}}
            except (ValueError, TypeError) as exc:
                answer = {"error": {"code": InvalidParameter.code, "message": str(exc)}}
            if answer is not None:
                self.transport.write(wire.stream_message(answer))


class _StreamMetrics:
    """Gauges per stream (prometheus multiprocess files: the HTTP workers render them)."""

    def __init__(self, worker: str) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        r = CollectorRegistry()
        labels = ["worker", "stream"]
        self.fps = Gauge("yolopipe_stream_fps", "Frames per second processed, per stream (last 5 s)", labels,
                         multiprocess_mode="liveall", registry=r)
        self.dropped = Gauge("yolopipe_stream_dropped_frames", "Frames a live stream dropped because the model "
                             "was busy (its newest frames win)", labels, multiprocess_mode="liveall", registry=r)
        self.latency = Gauge("yolopipe_stream_latency_seconds", "Read-to-result latency per stream", labels +
                             ["quantile"], multiprocess_mode="liveall", registry=r)
        self.worker = worker

    def update(self, snap: dict[str, Any]) -> None:
        key = (self.worker, snap["id"])
        self.fps.labels(*key).set(snap["fps"])
        self.dropped.labels(*key).set(snap["dropped"])
        for q in ("50", "99"):
            ms = snap[f"latency_p{q}_ms"]
            if ms is not None:
                self.latency.labels(*key, f"0.{q}").set(ms / 1e3)

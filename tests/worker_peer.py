"""A scripted inference worker for the HTTP side's tests: it speaks the real wire protocol
over a real Unix socket and reads the real shared-memory ring, and does on cue what a worker
can do to its HTTP workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from app.contracts import DetectedBatch
from app.errors import Overloaded
from app.ipc import wire
from app.ipc.answers import Answers, answers_frame, tickets
from app.ipc.layout import RunLayout
from app.ipc.ring import map_ring
from app.types import Detections

# What the "detect" action answers for every image.
DETECTIONS = Detections(np.array([[1.5, 2.25, 30.125, 40.5], [0.0, 0.0, 10.0, 12.0]], np.float32),
                        np.array([0.875, 0.3125], np.float32), np.array([1, 0], np.int32))


class Peer(asyncio.Protocol):
    """One connection of the scripted inference worker. ``script``: what each connection does
    in turn — "hello-then-close" (the link drops right after the handshake), "close-on-image"
    (mid-request), "answer" (reads the image from the ring and answers with its length),
    "detect" (answers each image with ``DETECTIONS``, its size its length × 1, and fixed timings),
    "overloaded" (answers each image with that error), "silent" (never answers)."""

    def __init__(self, script: list[str], seen: list[bytes]) -> None:
        self.action = script.pop(0) if len(script) > 1 else script[0]
        self.seen = seen
        self.reader = wire.FrameReader()
        self.ring = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for kind, body in self.reader.feed(data):
            if kind == wire.HELLO:
                self.ring = map_ring(Path(wire.read_hello(body)["ring"]))
                self.transport.write(wire.hello({"class_names": ["a", "b"], "generation": 0, "pid": os.getpid()}))
                if self.action == "hello-then-close":
                    self.transport.close()
            elif kind == wire.IMAGE:
                ref = wire.read_image(body)
                if self.action == "close-on-image":
                    self.transport.close()
                    return
                if self.action == "overloaded":
                    error = Overloaded("the queue holds 99 s of work")
                    self.transport.write(answers_frame(Answers.failed([ref.req_id], [ref.index], [error])))
                    return
                if self.action == "silent":
                    return
                self.seen.append(bytes(self.ring[ref.offset : ref.offset + ref.length]))
                if self.action == "detect":
                    rows = np.column_stack([DETECTIONS.boxes, DETECTIONS.scores, DETECTIONS.class_ids]).astype(np.float32)
                    answer = DetectedBatch(np.array([ref.length]), np.array([1]), np.array([len(rows)]), rows)
                    self.transport.write(answers_frame(Answers(answer, tickets(
                        [ref.req_id], [ref.index], decode_ms=1.25, queue_ms=0.5, batch_ms=2.5))))
                    continue
                answer = DetectedBatch(np.array([ref.length]), np.array([1]), np.array([0]), np.zeros((0, 6), np.float32))
                self.transport.write(answers_frame(Answers(answer, tickets([ref.req_id], [ref.index]))))


@contextlib.contextmanager
def ready_worker_layout() -> Iterator[RunLayout]:
    """A run layout for one inference worker whose status block says it is ready."""
    layout = RunLayout.create(1)
    status = wire.StatusBlock(layout.status(0), writable=True)
    status.write(wire.Load(0, wire.READY, 0, 0.001, 1))
    try:
        yield layout
    finally:
        status.close()
        layout.remove()

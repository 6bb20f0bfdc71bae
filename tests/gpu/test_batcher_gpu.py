"""The inference worker's batcher on a real GPU pipeline: the largest bucket first, the others
behind it, and a batch of JPEGs read from a shared-memory ring, each with the header the HTTP
worker read (as the wire carries it), answered as the detector answers them without a header
read again."""

from __future__ import annotations

import queue
import time

import pytest

from app.contracts import RunShape
from app.imaging.check import check_image
from app.ipc.answers import answers_frame, read_answers
from app.ipc.ring import Ring, map_ring
from app.ipc.wire import FrameReader, ImageRef, image, read_image
from app.pipeline.detector import Detector
from app.service.inference.batcher import Batcher, Job
from app.service.inference.metrics import WorkerMetrics
from tests.references import detections_json, image_answers
from tests.standins import count_header_reads

pytestmark = pytest.mark.requires_gpu


def test_the_batcher_warms_the_buckets_and_answers_a_batch_as_the_detector_does(gpu, sample_model_dir, meta,
                                                                                 assets_dir, tmp_path, monkeypatch):
    pipeline = gpu.make_pipeline(sample_model_dir, meta, "fp16", max_batch=8, in_flight=2)
    detector = Detector(pipeline, RunShape(max_batch=8, in_flight=2, max_wait_ms=50, letterbox="square"))
    answers: queue.Queue = queue.Queue()

    def deliver(jobs, batch_answers):
        for outcome in image_answers(read_answers(FrameReader().feed(answers_frame(batch_answers))[0][1])):
            answers.put(outcome)

    steps: list[str] = []
    batcher = Batcher(detector, budget_s=60.0, deliver=deliver, metrics=WorkerMetrics("0"))
    ring = Ring(tmp_path / "ring", 16 * 2**20)
    try:
        batcher.start((1, 8), steps.append, pipeline.buckets)
        assert steps[0] == "capturing batch bucket 8, which takes every batch until the smaller ones are captured"
        assert all(slot.graphs.get(8) is not None for slot in pipeline.slots)  # ready: the largest on every slot
        deadline = time.monotonic() + 60  # the others, captured by a thread of their own meanwhile
        while time.monotonic() < deadline and not all(slot.graphs.get(b) for slot in pipeline.slots for b in (1, 2, 4)):
            time.sleep(0.05)
        assert all(slot.graphs.get(b) is not None for slot in pipeline.slots for b in (1, 2, 4))
        view = map_ring(ring.path)
        images = [(assets_dir / name).read_bytes() for name in ("bus.jpg", "zidane.jpg")] * 3
        jobs = []
        for i, data in enumerate(images):
            offset = ring.put(data)
            ref = ImageRef(1, i, offset, len(data), time.monotonic() + 60, detector.params(), check_image(data))
            ref = read_image(FrameReader().feed(image(ref))[0][1])  # its header as the wire brings it
            jobs.append(Job("a", ref, view[offset : offset + len(data)]))
        reads = count_header_reads(monkeypatch)
        assert batcher.admit_many(jobs) == [None] * len(jobs)
        got = sorted((answers.get(timeout=60) for _ in images), key=lambda o: o.index)
        assert reads == []  # the GPU decoder took each JPEG's header from the wire
        expected = detector.detect(images, detector.params())  # the same images in one batch of the same bucket
        for o, e in zip(got, expected):
            assert o.error is None and (o.width, o.height) == (e.width, e.height)
            assert detections_json(o.detections, detector.names) == detections_json(e.detections, detector.names) != []
    finally:
        batcher.close(10.0)
        ring.close()
        pipeline.close()

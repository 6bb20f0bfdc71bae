"""The inference worker's batcher on the real detector (CPU backend, sample model), in-process.

Images reach it as the worker gets them: views of bytes in a shared-memory ring. Faults are
injected into the real pipeline (``pipeline.run`` wrapped on the instance): a gate that holds
a batch thread inside a batch, or one raised exception. Each harness runs the real pipeline
under a run shape of its own (``max_batch``, ``max_wait_ms``), as ``app.runtime`` would hand it.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest

from app.contracts import DetectParams, EncodedImage
from app.errors import DeviceError, Overloaded, RequestTimeout
from app.ipc.answers import answers_frame, read_answers
from app.ipc.ring import Ring, map_ring
from app.ipc.wire import FrameReader, ImageRef
from app.pipeline.detector import Detector
from app.service.inference.batcher import Batcher, Job
from app.service.inference.metrics import WorkerMetrics
from tests.references import detections_json, image_answers
from tests.standins import DecodesItself, ReportsLikeTheGpu, count_header_reads


@pytest.fixture(scope="module")
def detector(cpu_detector):
    return cpu_detector


@pytest.fixture(scope="module")
def bus_mirror(bus) -> bytes:
    """Another photo of bus.jpg's size (810 × 1080): one input size (640 × 480) with it."""
    import cv2
    import numpy as np

    return cv2.imencode(".jpg", cv2.imdecode(np.frombuffer(bus, np.uint8), cv2.IMREAD_COLOR)[:, ::-1])[1].tobytes()


class Harness:
    """A started batcher, a ring holding the images, and every answer in delivery order."""

    def __init__(self, detector, ring_path, *, max_batch: int = 4, max_wait_ms: float = 5, pipeline=None,
                 **options) -> None:
        self.answers: queue.Queue = queue.Queue()
        self.ring = Ring(ring_path, 64 * 1024 * 1024)
        self.view = map_ring(ring_path)
        shape = replace(detector.shape, max_batch=max_batch, max_wait_ms=max_wait_ms)
        self.detector = Detector(pipeline or detector.pipeline, shape)  # the real pipeline, this run shape
        options = {"budget_s": 600.0, **options}
        self.batcher = Batcher(self.detector, deliver=self._deliver, metrics=WorkerMetrics("0"), **options)
        self.batcher.start()

    def _deliver(self, jobs, answers) -> None:
        # Through the wire, as the HTTP worker reads them.
        read = read_answers(FrameReader().feed(answers_frame(answers))[0][1])
        outcomes = image_answers(read)
        assert [(o.req_id, o.index) for o in outcomes] == [(j.ref.req_id, j.ref.index) for j in jobs]
        for outcome in outcomes:
            self.answers.put((outcome, outcome.batch))

    def job(self, data: bytes, req_id: int, index: int = 0, *, owner: str = "a", deadline_s: float = 60.0,
            params: DetectParams = DetectParams(), header=None) -> Job:
        offset = self.ring.put(data)
        ref = ImageRef(req_id, index, offset, len(data), time.monotonic() + deadline_s, params, header)
        return Job(owner, ref, self.view[offset : offset + len(data)])

    def admit(self, *jobs: Job) -> None:
        for job in jobs:
            assert self.batcher.admit(job) is None

    def collect(self, n: int, timeout: float = 120.0) -> list:
        return [self.answers.get(timeout=timeout) for _ in range(n)]

    def close(self) -> None:
        self.batcher.close(30.0)
        self.ring.close()


@pytest.fixture()
def harness(detector, tmp_path):
    made = []

    def make(**options) -> Harness:
        h = Harness(detector, tmp_path / f"ring{len(made)}", **options)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@contextmanager
def gated(detector):
    """Hold every ``pipeline.run`` until the gate opens; ``entered`` records each batch's size."""
    gate = threading.Event()
    entered: list[int] = []
    real_run = detector.pipeline.run

    def run(images, params, **kwargs):
        entered.append(len(images))
        gate.wait(60)
        return real_run(images, params, **kwargs)

    detector.pipeline.run = run
    try:
        yield gate, entered
    finally:
        gate.set()
        del detector.pipeline.run


def wait_until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_waiting_images_of_many_requests_run_as_one_batch_and_equal_the_detector(harness, detector, bus, bus_mirror):
    h = harness()
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1))
        wait_until(lambda: entered == [1])  # a batch thread is inside the first batch
        images = [bus, bus_mirror, bus]
        h.admit(*(h.job(data, 10 + i) for i, data in enumerate(images)))
        gate.set()
        answers = h.collect(4)
    assert entered == [1, 3]
    by_req = {o.req_id: (o, t) for o, t in answers}
    names = detector.names
    for i, data in enumerate(images):
        outcome, timings = by_req[10 + i]
        (direct,) = detector.detect([data], detector.params())
        assert outcome.error is None and (outcome.width, outcome.height) == (direct.width, direct.height)
        assert detections_json(outcome.detections, names) == detections_json(direct.detections, names) != []
        assert timings["batch_ms"] > 0 and outcome.queue_ms > 0 and outcome.decode_ms > 0
        assert set(timings) == {"batch_ms", "pipeline_decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms"}
        # the CPU pipeline's stage times travel as numbers (its images come decoded: no pipeline decode)
        assert timings["preprocess_ms"] > 0 and timings["infer_ms"] > 0 and timings["pipeline_decode_ms"] == 0
        assert timings["infer_ms"] < timings["batch_ms"]
    assert h.batcher.load().pending == 0


def test_waiting_images_are_batched_by_their_input_size(harness, detector, bus, bus_mirror, zidane):
    """Rect: a batch holds images of one model input size, read from the header the HTTP worker
    read, turned by its EXIF orientation (a photo stored on its side with orientation 6 runs with
    the upright ones); the oldest request's size goes first, and every answer is the image's own."""
    import cv2
    import numpy as np

    from app.benchmark.workloads import with_exif_orientation
    from app.imaging.check import check_image

    upright = cv2.imdecode(np.frombuffer(bus_mirror, np.uint8), cv2.IMREAD_COLOR)
    on_its_side = with_exif_orientation(cv2.imencode(".jpg", cv2.rotate(upright, cv2.ROTATE_90_COUNTERCLOCKWISE))[1]
                                        .tobytes(), 6)
    assert check_image(on_its_side).height == 810 and check_image(on_its_side).upright_size == (1080, 810)
    h = harness()
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1, header=check_image(bus)))
        wait_until(lambda: entered == [1])
        images = [zidane, bus, on_its_side, zidane]  # 384 × 640, 640 × 480, 640 × 480, 384 × 640
        h.admit(*(h.job(data, 10 + i, header=check_image(data)) for i, data in enumerate(images)))
        gate.set()
        answers = h.collect(5)
    assert entered == [1, 2, 2]  # the zidanes first (request 10 waited longest), then the two of bus' size
    assert [o.req_id for o, _ in answers][1:] == [10, 13, 11, 12]
    by_req = {o.req_id: o for o, _ in answers}
    for i, data in enumerate(images):
        (direct,) = detector.detect([data], detector.params())
        assert (by_req[10 + i].width, by_req[10 + i].height) == (direct.width, direct.height)
        assert detections_json(by_req[10 + i].detections, detector.names) == \
            detections_json(direct.detections, detector.names) != []


def test_a_batch_request_of_two_sizes_is_taken_a_size_at_a_time(harness, detector, bus, zidane):
    """One request's images of two sizes: each batch takes the request's images of its size,
    wherever they wait in its queue, rather than one image per batch."""
    from app.imaging.check import check_image

    h = harness()
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1, header=check_image(bus)))
        wait_until(lambda: entered == [1])
        images = [zidane, bus, zidane, bus, zidane]
        h.admit(*(h.job(data, 2, i, header=check_image(data)) for i, data in enumerate(images)))
        gate.set()
        answers = h.collect(6)
    assert entered == [1, 3, 2]
    assert [o.index for o, _ in answers][1:] == [0, 2, 4, 1, 3] and all(o.error is None for o, _ in answers)


def test_round_robin_runs_a_single_image_before_a_big_request_is_done(harness, detector, bus):
    h = harness(max_batch=2)
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1))
        wait_until(lambda: entered == [1])
        h.admit(*(h.job(bus, 2, i) for i in range(6)))  # a big request queued first
        h.admit(h.job(bus, 3))  # then a single image
        gate.set()
        order = [o.req_id for o, _ in h.collect(8)]
    # FIFO would answer it last; round-robin puts it in the batch right after the first.
    assert order.index(3) <= 2, order
    assert entered == [1, 2, 2, 2, 1]


def test_admission_is_bounded_in_seconds_of_work(harness, detector, bus):
    h = harness()
    spi = h.batcher.load().seconds_per_image
    assert spi > 0  # measured by the warm-up
    h.batcher.budget_s = 3.5 * spi  # room for three images' worth of work
    with gated(detector) as (gate, entered):
        h.admit(*(h.job(bus, i) for i in range(3)))
        refused = h.batcher.admit(h.job(bus, 99))
        assert isinstance(refused, Overloaded) and "budget" in str(refused)
        assert h.batcher.load().pending == 3
        gate.set()
        assert {o.req_id for o, _ in h.collect(3)} == {0, 1, 2}
    assert h.batcher.admit(h.job(bus, 100)) is None  # room again once the work is done
    h.collect(1)


def test_an_empty_queue_admits_even_an_image_longer_than_the_budget(harness, bus):
    h = harness()
    h.batcher.budget_s = h.batcher.load().seconds_per_image / 10
    assert h.batcher.admit(h.job(bus, 1)) is None
    assert isinstance(h.batcher.admit(h.job(bus, 2)), Overloaded)
    (outcome, _), = h.collect(1)
    assert outcome.error is None


def test_images_past_their_deadline_are_answered_without_running(harness, detector, bus):
    h = harness()
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1))
        wait_until(lambda: entered == [1])
        h.admit(h.job(bus, 2, deadline_s=0.05))
        time.sleep(0.1)
        gate.set()
        answers = {o.req_id: o for o, _ in h.collect(2)}
    assert isinstance(answers[2].error, RequestTimeout)
    assert entered == [1]
    assert h.batcher.load().pending == 0


def test_a_cancelled_request_is_answered_without_running_and_others_go_on(harness, detector, bus):
    h = harness()
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1))
        wait_until(lambda: entered == [1])
        h.admit(h.job(bus, 2, 0), h.job(bus, 2, 1), h.job(bus, 3))
        h.batcher.cancel("a", 2)
        cancelled = h.collect(2)
        assert {(o.req_id, o.index) for o, _ in cancelled} == {(2, 0), (2, 1)}
        assert all(isinstance(o.error, Overloaded) for o, _ in cancelled)
        gate.set()
        answers = {o.req_id: o for o, _ in h.collect(2)}
    assert answers[3].error is None and entered == [1, 1]


def test_a_departed_owner_is_forgotten(harness, detector, bus):
    h = harness()
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1))
        wait_until(lambda: entered == [1])
        h.admit(h.job(bus, 2, owner="gone"), h.job(bus, 3, owner="gone"))
        h.batcher.drop_owner("gone")
        assert h.batcher.load().pending == 1
        gate.set()
        (outcome, _), = h.collect(1)
    assert outcome.req_id == 1 and entered == [1]
    assert h.answers.empty()


def test_a_device_failure_fails_that_batch_and_the_next_one_serves(harness, detector, bus):
    h = harness()
    real_run = detector.pipeline.run
    calls = []

    def failing_once(images, params, **kwargs):
        calls.append(len(images))
        if len(calls) == 1:
            raise RuntimeError("CUDA error: out of memory")
        return real_run(images, params, **kwargs)

    detector.pipeline.run = failing_once
    try:
        h.admit(h.job(bus, 1))
        (failed, _), = h.collect(1)
        h.admit(h.job(bus, 2))
        (served, _), = h.collect(1)
    finally:
        del detector.pipeline.run
    assert isinstance(failed.error, DeviceError) and "RuntimeError" in str(failed.error)
    assert served.error is None and served.detections is not None and len(served.detections) > 0


def test_a_bad_image_fails_alone_in_its_batch(harness, detector, bus):
    h = harness()
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1))
        wait_until(lambda: entered == [1])
        h.admit(h.job(bus[:300], 2), h.job(bus, 3))
        gate.set()
        answers = {o.req_id: o for o, _ in h.collect(3)}
    assert answers[2].error is not None and answers[2].error.code == "invalid_image"
    assert answers[3].error is None and entered == [1, 1]


def test_close_finishes_admitted_work_and_refuses_new(harness, detector, bus):
    h = harness()
    with gated(detector) as (gate, entered):
        h.admit(h.job(bus, 1), h.job(bus, 2))
        wait_until(lambda: entered)
        closer = threading.Thread(target=h.batcher.close, args=(60.0,))
        closer.start()
        wait_until(lambda: h.batcher.load().state == 2)  # draining
        refused = h.batcher.admit(h.job(bus, 3))
        assert isinstance(refused, Overloaded) and "shutting down" in str(refused)
        gate.set()
        closer.join(60)
    answers = {o.req_id: o for o, _ in h.collect(2)}
    assert answers[1].error is None and answers[2].error is None


def test_a_batch_thread_that_raises_answers_its_batch_with_an_error_and_serves_on(harness, bus):
    h = harness()
    real_prepare = h.detector.prepare
    calls = []

    def surprising_once(item):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a decoder surprise, not one of ours")
        return real_prepare(item)

    h.detector.prepare = surprising_once
    h.admit(h.job(bus, 1))
    (failed, _), = h.collect(1)
    assert h.batcher.load().pending == 0  # the failed job is no longer counted as queued work
    h.admit(h.job(bus, 2))
    (served, _), = h.collect(1)
    assert isinstance(failed.error, DeviceError) and "ValueError" in str(failed.error)
    assert served.error is None and len(served.detections) > 0
    assert h.batcher.load().pending == 0 and h.batcher.fatal is None


def test_a_lost_device_context_refuses_work_answers_the_queue_and_asks_for_a_restart(harness, detector, bus):
    h = harness()
    lost: list[str] = []
    h.batcher.on_fatal = lost.append
    gate = threading.Event()
    entered: list[int] = []

    def dead_context(images, params, **kwargs):
        entered.append(len(images))
        gate.wait(60)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    detector.pipeline.run = dead_context
    try:
        h.admit(h.job(bus, 1))
        wait_until(lambda: entered == [1])
        h.admit(h.job(bus, 2))  # queued behind the batch that will find the context dead
        gate.set()
        answers = {o.req_id: o for o, _ in h.collect(2)}
        assert isinstance(answers[1].error, DeviceError) and isinstance(answers[2].error, DeviceError)
        assert entered == [1]  # the queued image was answered, not run on a dead device
        assert len(lost) == 1 and "illegal memory access" in lost[0]
        assert h.batcher.load().state == 2 and h.batcher.load().pending == 0  # draining: routed elsewhere
        assert isinstance(h.batcher.admit(h.job(bus, 3)), Overloaded)
    finally:
        del detector.pipeline.run


def test_an_ordinary_device_error_is_not_taken_for_a_lost_context():
    from app.service.inference.warmup import is_sticky_device_error

    assert not is_sticky_device_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_sticky_device_error(RuntimeError("CUDA error: unspecified launch failure"))
    wrapped = DeviceError("batch failed")
    wrapped.__cause__ = RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    assert is_sticky_device_error(wrapped)


def test_a_jpeg_that_comes_with_its_header_reaches_a_pipeline_that_decodes_it_unparsed(harness, detector, bus,
                                                                                     zidane, monkeypatch):
    """The HTTP worker read each header: the batcher hands the bytes on with it (``EncodedImage``)
    to a pipeline that decodes JPEGs itself (the GPU's; here a stand-in that decodes with the
    header it is given), and nothing in this process reads a header again."""
    from app.imaging.check import check_image

    pipeline = DecodesItself(detector.pipeline)
    h = harness(pipeline=pipeline)
    headers = {req: check_image(data) for req, data in ((1, bus), (2, zidane))}  # as the HTTP worker read them
    pipeline.received.clear()  # the warm-up's gray frames
    reads = count_header_reads(monkeypatch)
    h.admit(h.job(bus, 1, header=headers[1]), h.job(zidane, 2, header=headers[2]))
    answers = {o.req_id: o for o, _ in h.collect(2)}
    assert reads == []
    assert [(type(x), x.header) for x in pipeline.received] == [(EncodedImage, headers[1]), (EncodedImage, headers[2])]
    ring = np.frombuffer(h.view, np.uint8)
    for x, data in zip(pipeline.received, (bus, zidane)):  # read where the HTTP worker put them, never copied
        assert x.data.tobytes() == data and np.shares_memory(x.data, ring)
    for req, data in ((1, bus), (2, zidane)):
        (direct,) = detector.detect([data], detector.params())
        assert (detections_json(answers[req].detections, detector.names)
                == detections_json(direct.detections, detector.names) != [])


def test_bytes_without_a_header_are_read_once(harness, detector, bus, monkeypatch):
    """An image whose header did not come with it is read here, once, and travels on with it."""
    pipeline = DecodesItself(detector.pipeline)
    h = harness(pipeline=pipeline)
    pipeline.received.clear()
    reads = count_header_reads(monkeypatch)
    h.admit(h.job(bus, 1))
    (outcome, _), = h.collect(1)
    assert reads == [len(bus)] and outcome.error is None and len(outcome.detections) > 0
    assert [type(x) for x in pipeline.received] == [EncodedImage]


def test_warm_up_captures_the_largest_bucket_then_the_others_while_serving(detector):
    """A GPU start captures the largest bucket (it takes every batch) before the worker is ready,
    naming the step (the log and /readyz show it), and the smaller buckets afterwards on a
    thread of its own, smallest first."""
    import threading

    from app.service.inference.warmup import warmup

    events: list[str] = []
    done = threading.Event()
    real_warmup = detector.warmup

    def recording_warmup(batches=None, *, nv12=False):
        events.append(f"detector.warmup({batches}) on {threading.current_thread().name}")
        if batches == [2]:
            done.set()
        return real_warmup(batches, nv12=nv12)

    detector.warmup = recording_warmup
    try:
        assert warmup(detector, (1,), events.append, buckets=[1, 2, 4]) > 0
        assert done.wait(30)
    finally:
        del detector.warmup
    main = threading.current_thread().name
    assert events[:2] == ["capturing batch bucket 4, which takes every batch until the smaller ones are captured",
                          f"detector.warmup([4]) on {main}"]
    assert "warming up batch size 1 (1 of 1)" in events
    assert [e for e in events if "yolopipe-capture" in e] == ["detector.warmup([1]) on yolopipe-capture",
                                                              "detector.warmup([2]) on yolopipe-capture"]


@pytest.mark.parametrize("buckets", [(), (1, 2, 4)])
def test_warm_up_decodes_a_progressive_jpeg_through_a_pipeline_that_decodes_jpegs(detector, buckets):
    """Where the pipeline decodes JPEGs itself, the warm-up sends it one progressive JPEG (on the
    capture thread where there are buckets): a hardware JPEG decoder leaves such JPEGs to
    nvImageCodec's default chain, made on its first need, so no request pays for making it. A
    pipeline that does not decode JPEGs is sent none."""
    from app.service.inference.warmup import warmup

    pipeline = DecodesItself(detector.pipeline)
    pipeline.buckets = buckets
    threads: list[str] = []
    real_run = pipeline.run
    done = threading.Event()

    def recording_run(images, params, *, decode=None):
        if any(isinstance(x, EncodedImage) for x in images):
            threads.append(threading.current_thread().name)
            done.set()
        return real_run(images, params, decode=decode)

    pipeline.run = recording_run
    assert warmup(Detector(pipeline), (1,), buckets=buckets) > 0
    assert done.wait(30)
    (jpeg,) = [x for x in pipeline.received if isinstance(x, EncodedImage)]
    assert jpeg.header.format == "jpeg" and jpeg.header.jpeg.progressive
    assert threads == (["yolopipe-capture"] if buckets else [threading.current_thread().name])

    cpu_runs: list = []  # the CPU pipeline decodes no JPEG: it is sent arrays only
    real_cpu_run = detector.pipeline.run
    detector.pipeline.run = lambda images, params, **kw: cpu_runs.append(images) or real_cpu_run(images, params, **kw)
    try:
        warmup(detector, (1,))
    finally:
        del detector.pipeline.run
    assert cpu_runs and not any(isinstance(x, EncodedImage) for images in cpu_runs for x in images)


# Every stage the inference worker observes: its own (queue and decode per image, the detector
# call per batch) and the pipeline's, the same four on every backend (``app.contracts.StageTimes``).
STAGES = {"queue", "decode", "batch", "pipeline_decode", "preprocess", "infer", "postprocess"}
PIPELINE_STAGES = ("pipeline_decode", "preprocess", "infer", "postprocess")


def stage_latencies(metrics: WorkerMetrics) -> dict[str, dict]:
    """The worker's metrics page (the exposition text the HTTP workers' ``/metrics`` sums), read
    back per stage of ``yolopipe_stage_latency_seconds``: its count, sum and cumulative bucket
    counts by upper bound."""
    from prometheus_client.exposition import generate_latest

    found: dict[str, dict] = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        m = re.match(r"yolopipe_stage_latency_seconds_(bucket|count|sum)\{([^}]*)\} (\S+)$", line)
        if m is None:
            continue
        kind, labels, value = m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3))
        stage = found.setdefault(labels["stage"], {"buckets": {}})
        if kind == "bucket":
            stage["buckets"][float(labels["le"])] = value
        else:
            stage[kind] = value
    return found


@pytest.mark.parametrize("shaped", ["gpu", "cpu"])
def test_metrics_hold_only_stage_times_each_plausible(harness, detector, bus, bus_mirror, shaped):
    """``/metrics``' stage latencies after GPU-shaped batches (a stand-in that reports what the GPU
    pipeline reports: beside its stage times, the bucket, slot and launch of each run) and
    CPU-shaped ones (the real CPU pipeline): only stage names; per batch one observation of the
    detector call and of each pipeline stage, per image one of its queue and decode; each at least
    0 and at most the batch's own wall time (so no slot index, bucket or image count in seconds)."""
    pipeline = ReportsLikeTheGpu(detector.pipeline) if shaped == "gpu" else detector.pipeline
    h = harness(pipeline=pipeline, max_batch=2)  # warmed up: every run from here on is a served batch
    walls: list[float] = []
    real_run = pipeline.run

    def timed(images, params, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_run(images, params, **kwargs)
        finally:
            walls.append(time.perf_counter() - t0)

    pipeline.run = timed
    try:
        images = [bus, bus_mirror, bus, bus_mirror, bus]  # one input size: a batch is one pipeline run
        for i, data in enumerate(images):  # five requests: the batcher makes batches of up to two
            h.admit(h.job(data, 20 + i))
            if i % 2:
                h.collect(2)
        h.collect(1)
    finally:
        del pipeline.run
    stages = stage_latencies(h.batcher.metrics)
    assert set(stages) == STAGES, sorted(stages)
    batches = len(walls)
    assert 3 <= batches <= 5
    assert stages["batch"]["count"] == batches and stages["batch"]["sum"] >= sum(walls)
    assert stages["queue"]["count"] == stages["decode"]["count"] == len(images)
    longest = max(walls)
    bound = min(b for b in stages["batch"]["buckets"] if b >= longest)  # the first bucket over every batch
    for name in PIPELINE_STAGES:
        stage = stages[name]
        assert stage["count"] == batches, (name, stage)
        assert 0 <= stage["sum"] <= sum(walls), (name, stage)
        assert stage["buckets"][bound] == batches, (name, stage)  # none over the longest batch
    assert sum(stages[name]["sum"] for name in PIPELINE_STAGES) <= sum(walls)  # stages of a run add up to no more
    assert (stages["pipeline_decode"]["sum"] > 0) == (shaped == "gpu")  # the CPU pipeline's images come decoded


"""``Detector.run``, the one detector path: a batch of read images → arrays, in source pixels.

On the real CPU pipeline (sample model) and on stand-ins that record what the pipeline is given:
runs no larger than the run shape's ``max_batch``, device frames apart from host images, each
image's header read once."""

from __future__ import annotations

from dataclasses import replace

import cv2
import numpy as np
import pytest

from app.contracts import DetectedBatch, DeviceNv12, EncodedImage, PipelineRun, RunFacts, RunShape, StageTimes
from app.errors import InvalidImage, InvalidParameter
from app.pipeline.detector import Detector
from app.types import Letterbox
from tests.standins import DecodesItself, count_header_reads


@pytest.fixture(scope="module")
def detector(cpu_detector):
    return cpu_detector


def test_a_batch_is_taken_to_source_pixels_bit_for_bit_as_each_image_alone(detector, bus, zidane):
    """One letterbox undo for the whole batch (``app.boxes.scale_boxes_stacked``): the bits
    ``rows_to_detections`` gives each image alone, whatever its letterbox; a bad image fails alone."""
    from app.boxes import rows_to_detections

    pixels = cv2.imdecode(np.frombuffer(bus, np.uint8), cv2.IMREAD_COLOR)
    images = [bus, zidane, b"<html>", cv2.resize(pixels, (300, 900)), cv2.resize(pixels, (1000, 120))]
    params = detector.params(conf=0.01)
    batch = detector.run(images, params)
    assert list(batch.errors) == [2] and batch.errors[2].code == "unsupported_media_type"
    ok = [0, 1, 3, 4]
    for i in ok:
        (rows, lb), = detector.pipeline.run([detector.prepare(images[i])], params).images
        alone = rows_to_detections(rows, lb)
        mine = batch.detections(i)
        assert (int(batch.widths[i]), int(batch.heights[i])) == (lb.src_w, lb.src_h)
        assert np.array_equal(mine.boxes, alone.boxes) and np.array_equal(mine.scores, alone.scores)
        assert np.array_equal(mine.class_ids, alone.class_ids) and len(mine) > 0


class Recorder:
    """A pipeline that records each run's items and decoder and answers each with one row (its
    position), reporting what a GPU pipeline reports: stage times, and facts (its bucket and slot)."""

    decodes_jpeg = False
    takes_nv12 = True
    cuda = None
    buckets: tuple[int, ...] = ()
    backend, precision, max_det, in_flight = "recorder", "fp32", 300, 2

    def __init__(self, meta, max_batch: int, letterbox: str = "square") -> None:
        self.meta, self.max_batch, self.letterbox = meta, max_batch, letterbox
        self.runs: list[list[str]] = []
        self.sizes: list[list[tuple[int, int]]] = []  # each run's images' (height, width)
        self.decodes: list[str | None] = []

    def run(self, images, params, *, decode=None) -> PipelineRun:
        self.runs.append(["device" if isinstance(x, DeviceNv12) else "host" for x in images])
        self.sizes.append([(x.height, x.width) if isinstance(x, DeviceNv12) else x.shape[:2] for x in images])
        self.decodes.append(decode)
        if len(images) > self.max_batch:
            raise AssertionError("a run over the pipeline's max_batch")
        out = []
        for x in images:
            h, w = (x.height, x.width) if isinstance(x, DeviceNv12) else x.shape[:2]
            out.append((np.array([[1, 2, 3, 4, 0.5, 0]], np.float32), Letterbox(h, w, h, w, 0, 0, h, w)))
        facts = RunFacts(len(images), bucket=4, slot=1, launch="driver")
        return PipelineRun(out, StageTimes(decode_ms=0.5, infer_ms=1.0), facts)

    def close(self) -> None:
        pass


def test_runs_are_pipeline_sized_and_device_frames_go_apart(detector):
    """The detector splits a batch into runs of at most ``RunShape.max_batch`` (no caller
    re-chunks), device and host frames in runs of their own, and answers in the batch's order."""
    recorder = Recorder(detector.meta, max_batch=8)
    det = Detector(recorder, RunShape(max_batch=3, in_flight=2, letterbox="square"))
    frames = [DeviceNv12(None, 4, 10 + k) if k % 3 == 0 else np.zeros((4, 10 + k, 3), np.uint8) for k in range(10)]
    batch = det.run([*frames, InvalidImage("unreadable")], det.params())
    assert sorted(map(tuple, recorder.runs)) == sorted([("host",) * 3, ("host",) * 3, ("device",) * 3, ("device",)])
    assert batch.widths.tolist() == [10 + k for k in range(10)] + [0]
    assert batch.counts.tolist() == [1] * 10 + [0] and list(batch.errors) == [10]
    assert batch.timings == StageTimes(decode_ms=2.0, infer_ms=4.0)  # stage times summed over its four runs
    # and each run's facts apart, never added up (four runs in slot 1 are not a slot 4)
    assert sorted(f.batch for f in batch.runs) == [1, 3, 3, 3] and {(f.bucket, f.slot) for f in batch.runs} == {(4, 1)}


def test_rect_runs_hold_one_input_size_each(detector):
    """Under a rect letterbox a batch is split into runs of one input size (the smallest multiple
    of the stride holding the image), sizes in the order they first come, each at most max_batch
    and device frames apart; the answers stay in the batch's order."""
    recorder = Recorder(detector.meta, max_batch=8, letterbox="rect")
    det = Detector(recorder, RunShape(max_batch=2, in_flight=2))
    assert det.shape.letterbox == "rect" and det.info()["letterbox"] == "rect"
    # (480, 640) and (470, 640) both run at 480 × 640; (1080, 810) at 640 × 480; (720, 1280) at 384 × 640
    sizes = [(480, 640), (1080, 810), (470, 640), (480, 640), (720, 1280), (1080, 810), (480, 640)]
    frames = [np.zeros((*s, 3), np.uint8) for s in sizes] + [DeviceNv12(None, 1080, 810), DeviceNv12(None, 480, 640)]
    batch = det.run(frames, det.params())
    assert batch.heights.tolist() == [s[0] for s in sizes] + [1080, 480]
    assert recorder.sizes == [[(480, 640), (470, 640)], [(480, 640), (480, 640)], [(480, 640)],
                              [(1080, 810), (1080, 810)], [(1080, 810)], [(720, 1280)]]
    for run in recorder.sizes:
        assert len({det.input_size(*s) for s in run}) == 1
    assert det.input_size(1080, 810) == (640, 480) and det.input_size(720, 1280) == (384, 640)
    assert det.reshaped(letterbox="rect").input_size(1, 1) == (640, 640)  # scaled up: 640 × 640


def test_a_square_pipeline_takes_no_rect_run_shape(detector):
    """A pipeline that letterboxes to the square (a GPU one, the INT8 CPU model) cannot take a rect
    run shape: the runtime clamps it to square where it opens them; a shape made elsewhere is refused."""
    square = Recorder(detector.meta, max_batch=8)
    assert Detector(square).shape.letterbox == "square" and Detector(square).input_size(1080, 810) == (640, 640)
    with pytest.raises(InvalidParameter, match="letterbox rect"):
        Detector(square, RunShape(max_batch=8, in_flight=2))
    with pytest.raises(InvalidParameter, match="letterbox"):
        RunShape(letterbox="wide")


def test_the_jpeg_decoder_is_a_setting_of_the_run_shape(detector):
    """Each run takes the decoder of its detector's shape; a reshaped detector's runs take its
    own, and the first detector's are unchanged (nothing on the pipeline was switched)."""
    recorder = Recorder(detector.meta, max_batch=8)
    det = Detector(recorder, RunShape(max_batch=8, in_flight=2, letterbox="square"))
    frames = [np.zeros((4, 10, 3), np.uint8)]
    det.run(frames)
    det.reshaped(decode="cpu").run(frames)  # the old name of opencv
    det.run(frames)
    assert recorder.decodes == ["gpu", "opencv", "gpu"]


def test_the_run_shape_must_fit_the_pipeline(detector):
    with pytest.raises(InvalidParameter, match="over the"):
        detector.reshaped(max_batch=detector.shape.max_batch + 1)
    with pytest.raises(InvalidParameter, match="video decoder"):
        detector.reshaped(video_decode="ffmpeg")
    assert detector.reshaped(decode="cpu").shape.decode == "opencv"  # the old name, resolved once
    assert detector.reshaped(max_wait_ms=1.0).shape == replace(detector.shape, max_wait_ms=1.0)


def test_the_detector_answers_for_its_pipeline(detector):
    """What callers ask of the model (facts, warm-up, memory) they ask the Detector."""
    assert (detector.backend, detector.precision, detector.device, detector.cuda) == ("onnxruntime", "fp32", None, None)
    assert (detector.takes_nv12, detector.buckets, detector.max_det) == (False, (), detector.pipeline.max_det)
    detector.warmup()
    detector.release_memory()


def test_diagnostics_on_the_cpu_say_what_they_can(detector, bus):
    """The one diagnostic call: its facts, a profiled run (its stage times, no device stage), the
    engine alone on a letterboxed batch (each call timed by the caller's ``measure``), and no
    timeline (no streams to overlap)."""
    from app.imaging.letterbox import letterbox, to_input

    plain = detector.diagnose()
    assert (plain.decoder, plain.compiled, plain.compiler, plain.batch_invariant) == ("opencv", False, "onnxruntime",
                                                                                      False)
    assert plain.launch_error and (plain.profiled, plain.bare, plain.timeline) == (None, None, None)
    params = detector.params()
    profiled = detector.diagnose(profile=[bus], params=params).profiled
    assert profiled.device_ms == {} and profiled.facts == RunFacts(1, 1)
    assert profiled.timings.decode_ms == 0 and min(profiled.timings.preprocess_ms, profiled.timings.infer_ms) > 0
    (rows, _), = detector.pipeline.run([detector.prepare(bus)], params).images
    assert profiled.images[0][0].tobytes() == rows.tobytes()
    pixels = cv2.imdecode(np.frombuffer(bus, np.uint8), cv2.IMREAD_COLOR)
    heads = []

    def measure(call):  # the caller decides how often a call runs and how it is timed
        heads.append(call())
        return [1.0, 2.0]

    bare = detector.diagnose(bare=to_input([letterbox(pixels, detector.meta.imgsz)[0]]), measure=measure).bare
    assert bare.times_ms == [1.0, 2.0] and bare.device_ms == []
    (head,) = heads  # the engine's raw output for the one image
    assert head.shape[:2] == (1, 4 + len(detector.names))


def test_prepared_items_are_not_prepared_again(detector, bus, monkeypatch):
    """Front ends that prepare in threads of their own hand ``run_prepared`` the results (and
    the errors standing in for images): the same answers as ``run``, with no second look."""
    items = [detector.prepare(bus), InvalidImage("unreadable")]
    monkeypatch.setattr(Detector, "prepare", lambda self, item: pytest.fail("prepared again"))
    batch = detector.run_prepared(items, detector.params())
    assert list(batch.errors) == [1] and batch.counts[0] > 0
    monkeypatch.undo()
    assert batch.rows.tobytes() == detector.run([bus, InvalidImage("unreadable")]).rows.tobytes()


def test_bytes_are_read_once_and_travel_with_their_header(detector, bus, monkeypatch):
    """Bytes are read here, once; a JPEG goes to a pipeline that decodes it itself with that
    header, and an ``EncodedImage`` (read by whoever first had it) is not read again."""
    pipeline = DecodesItself(detector.pipeline)
    det = Detector(pipeline)
    reads = count_header_reads(monkeypatch)
    first = det.run([bus], det.params())
    assert reads == [len(bus)]
    (image,) = pipeline.received
    assert isinstance(image, EncodedImage) and image.data == bus
    again = det.run([image], det.params())
    assert reads == [len(bus)]
    assert again.rows.tobytes() == first.rows.tobytes() == detector.run([bus], det.params()).rows.tobytes()


def test_answers_as_image_results(detector, bus):
    batch = detector.run([bus, b""], detector.params())
    ok, bad = batch.results()
    assert (ok.width, ok.height) == (810, 1080) and len(ok.detections) == int(batch.counts[0]) > 0
    assert bad.error is not None and bad.error.code == "invalid_image"
    assert DetectedBatch.concat([batch.take([1]), batch.take([0])]).results()[1].detections.scores.tolist() == \
        ok.detections.scores.tolist()

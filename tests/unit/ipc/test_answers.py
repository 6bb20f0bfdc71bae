"""The inference worker's answers across the process boundary (``app.ipc.answers``): a RESULTS
frame read back is the detector's arrays and each image's ticket, as numbers; a request's
answers, split out of the frames its images came back in, are in its order."""

from __future__ import annotations

import numpy as np
import pytest

from app.api.statuses import status_for
from app.contracts import DetectedBatch, ImageResult, StageTimes
from app.errors import ImageTooLarge, Overloaded
from app.ipc import answers, wire
from tests.references import detected_batch, detections_json


@pytest.fixture(scope="module")
def detected(cpu_detector, bus, zidane):
    return cpu_detector, cpu_detector.run([bus, zidane], cpu_detector.params(conf=0.1))


def through_the_wire(sent: answers.Answers) -> answers.Answers:
    ((kind, body),) = wire.FrameReader().feed(answers.answers_frame(sent))
    assert kind == wire.RESULTS
    return answers.read_answers(body)


def test_a_frame_reads_back_as_the_detectors_arrays_and_the_tickets(detected):
    det, batch = detected
    results = [*batch.results(), ImageResult(error=ImageTooLarge("image has 2,500,000,000 pixels"))]
    stages = StageTimes(decode_ms=0.5, preprocess_ms=1.25, infer_ms=7.5, postprocess_ms=0.75)
    tickets = answers.tickets([1, 1, 1], [0, 1, 2], [1.5, 2.5, 0.0], [3.0, 4.0, 5.0], 12.5, stages)
    back = through_the_wire(answers.Answers(detected_batch(results), tickets))
    sent = detected_batch(results)
    assert back.detected.widths.tolist() == sent.widths.tolist() and back.detected.counts.tolist() == sent.counts.tolist()
    assert back.detected.rows.tobytes() == sent.rows.tobytes() and len(back.detected.rows) > 0
    for i, r in enumerate(results[:2]):
        assert detections_json(back.detected.detections(i), det.names) == detections_json(r.detections, det.names)
    error = back.detected.errors[2]
    assert list(back.detected.errors) == [2]
    assert type(error) is ImageTooLarge and status_for(error) == 413 and str(error) == "image has 2,500,000,000 pixels"
    assert back.tickets.tobytes() == tickets.tobytes()
    assert dict(zip(answers.TIMES, back.times()[1])) == {
        "decode_ms": 2.5, "queue_ms": 4.0, "batch_ms": 12.5, "pipeline_decode_ms": 0.5,
        "preprocess_ms": 1.25, "infer_ms": 7.5, "postprocess_ms": 0.75}
    assert back.times() == [(1.5, 3.0, 12.5, 0.5, 1.25, 7.5, 0.75), (2.5, 4.0, 12.5, 0.5, 1.25, 7.5, 0.75),
                            (0.0, 5.0, 12.5, 0.5, 1.25, 7.5, 0.75)]


def test_a_requests_answers_come_back_in_its_order_from_several_frames(detected):
    """An HTTP worker splits each frame per request, then joins a request's shares (in any
    order) into one answer in the request's order, each image with its own times and its
    batch's."""
    det, batch = detected
    bus, zidane = batch.results()
    # Batch a: request 7's image 2, request 8's image 0, request 7's image 0 (failed). Batch b: request 7's image 1.
    batch_a = answers.Answers(detected_batch([bus, ImageResult(error=ImageTooLarge("another request's")),
                                              ImageResult(error=ImageTooLarge("too big"))]),
                              answers.tickets([7, 8, 7], [2, 0, 0], [1.0, 0.0, 3.0], [2.0, 0.0, 0.0], 10.0))
    batch_b = answers.Answers(detected_batch([zidane]), answers.tickets([7], [1], 0.0, [4.0], 20.0))
    mine, other = through_the_wire(batch_a).split([[0, 2], [1]])
    assert other.tickets["req_id"].tolist() == [8] and str(other.detected.errors[0]) == "another request's"
    back = answers.Answers.joined([mine, through_the_wire(batch_b)])
    assert back.tickets["index"].tolist() == [0, 1, 2]
    assert back.detected.counts.tolist() == [0, len(zidane.detections), len(bus.detections)]
    assert back.detected.widths.tolist() == [0, zidane.width, bus.width]
    assert list(back.detected.errors) == [0] and str(back.detected.errors[0]) == "too big"
    assert detections_json(back.detected.detections(1), det.names) == detections_json(zidane.detections, det.names)
    assert detections_json(back.detected.detections(2), det.names) == detections_json(bus.detections, det.names)
    assert [t[:3] for t in back.times()] == [(3.0, 0.0, 10.0), (0.0, 4.0, 20.0), (1.0, 2.0, 10.0)]  # decode, queue, batch
    assert len(answers.Answers.joined([])) == 0


def test_a_split_gives_each_group_its_rows_and_errors(detected):
    """Shares of one frame, in any grouping: each holds exactly its images' rows and errors."""
    _, batch = detected
    bus, zidane = batch.results()
    results = [zidane, ImageResult(error=Overloaded("queue full")), bus, zidane, ImageResult(error=ImageTooLarge("x"))]
    whole = answers.Answers(detected_batch(results), answers.tickets([1, 2, 3, 4, 5], [0] * 5))
    groups = [[4, 0], [2], [1, 3]]
    for group, share in zip(groups, whole.split(groups)):
        expected = detected_batch([results[p] for p in group])
        assert share.tickets["req_id"].tolist() == [p + 1 for p in group]
        assert share.detected.rows.tobytes() == expected.rows.tobytes()
        assert share.detected.counts.tolist() == expected.counts.tolist()
        assert {k: str(e) for k, e in share.detected.errors.items()} == {k: str(e) for k, e in expected.errors.items()}
    assert whole.split([[0, 1, 2, 3, 4]])[0] is whole


def test_failed_answers_carry_each_images_error_and_no_rows():
    errors = [Overloaded("the queue holds 99 s of work"), ImageTooLarge("too big")]
    back = through_the_wire(answers.Answers.failed([3, 3], [1, 0], errors))
    assert back.detected.counts.tolist() == [0, 0] and back.detected.rows.shape == (0, 6)
    assert [type(e) for e in back.detected.errors.values()] == [Overloaded, ImageTooLarge]
    assert back.tickets["index"].tolist() == [1, 0]
    assert answers.Answers.joined([back]).tickets["index"].tolist() == [0, 1]


def test_an_empty_batch_and_an_image_without_rows_travel():
    empty = DetectedBatch(np.array([640]), np.array([480]), np.array([0]), np.zeros((0, 6), np.float32))
    back = through_the_wire(answers.Answers(empty, answers.tickets([9], [0])))
    assert back.detected.widths.tolist() == [640] and back.detected.counts.tolist() == [0] and not back.detected.errors
    assert len(through_the_wire(answers.Answers.failed([], [], []))) == 0

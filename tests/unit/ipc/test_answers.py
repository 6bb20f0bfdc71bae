"""The inference worker's answers, as arrays and as RESULTS frames: what is written comes back
as the detector's own detections, each HTTP worker getting its share."""

from __future__ import annotations

import pytest

from app.api.statuses import status_for
from app.errors import ImageTooLarge
from app.ipc import answers, wire
from tests.references import detected_batch, detections_json


@pytest.fixture(scope="module")
def detected(cpu_detector, bus, zidane):
    return cpu_detector, cpu_detector.detect([bus, zidane], cpu_detector.params(conf=0.1))


def test_results_round_trip_to_the_same_json_as_the_detector(detected):
    det, results = detected
    outcomes = [wire.Outcome(1, i, r.width, r.height, r.detections, decode_ms=1.5, queue_ms=2.5)
                for i, r in enumerate(results)]
    outcomes.append(wire.Outcome(1, 2, error=ImageTooLarge("image has 2,500,000,000 pixels")))
    (kind, body), = wire.FrameReader().feed(answers.results(outcomes, {"batch_ms": 12.5, "batch_size": 2}))
    assert kind == wire.RESULTS
    read = answers.read_answers(body)
    assert read.timings == {"batch_ms": 12.5, "batch_size": 2}
    back = answers.request_answers([read])
    for i, r in enumerate(results):
        assert (back.detected.widths[i], back.detected.heights[i]) == (r.width, r.height)
        assert detections_json(back.detected.detections(i), det.names) == detections_json(r.detections, det.names) != []
    assert back.decode_ms[:2] == [1.5, 1.5] and back.queue_ms[:2] == [2.5, 2.5]
    assert back.batch_timings == [read.timings] * 3
    error = back.detected.errors[2]
    assert type(error) is ImageTooLarge and status_for(error) == 413
    assert str(error) == "image has 2,500,000,000 pixels"


def test_a_requests_answers_come_back_in_its_order_from_several_batches(detected):
    """An HTTP worker's request gathers its shares of the batches its images ran in, in any
    order, into one ``DetectedBatch`` in the request's order, each image with its own waits and
    its batch's timings."""
    det, results = detected
    bus, zidane = results
    first = wire.Outcome(7, 2, bus.width, bus.height, bus.detections, decode_ms=1.0, queue_ms=2.0)
    other = wire.Outcome(8, 0, error=ImageTooLarge("another request's"))
    failed = wire.Outcome(7, 0, error=ImageTooLarge("too big"), decode_ms=3.0)
    last = wire.Outcome(7, 1, zidane.width, zidane.height, zidane.detections, queue_ms=4.0)
    batch_a = answers.read_answers(wire.FrameReader().feed(answers.results([first, other, failed], {"a": 1.0}))[0][1])
    batch_b = answers.read_answers(wire.FrameReader().feed(answers.results([last], {"b": 2.0}))[0][1])
    (share,) = batch_a.split([[0, 2]])
    back = answers.request_answers([share, batch_b])
    assert back.detected.counts.tolist() == [0, len(zidane.detections), len(bus.detections)]
    assert back.detected.widths.tolist() == [0, zidane.width, bus.width]
    assert list(back.detected.errors) == [0] and str(back.detected.errors[0]) == "too big"
    assert detections_json(back.detected.detections(1), det.names) == detections_json(zidane.detections, det.names)
    assert detections_json(back.detected.detections(2), det.names) == detections_json(bus.detections, det.names)
    assert (back.decode_ms, back.queue_ms) == ([3.0, 0.0, 1.0], [0.0, 4.0, 2.0])
    assert back.batch_timings == [{"a": 1.0}, {"b": 2.0}, {"a": 1.0}]
    assert len(answers.request_answers([]).detected) == 0


def test_answers_read_back_as_the_detectors_arrays(detected):
    """``Answers.detected``: a RESULTS frame read back is the batch ``Detector.run`` answered."""
    det, results = detected

    batch = detected_batch([*results, type(results[0])(error=ImageTooLarge("too big"))])
    outcomes = [wire.Outcome(1, i, r.width, r.height, r.detections, error=r.error) for i, r in enumerate(batch.results())]
    ((_, body),) = wire.FrameReader().feed(answers.results(outcomes))
    back = answers.read_answers(body).detected()
    assert back.widths.tolist() == batch.widths.tolist() and back.counts.tolist() == batch.counts.tolist()
    assert back.rows.tobytes() == batch.rows.tobytes() and len(back.rows) > 0
    assert list(back.errors) == [2] and str(back.errors[2]) == "too big"

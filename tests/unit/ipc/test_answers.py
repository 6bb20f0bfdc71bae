"""The inference worker's answers, as arrays and as RESULTS frames: what is written comes back
as the detector's own detections, each HTTP worker getting its share."""

from __future__ import annotations

import pytest

from app.api.errors import status_for
from app.errors import ImageTooLarge
from app.ipc import answers, wire


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
    timings, back = answers.read_results(body)
    assert timings == {"batch_ms": 12.5, "batch_size": 2}
    for o, r in zip(back, results):
        assert (o.width, o.height) == (r.width, r.height)
        assert o.detections.to_json(det.names) == r.detections.to_json(det.names) != []
        assert (o.decode_ms, o.queue_ms, o.batch) == (1.5, 2.5, timings)
    assert type(back[2].error) is ImageTooLarge and status_for(back[2].error) == 413
    assert str(back[2].error) == "image has 2,500,000,000 pixels"


def test_answers_read_back_as_the_detectors_arrays(detected):
    """``Answers.detected``: a RESULTS frame read back is the batch ``Detector.run`` answered."""
    det, results = detected
    from app.contracts import DetectedBatch

    batch = DetectedBatch.of([*results, type(results[0])(error=ImageTooLarge("too big"))])
    outcomes = [wire.Outcome(1, i, r.width, r.height, r.detections, error=r.error) for i, r in enumerate(batch.results())]
    ((_, body),) = wire.FrameReader().feed(answers.results(outcomes))
    back = answers.read_answers(body).detected()
    assert back.widths.tolist() == batch.widths.tolist() and back.counts.tolist() == batch.counts.tolist()
    assert back.rows.tobytes() == batch.rows.tobytes() and len(back.rows) > 0
    assert list(back.errors) == [2] and str(back.errors[2]) == "too big"

"""The inference worker's answers, as arrays and as RESULTS frames: what is written comes back
as the detector's own detections, each HTTP worker getting its share."""

from __future__ import annotations

import pytest

from app.api.errors import status_for
from app.contracts import DetectParams
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


def test_each_owner_gets_its_share_of_a_batch_in_one_frame(detected):
    """A batch's answers to three HTTP workers: each frame holds that worker's answers, rows
    and errors included, and nothing of the others'."""
    from app.ipc.batcher import Job
    from app.service.worker import answer_frames

    det, (bus_result, zidane_result) = detected
    results = [bus_result, zidane_result, None, zidane_result, bus_result]
    owners = ["a", "b", "a", "c", "a"]
    outcomes = [wire.Outcome(5, i, r.width, r.height, r.detections) if r is not None else
                wire.Outcome(5, i, error=ImageTooLarge("too big")) for i, r in enumerate(results)]
    jobs = [Job(owner, wire.ImageRef(5, i, 0, 0, 0.0, DetectParams()), None) for i, owner in enumerate(owners)]
    frames = answer_frames(jobs, answers.Answers.of(outcomes, {"batch_ms": 3.0}))
    assert [owner for owner, _ in frames] == ["a", "b", "c"]
    for owner, data in frames:
        ((_, body),) = wire.FrameReader().feed(data)
        timings, back = answers.read_results(body)
        assert timings == {"batch_ms": 3.0}
        assert [o.index for o in back] == [i for i, o in enumerate(owners) if o == owner]
        for o in back:
            expected = results[o.index]
            if expected is None:
                assert type(o.error) is ImageTooLarge and str(o.error) == "too big"
            else:
                assert o.detections.to_json(det.names) == expected.detections.to_json(det.names) != []

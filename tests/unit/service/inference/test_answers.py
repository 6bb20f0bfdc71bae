"""A batch's answers as the inference worker sends them: the detector's arrays with each image's
request, index and waits; each HTTP worker's share in one frame, and the stream host's share
handed over as arrays, never encoded."""

from __future__ import annotations

import time

import numpy as np
import pytest

from app.contracts import DetectParams, ImageResult
from app.errors import ImageTooLarge
from app.ipc import answers, wire
from app.service.inference.answers import answer_frames, answers_of
from app.service.inference.batcher import Job
from tests.references import detected_batch, detections_json, outcomes_of


@pytest.fixture(scope="module")
def detected(cpu_detector, bus, zidane):
    return cpu_detector, cpu_detector.run([bus, zidane], cpu_detector.params(conf=0.1))


def jobs_of(owners: list, req_id: int = 5) -> list[Job]:
    return [Job(owner, wire.ImageRef(req_id, i, 0, 0, 0.0, DetectParams()), None) for i, owner in enumerate(owners)]


def test_a_batch_answers_what_the_detector_found_with_each_images_waits(detected):
    det, batch = detected
    jobs = jobs_of(["a", "a"])
    jobs[0].decode_ms, jobs[1].decode_ms = 1.5, 2.5
    start = time.perf_counter()
    for job in jobs:
        job.admitted_at = start - 0.25
    got = answers_of(jobs, start, batch)
    ((_, body),) = wire.FrameReader().feed(answers.answers_frame(got))
    outcomes = outcomes_of(answers.read_answers(body))
    for o, r in zip(outcomes, batch.results()):
        assert (o.req_id, o.width, o.height) == (5, r.width, r.height)
        assert detections_json(o.detections, det.names) == detections_json(r.detections, det.names) != []
        assert o.queue_ms == pytest.approx(250, abs=0.01)
    assert [o.decode_ms for o in outcomes] == [1.5, 2.5]


def test_each_owner_gets_its_share_of_a_batch_in_one_frame(detected):
    """A batch's answers to three HTTP workers: each frame holds that worker's answers, rows
    and errors included, and nothing of the others'."""
    det, (batch) = detected
    bus_result, zidane_result = batch.results()
    results = [bus_result, zidane_result, ImageResult(error=ImageTooLarge("too big")), zidane_result, bus_result]
    owners = ["a", "b", "a", "c", "a"]
    jobs = jobs_of(owners)
    frames = answer_frames(jobs, answers_of(jobs, time.perf_counter(), detected_batch(results), {"batch_ms": 3.0}))
    assert [owner for owner, _ in frames] == ["a", "b", "c"]
    for owner, data in frames:
        ((_, body),) = wire.FrameReader().feed(data)
        read = answers.read_answers(body)
        timings, back = read.timings, outcomes_of(read)
        assert timings == {"batch_ms": 3.0}
        assert [o.index for o in back] == [i for i, o in enumerate(owners) if o == owner]
        for o in back:
            expected = results[o.index]
            if expected.error is not None:
                assert type(o.error) is ImageTooLarge and str(o.error) == "too big"
            else:
                assert detections_json(o.detections, det.names) == detections_json(expected.detections, det.names) != []


class LocalOwner:
    """An owner in the worker's own process (as the stream host is): it takes its share as arrays."""

    def __init__(self) -> None:
        self.taken: list[answers.Answers] = []

    def take_answers(self, share: answers.Answers) -> None:
        self.taken.append(share)


def test_an_owner_in_this_process_takes_its_share_as_arrays_never_encoded(detected, monkeypatch):
    det, batch = detected
    local = LocalOwner()
    jobs = jobs_of(["http", local])
    encoded = []
    real_frame = answers.answers_frame

    def counting(share, timings=None):
        encoded.append(len(share.records))
        return real_frame(share, timings)

    monkeypatch.setattr("app.service.inference.answers.answers_frame", counting)
    frames = answer_frames(jobs, answers_of(jobs, time.perf_counter(), batch))
    assert [owner for owner, _ in frames] == ["http"] and encoded == [1]  # only the HTTP worker's share
    (share,) = local.taken
    mine = share.detected()
    assert share.records["index"].tolist() == [1]
    assert mine.rows.tobytes() == batch.take([1]).rows.tobytes() and len(mine.rows) > 0
    assert np.array_equal(mine.widths, batch.widths[1:])

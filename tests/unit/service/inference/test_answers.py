"""A batch's answers as the inference worker sends them: the detector's arrays with each image's
ticket (request, index, its waits, the batch's times); each HTTP worker's share in one frame,
and the stream host's share handed over as arrays, never encoded."""

from __future__ import annotations

import time

import numpy as np
import pytest

from app.contracts import DetectParams, ImageResult, StageTimes
from app.errors import ImageTooLarge
from app.ipc import answers, wire
from app.service.inference.answers import answer_frames, answers_of, failed_answers
from app.service.inference.batcher import Job
from tests.references import detected_batch, detections_json, image_answers


@pytest.fixture(scope="module")
def detected(cpu_detector, bus, zidane):
    return cpu_detector, cpu_detector.run([bus, zidane], cpu_detector.params(conf=0.1))


def jobs_of(owners: list, req_id: int = 5) -> list[Job]:
    return [Job(owner, wire.ImageRef(req_id, i, 0, 0, 0.0, DetectParams()), None) for i, owner in enumerate(owners)]


def read_frame(data: bytes) -> answers.Answers:
    ((_, body),) = wire.FrameReader().feed(data)
    return answers.read_answers(body)


def test_a_batch_answers_what_the_detector_found_with_each_images_waits_and_the_batchs_times(detected):
    det, batch = detected
    jobs = jobs_of(["a", "a"])
    jobs[0].decode_ms, jobs[1].decode_ms = 1.5, 2.5
    start = time.perf_counter()
    for job in jobs:
        job.admitted_at = start - 0.25
    got = answers_of(jobs, start, batch, 9.5)
    outcomes = image_answers(read_frame(answers.answers_frame(got)))
    for o, r in zip(outcomes, batch.results()):
        assert (o.req_id, o.width, o.height) == (5, r.width, r.height)
        assert detections_json(o.detections, det.names) == detections_json(r.detections, det.names) != []
        assert o.queue_ms == pytest.approx(250, abs=0.01)
        stages = batch.timings
        assert o.batch == {"batch_ms": 9.5, "pipeline_decode_ms": stages.decode_ms,
                           "preprocess_ms": stages.preprocess_ms, "infer_ms": stages.infer_ms,
                           "postprocess_ms": stages.postprocess_ms}
        assert stages.infer_ms > 0
    assert [o.decode_ms for o in outcomes] == [1.5, 2.5]


def test_each_owner_gets_its_share_of_a_batch_in_one_frame(detected):
    """A batch's answers to three HTTP workers: each frame holds that worker's answers, rows
    and errors included, and nothing of the others'."""
    det, batch = detected
    bus_result, zidane_result = batch.results()
    results = [bus_result, zidane_result, ImageResult(error=ImageTooLarge("too big")), zidane_result, bus_result]
    owners = ["a", "b", "a", "c", "a"]
    jobs = jobs_of(owners)
    made = detected_batch(results)
    made.timings = StageTimes(infer_ms=3.0)
    frames = answer_frames(jobs, answers_of(jobs, time.perf_counter(), made, 4.0))
    assert [owner for owner, _ in frames] == ["a", "b", "c"]
    for owner, data in frames:
        back = image_answers(read_frame(data))
        assert [o.index for o in back] == [i for i, o in enumerate(owners) if o == owner]
        for o in back:
            assert (o.batch["batch_ms"], o.batch["infer_ms"]) == (4.0, 3.0)
            expected = results[o.index]
            if expected.error is not None:
                assert type(o.error) is ImageTooLarge and str(o.error) == "too big"
            else:
                assert detections_json(o.detections, det.names) == detections_json(expected.detections, det.names) != []


def test_jobs_answered_with_errors_carry_their_tickets():
    jobs = jobs_of(["a", "a"], req_id=11)
    back = image_answers(read_frame(answers.answers_frame(failed_answers(jobs, [ImageTooLarge("x"), ImageTooLarge("y")]))))
    assert [(o.req_id, o.index, str(o.error)) for o in back] == [(11, 0, "x"), (11, 1, "y")]


class LocalOwner:
    """An owner in the worker's own process (as the stream host is): it takes its share as arrays."""

    def __init__(self) -> None:
        self.taken: list[answers.Answers] = []

    def take_answers(self, share: answers.Answers) -> None:
        self.taken.append(share)


def test_an_owner_in_this_process_takes_its_share_as_arrays_never_encoded(detected, monkeypatch):
    _, batch = detected
    local = LocalOwner()
    jobs = jobs_of(["http", local])
    encoded = []
    real_frame = answers.answers_frame

    def counting(share):
        encoded.append(len(share))
        return real_frame(share)

    monkeypatch.setattr("app.service.inference.answers.answers_frame", counting)
    frames = answer_frames(jobs, answers_of(jobs, time.perf_counter(), batch))
    assert [owner for owner, _ in frames] == ["http"] and encoded == [1]  # only the HTTP worker's share
    (share,) = local.taken
    mine = share.detected
    assert share.tickets["index"].tolist() == [1]
    assert mine.rows.tobytes() == batch.take([1]).rows.tobytes() and len(mine.rows) > 0
    assert np.array_equal(mine.widths, batch.widths[1:])

"""``/v1``'s answer from the inference worker's arrays (``app.api.detection``) is byte for byte what
Starlette's ``JSONResponse`` renders for the record built the readable way: each image's name,
size and detections (``tests/references.py``) and its ``timings`` (its ticket's times and the
request's total, each rounded to the µs), or its error with the status it would have alone."""

from __future__ import annotations

import numpy as np
import pytest
from starlette.responses import JSONResponse

from app.api.detection import _answered_images, _image_records
from app.api.errors import image_error_fields
from app.contracts import ImageResult
from app.errors import ImageTooLarge, InvalidImage
from app.ipc.answers import TIMES, Answers, answers_frame, read_answers, tickets
from app.ipc.wire import FRAME
from app.types import Detections
from tests.references import detected_batch, image_json

NAMES = ["Normal", "Fall"]
IMAGE_NAMES = ["upload.jpg", "sub/ü ñ 雪.jpg", 'q"uote\\back\tslash.jpg', "emoji 🙂.png", "%d %s.jpg"]


def random_times(rng, n: int) -> np.ndarray:
    """Times in ms from sub-µs to days, on exact ties of ``round(v, 3)`` (k/16) now and then, zeros
    of both signs, the smallest and the largest floats."""
    times = 10.0 ** rng.uniform(-7, 9, (n, len(TIMES)))
    times = np.where(rng.random(times.shape) < 0.2, np.round(times * 16) / 16, times)
    picks = rng.choice([0.0, -0.0, 1e300, 5e-324, 1e16, 0.0005], times.shape)
    return np.where(rng.random(times.shape) < 0.1, picks, times)


def answers_through_the_wire(results: list[ImageResult], times: np.ndarray) -> Answers:
    n = len(results)
    ticket = tickets(list(range(n)), list(range(n)))
    for k, name in enumerate(TIMES):
        ticket[name] = times[:, k]
    frame = answers_frame(Answers(detected_batch(results), ticket))
    return read_answers(frame[FRAME.size:])


def readable_answer(result: ImageResult, name: str, times, total_ms: float) -> bytes:
    if result.error is not None:
        return JSONResponse({"image": name, **image_error_fields(result.error)}).body
    timings = {**{k: round(v, 3) for k, v in zip(TIMES, times)}, "total_ms": round(total_ms, 3)}
    return JSONResponse({**image_json(result, name, NAMES), "timings": timings}).body


def random_results(rng) -> list[ImageResult]:
    results = []
    for k in range(int(rng.integers(1, 9))):
        if rng.random() < 0.15:
            results.append(ImageResult(error=[InvalidImage('cannot decode "é"'), ImageTooLarge("10 × 10")][k % 2]))
            continue
        rows = np.empty((int(rng.integers(0, 7)), 6), np.float32)
        rows[:, :4] = rng.uniform(-30, 2000, (len(rows), 4))
        rows[:, 4], rows[:, 5] = rng.uniform(0, 1, len(rows)), rng.integers(-1, 3, len(rows))
        results.append(ImageResult(int(rng.integers(1, 5000)), int(rng.integers(1, 5000)), Detections.from_rows(rows)))
    return results


@pytest.mark.parametrize("seed", range(8))
def test_each_images_answer_is_what_json_response_renders(seed):
    """Images with and without detections, failed images, and times of every magnitude."""
    rng = np.random.default_rng(seed)
    results = random_results(rng)
    times = random_times(rng, len(results))
    total_ms = float(rng.choice([12.3456, 0.0005, 1e-9, 86_400_000.0625, -0.0]))
    names = [IMAGE_NAMES[k % len(IMAGE_NAMES)] for k in range(len(results))]
    batch, timings = _answered_images(answers_through_the_wire(results, times), total_ms)
    assert [t == "" for t in timings] == [r.error is not None for r in results]
    want = [readable_answer(r, n, t, total_ms) for r, n, t in zip(results, names, times.tolist())]
    assert [a.encode() for a in _image_records(names, batch, timings, NAMES)] == want


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_time_json_cannot_write_is_refused_as_json_response_refuses_it(bad):
    """A NaN or an infinity among an answered image's times: a ValueError, as ``JSONResponse``
    raises, never invalid JSON; a failed image's times are not written, so it has no say."""
    results = [ImageResult(640, 480, Detections.empty()), ImageResult(error=InvalidImage("bad"))]
    times = np.ones((2, len(TIMES)))
    times[1, 2] = bad
    batch, timings = _answered_images(answers_through_the_wire(results, times), 5.0)
    assert [a.encode() for a in _image_records(["a.jpg", "b.jpg"], batch, timings, NAMES)] == \
        [readable_answer(r, n, t, 5.0) for r, n, t in zip(results, ["a.jpg", "b.jpg"], times.tolist())]
    times[0, 4] = bad
    with pytest.raises(ValueError):
        readable_answer(results[0], "a.jpg", times[0].tolist(), 5.0)
    with pytest.raises(ValueError):
        _answered_images(answers_through_the_wire(results, times), 5.0)
    with pytest.raises(ValueError):
        _answered_images(answers_through_the_wire(results[:1], np.ones((1, len(TIMES)))), float(bad))

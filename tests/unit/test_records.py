"""Every JSON record (``app.records``) is byte for byte what ``json.dumps`` gives for the record as
a dict built the readable way: ``tests/references.py``'s ``image_json`` of each image,
with a video frame's and a stream event's fields around it, track ids added to each detection,
and for ``/v1`` the compact form Starlette's ``JSONResponse`` writes. ``--coco``'s document,
built from the arrays, is byte for byte the one built from the lines read back; ``--resume``
reads back what the lines hold."""

from __future__ import annotations

import json

import numpy as np
import pytest
from starlette.responses import JSONResponse

from app.contracts import ImageResult
from app.errors import ImageTooLarge, InvalidImage
from app.records import HTTP, LINES, CocoDocument, frame_lines, image_lines, read_written, records
from app.types import Detections
from tests.references import coco_document, detected_batch, image_json

NAMES = ["Normal", "Fall"]
IMAGE_NAMES = ["a.jpg", "sub/ü ñ 雪.jpg", 'q"uote\\back\tslash.jpg', "emoji 🙂.png", "\x01ctl.jpg"]


def random_rows(rng, k: int) -> np.ndarray:
    """Rows in source pixels, a share of them on exact binary fractions (x.125, x.375, ...: exact
    ties of ``round(v, 2)``, and of ``round(s, 5)`` for scores on 1/32 steps), some outside any
    image and some huge; class ids the model has no name for (-1, 2, 3) too."""
    rows = np.empty((k, 6), np.float32)
    xy = rng.uniform(-30, 2000, (k, 4))
    tie = rng.random((k, 4)) < 0.4
    rows[:, :4] = np.where(tie, np.round(xy * 8) / 8, xy)
    rows[:3, :4] *= np.float32(1e6) if k > 3 and rng.random() < 0.2 else 1
    scores = rng.uniform(0, 1, k)
    rows[:, 4] = np.where(rng.random(k) < 0.4, np.round(scores * 32) / 32, scores)
    rows[:, 5] = rng.integers(-1, 4, k)
    return rows


def random_results(rng, n: int = 48) -> list[ImageResult]:
    results = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.08:
            results.append(ImageResult(error=InvalidImage('cannot decode "é" \\ data')))
        elif kind < 0.12:
            results.append(ImageResult(error=ImageTooLarge("image is 10 × 10 = 100 pixels")))
        else:
            rows = random_rows(rng, int(rng.integers(1, 12))) if kind > 0.25 else np.zeros((0, 6), np.float32)
            results.append(ImageResult(int(rng.integers(1, 5000)), int(rng.integers(1, 5000)), Detections.from_rows(rows)))
    return results


def with_ids(rec: dict, ids) -> dict:
    if ids is not None and "detections" in rec:
        rec["detections"] = [{**d, "track_id": t} for d, t in zip(rec["detections"], ids)]
    return rec


def class_names_for(seed: int) -> list[str]:
    return NAMES if seed % 2 else ["persön", 'a "b"', ""]


@pytest.mark.parametrize("seed", range(6))
def test_image_lines_equal_json_dumps_of_the_readable_record(seed):
    rng = np.random.default_rng(seed)
    results = random_results(rng)
    names = [f"{i}-{IMAGE_NAMES[i % 5]}" for i in range(len(results))]
    class_names = class_names_for(seed)
    batch = detected_batch(results)
    assert image_lines(names, batch, class_names) == [json.dumps(image_json(r, n, class_names))
                                                     for n, r in zip(names, results)]


@pytest.mark.parametrize("seed", range(4))
def test_frame_lines_equal_json_dumps_of_the_frame_record(seed):
    """A video's frame: ``image``, ``frame``, ``time_s``, then the image's fields; track ids per
    detection (None before a track is confirmed) on the frames that have them."""
    rng = np.random.default_rng(100 + seed)
    results = random_results(rng, 24)
    frames = [(3 * k, round(3 * k / 29.97, 6)) for k in range(len(results))]
    ids = [None if r.error is not None or k % 4 == 3 else
           [None if rng.random() < 0.3 else int(rng.integers(0, 10**6)) for _ in range(len(r.detections))]
           for k, r in enumerate(results)]
    class_names = class_names_for(seed)
    expected = []
    for (index, time_s), r, track in zip(frames, results, ids):
        rec = with_ids(image_json(r, "cam/ü.mp4", class_names), track)
        expected.append(json.dumps({"image": "cam/ü.mp4", "frame": index, "time_s": time_s,
                                    **{k: v for k, v in rec.items() if k != "image"}}))
    assert frame_lines("cam/ü.mp4", frames, detected_batch(results), class_names, ids) == expected


def test_stream_events_equal_json_dumps_of_the_event():
    """A stream's event (``app.predict.streams.event_lines`` gives the heads and tails): its
    stream, source, frame and time, the image's fields, then ``latency_ms``."""
    rng = np.random.default_rng(7)
    results = random_results(rng, 16)
    heads, tails, expected = [], [], []
    for k, r in enumerate(results):
        fields = {"stream": f"0-{k % 3}", "source": 'rtsp://cam/"x"', "frame": k, "time_s": k / 7}
        latency = {"latency_ms": round(rng.uniform(0, 500), 2)}
        heads.append(LINES.fields(**fields))
        tails.append(LINES.fields(**latency))
        rec = with_ids(image_json(r, "", NAMES), [k] * len(r.detections) if r.detections is not None else None)
        rec.pop("image")
        expected.append(json.dumps({**fields, **rec, **latency}))
    track_ids = [[k] * len(r.detections) if r.detections is not None else None for k, r in enumerate(results)]
    assert records(heads, detected_batch(results), NAMES, tails=tails, track_ids=track_ids) == expected


def test_http_records_equal_what_json_response_renders():
    """``/v1``'s compact form: non-ASCII kept as UTF-8, no spaces, a tail of timings; an image
    that failed carries what the route puts there instead of the default error."""
    rng = np.random.default_rng(3)
    results = random_results(rng, 20)
    names = [IMAGE_NAMES[i % 5] for i in range(len(results))]
    timings = [{"decode_ms": 1.25, "batch_ms": 3.0, "total_ms": float(i)} for i in range(len(results))]
    got = records([HTTP.fields(image=n) for n in names], detected_batch(results), NAMES,
                  tails=[HTTP.fields(timings=t) if r.error is None else "" for t, r in zip(timings, results)],
                  style=HTTP, error_fields=lambda e: {"status": 400, "error": {"code": e.code, "message": str(e)}})
    for line, name, result, t in zip(got, names, results, timings):
        if result.error is None:
            want = {**image_json(result, name, NAMES), "timings": t}
        else:
            want = {"image": name, "status": 400, "error": {"code": result.error.code, "message": str(result.error)}}
        assert line.encode() == JSONResponse(want).body


def test_edge_values_keep_their_json_spelling():
    """-0.0, exponent-form scores (conf 0 keeps 1e-05), whole numbers, the largest coordinates."""
    rows = np.array([[-0.0, 0.0, 640, 639.995, 1e-05, 0], [0.004, 1.005, 2.675, 100.0, 3.2e-05, 1],
                     [-1e-3, 5e-3, 0.125, 0.375, 0.999995, 1], [7e3, 7e3, 9e3, 9e3, 1.0, 0]], np.float32)
    result = ImageResult(640, 640, Detections.from_rows(rows))
    got = image_lines(["x.jpg"], detected_batch([result]), NAMES)
    assert got == [json.dumps(image_json(result, "x.jpg", NAMES))]
    assert json.loads(got[0])["detections"][0]["score"] == 1e-05


def test_non_finite_values_are_written_as_json_dumps_writes_them():
    """Lines write NaN and infinities as ``json.dumps`` does; ``/v1`` refuses them as
    ``JSONResponse`` does (a ValueError, never invalid JSON)."""
    rows = np.array([[1, 2, 3, 4, np.nan, 0], [np.inf, 2, 3, 4, 0.5, 1]], np.float32)
    results = [ImageResult(640, 480, Detections.from_rows(rows)), ImageResult(error=InvalidImage("bad")),
               ImageResult(640, 480, Detections.empty())]
    names = ["n.jpg", "e.jpg", "z.jpg"]
    batch = detected_batch(results)
    assert image_lines(names, batch, NAMES) == [json.dumps(image_json(r, n, NAMES)) for n, r in zip(names, results)]
    with pytest.raises(ValueError):
        JSONResponse(image_json(results[0], "n.jpg", NAMES))
    with pytest.raises(ValueError):
        records([HTTP.fields(image="n.jpg")], detected_batch(results[:1]), NAMES, style=HTTP)


def test_nothing_to_write():
    assert image_lines([], detected_batch([]), NAMES) == []
    only_error = detected_batch([ImageResult(error=InvalidImage("empty image"))])
    assert image_lines(["e.jpg"], only_error, NAMES) == ['{"image": "e.jpg", "error": "empty image"}']


def json_dumps_in(style, value) -> str:
    """``json.dumps`` as the style calls it, a new encoder each time."""
    return json.dumps(value, ensure_ascii=style.ensure_ascii, allow_nan=style.allow_nan,
                      separators=(style.item, style.key))


def random_floats(rng, k: int) -> list[float]:
    """Finite floats of every magnitude (subnormal to near the largest), zeros of both signs, ties
    of ``round(v, 3)``, and now and then a NaN or an infinity."""
    out = []
    for _ in range(k):
        kind = rng.random()
        if kind < 0.05:
            out.append(float(rng.choice([np.nan, np.inf, -np.inf])))
        elif kind < 0.15:
            out.append(float(rng.choice([0.0, -0.0, 5e-324, -1e-300, 1.7e308, 1e16, 1e-5, 0.0625])))
        else:
            v = float(rng.choice([-1, 1]) * 10.0 ** rng.uniform(-12, 20))
            out.append(round(v, 3) if kind < 0.6 else v)
    return out


@pytest.mark.parametrize("style", [LINES, HTTP], ids=["lines", "http"])
def test_fields_and_a_floats_field_equal_json_dumps(style):
    """``Style.fields`` and ``Style.floats_field``'s template write what ``json.dumps`` writes for
    the dict (NaN and infinities in its words, or its refusal: a ValueError); values that are not
    floats (ints, bools, None, a NumPy float) go through json too."""
    rng = np.random.default_rng(11)
    names = ["decode_ms", "queue_ms", "ünï", 'q"%s%r']
    field = style.floats_field("timings %s", names)
    for _ in range(3000):
        values = random_floats(rng, len(names))
        if rng.random() < 0.05:
            values[int(rng.integers(len(names)))] = [7, True, None, np.float64(0.125)][int(rng.integers(4))]
        record = {"timings %s": dict(zip(names, values))}
        try:
            want = json_dumps_in(style, record)[1:-1]
        except ValueError:
            with pytest.raises(ValueError):
                field(values)
            with pytest.raises(ValueError):
                style.fields(**record)
            continue
        assert field(values) == want == style.fields(**record)
    heads = {"image": "sub/ü ñ 雪\t\"x\".jpg", "frame": 3, "time_s": -0.0, "ok": True, "none": None,
             "nested": {"status": 413, "error": {"code": "image_too_large", "message": "10 × 10 🙂"}}, "list": [1.5, "é"]}
    assert style.fields(**heads) == json_dumps_in(style, heads)[1:-1]
    assert style.fields() == "" and style.dumps("ü\x01") == json_dumps_in(style, "ü\x01")
    with pytest.raises(ValueError):
        style.floats_field("timings", ["a_ms", "a_ms"])  # json would keep one of them


@pytest.mark.parametrize("seed", range(4))
def test_the_coco_document_from_the_arrays_equals_the_one_from_the_lines(seed):
    """Batch after batch (errors, empty images, exact ties of the rounding, NaN and infinities),
    video frames named ``video#frame``: the same bytes as the document built from the lines."""
    rng = np.random.default_rng(200 + seed)
    class_names = class_names_for(seed)
    document, lines = CocoDocument(class_names), []
    for b in range(4):
        results = random_results(rng, int(rng.integers(0, 12)))
        if b == 2 and results and results[0].detections is not None and len(results[0].detections):
            rows = results[0].detections
            rows.scores[0], rows.boxes[0, 2] = np.nan, np.inf
        names = [f"{b}-{k}-{IMAGE_NAMES[k % 5]}" for k in range(len(results))]
        batch = detected_batch(results)
        if b % 2:  # a video's frames
            frames = [(k, k / 25) for k in range(len(results))]
            lines += [{**json.loads(line), "image": f"clip.mp4#{index}"}
                      for line, (index, _) in zip(frame_lines("clip.mp4", frames, batch, class_names), frames)]
            document.add([f"clip.mp4#{index}" for index, _ in frames], batch)
        else:
            lines += [json.loads(line) for line in image_lines(names, batch, class_names)]
            document.add(names, batch)
    assert document.dumps() == json.dumps(coco_document(lines, class_names))


def test_what_an_output_holds_is_read_back_once(tmp_path):
    """Images (an error line is an image written), each video's last frame, and nothing from a
    torn or foreign line."""
    out = tmp_path / "p.jsonl"
    lines = [
        '{"image": "a.jpg", "width": 1, "height": 1, "detections": []}',
        '{"image": "bad.png", "error": "cannot decode"}',
        '{"image": "v.mp4", "frame": 0, "time_s": 0.0, "width": 1, "height": 1, "detections": []}',
        '{"image": "v.mp4", "frame": 3, "time_s": 0.1, "width": 1, "height": 1, "detections": []}',
        '{"image": "w.mp4", "frame": 7, "time_s": 0.2, "error": "frame over the limit"}',
        '[1, 2]', '{"frame": 9}', '{"image": "v.mp4", "frame": "x"}', "not json",
        '{"image": "torn.jpg", "width": 1, "he',
    ]
    out.write_text("\n".join(lines))
    written = read_written(out)
    assert written.images == {"a.jpg", "bad.png"} and written.frames == {"v.mp4": 3, "w.mp4": 7}
    assert read_written(tmp_path / "missing.jsonl") == type(written)()

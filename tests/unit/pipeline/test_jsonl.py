"""A batch's JSON lines (``app.pipeline.jsonl``) are byte for byte what the per-image path gives:
``json.dumps(ImageResult.to_json(name, names))`` of the ``ImageResult`` that ``Detector.detect``
makes of the same pipeline output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.errors import ImageTooLarge, InvalidImage
from app.imaging.letterbox import letterbox_params
from app.pipeline.jsonl import image_result, json_lines

NAMES = ["Normal", "Fall"]


def per_image_lines(names, outputs, class_names):
    return [json.dumps(image_result(out).to_json(name, class_names)) for name, out in zip(names, outputs)]


def random_rows(rng, k: int, size: int = 640) -> np.ndarray:
    """NMS-like rows, a share of them on exact binary fractions (x.125, x.375, ...: exact ties of
    ``round(v, 2)``, and of ``round(s, 5)`` for scores on 1/32 steps) and outside the input."""
    rows = np.empty((k, 6), np.float32)
    xy = rng.uniform(-30, size + 30, (k, 4))
    tie = rng.random((k, 4)) < 0.4
    rows[:, :4] = np.where(tie, np.round(xy * 8) / 8, xy)
    scores = rng.uniform(0, 1, k)
    rows[:, 4] = np.where(rng.random(k) < 0.4, np.round(scores * 32) / 32, scores)
    rows[:, 5] = rng.integers(-1, 4, k)  # -1 and 2, 3: ids the model has no name for
    return rows


@pytest.mark.parametrize("seed", range(8))
def test_batch_lines_equal_json_dumps_of_to_json(seed):
    rng = np.random.default_rng(seed)
    shapes = [(480, 640), (1080, 810), (33, 1000), (720, 1280), (1, 1), (5000, 7)]
    names, outputs = [], []
    for i in range(64):
        kind = rng.random()
        name = ["a.jpg", "sub/ü ñ 雪.jpg", 'q"uote\\back\tslash.jpg', "emoji 🙂.png", "\x01ctl.jpg"][i % 5]
        names.append(f"{i}-{name}")
        if kind < 0.08:
            outputs.append(InvalidImage('cannot decode "é" \\ data'))
        elif kind < 0.12:
            outputs.append(ImageTooLarge("image is 10 × 10 = 100 pixels"))
        elif kind < 0.25:
            outputs.append((np.zeros((0, 6), np.float32), letterbox_params(*shapes[i % len(shapes)], 640)))
        else:
            outputs.append((random_rows(rng, int(rng.integers(1, 12))), letterbox_params(*shapes[i % len(shapes)], 640)))
    class_names = NAMES if seed % 2 else ["persön", "a \"b\"", ""]
    assert json_lines(names, outputs, class_names) == per_image_lines(names, outputs, class_names)


def test_edge_values_keep_their_json_spelling():
    """-0.0, exponent-form scores (conf 0 keeps 1e-05), whole numbers, the largest coordinates."""
    lb = letterbox_params(640, 640, 640)
    rows = np.array([[-0.0, 0.0, 640, 639.995, 1e-05, 0], [0.004, 1.005, 2.675, 100.0, 3.2e-05, 1],
                     [-1e-3, 5e-3, 0.125, 0.375, 0.999995, 1], [7e3, 7e3, 9e3, 9e3, 1.0, 0]], np.float32)
    got = json_lines(["x.jpg"], [(rows, lb)], NAMES)
    assert got == per_image_lines(["x.jpg"], [(rows, lb)], NAMES)
    assert json.loads(got[0])["detections"][0]["score"] == 1e-05


def test_non_finite_values_are_written_as_json_dumps_writes_them():
    lb = letterbox_params(480, 640, 640)
    rows = np.array([[1, 2, 3, 4, np.nan, 0], [np.inf, 2, 3, 4, 0.5, 1]], np.float32)
    outputs = [(rows, lb), InvalidImage("bad"), (np.zeros((0, 6), np.float32), lb)]
    names = ["n.jpg", "e.jpg", "z.jpg"]
    assert json_lines(names, outputs, NAMES) == per_image_lines(names, outputs, NAMES)


def test_nothing_to_write():
    assert json_lines([], [], NAMES) == []
    assert json_lines(["e.jpg"], [InvalidImage("empty image")], NAMES) == ['{"image": "e.jpg", "error": "empty image"}']

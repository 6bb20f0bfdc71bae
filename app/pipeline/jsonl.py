"""A batch's JSON lines straight from the pipeline's rows: byte for byte what
``json.dumps(ImageResult.to_json(name, class_names))`` gives for each image, without an
``ImageResult``, a ``Detections``, a dict per box and ``json.dumps`` per image (the folder
path's biggest holder of the GIL after reading, issue #16).

Why the bytes are the same:

* boxes: ``app.boxes.scale_boxes_stacked`` does ``scale_boxes``' float32 operations per element;
* ``round(v, 2)`` and ``round(s, 5)``: a float32 times 100 (or 1e5) is exact in float64 (24 + 5,
  24 + 12 significant bits), so ``rint`` of it is the correctly rounded, half-to-even decimal
  that ``round`` finds, and dividing by 100 (1e5) gives the float64 nearest that decimal, as
  ``round``'s own string-to-float does;
* numbers are written with ``%r`` (``float.__repr__``, as ``json`` does for finite floats; a
  batch with a NaN or an infinity takes ``json.dumps``) and strings with ``json.dumps``;
* the layout (keys, order, ``", "`` and ``": "``) is ``json.dumps``' default.

``tests/unit/pipeline/test_jsonl.py`` compares the two on varied and adversarial records.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from app.boxes import rows_to_detections, scale_boxes_stacked
from app.contracts import ImageResult, ImageRows
from app.errors import YolopipeError

_DETECTION = '{"box": [%r, %r, %r, %r], "score": %r, "class_id": %d, "class_name": %s}'
_IMAGE = '{"image": %s, "width": %d, "height": %d, "detections": [%s]}'


def image_result(out: ImageRows | YolopipeError) -> ImageResult:
    """What ``Detector.detect`` makes of one image's pipeline output."""
    if isinstance(out, YolopipeError):
        return ImageResult(error=out)
    rows, lb = out
    return ImageResult(lb.src_w, lb.src_h, rows_to_detections(rows, lb))


def json_lines(names: Sequence[str], outputs: Sequence[ImageRows | YolopipeError], class_names: list[str]) -> list[str]:
    """One JSON line (no newline) per image: ``names[i]`` with ``outputs[i]``, a ``Pipeline.run``
    answer (rows and letterbox) or the image's error."""
    ok = [i for i, out in enumerate(outputs) if not isinstance(out, YolopipeError)]
    rows = [np.asarray(outputs[i][0], dtype=np.float32).reshape(-1, 6) for i in ok]
    counts = [len(r) for r in rows]
    stacked = np.concatenate(rows) if rows else np.zeros((0, 6), np.float32)
    boxes = scale_boxes_stacked(stacked[:, :4], [outputs[i][1] for i in ok], counts).astype(np.float64)
    scores = stacked[:, 4].astype(np.float64)
    if not (np.isfinite(boxes).all() and np.isfinite(scores).all()):
        return [json.dumps(image_result(out).to_json(name, class_names)) for name, out in zip(names, outputs)]
    np.rint(boxes * 100, out=boxes)
    boxes /= 100
    np.rint(scores * 100_000, out=scores)
    scores /= 100_000
    class_ids = stacked[:, 5].astype(np.int32).tolist()
    labels = {i: json.dumps(n) for i, n in enumerate(class_names)}
    detections = [
        _DETECTION % (x1, y1, x2, y2, score, cid, labels.get(cid) or json.dumps(str(cid)))
        for (x1, y1, x2, y2), score, cid in zip(boxes.tolist(), scores.tolist(), class_ids)
    ]
    lines = []
    start = 0
    per_image = iter(zip(ok, counts))
    next_ok, count = next(per_image, (-1, 0))
    for i, (name, out) in enumerate(zip(names, outputs)):
        if i != next_ok:
            lines.append(json.dumps({"image": name, "error": str(out)}))
            continue
        lb = out[1]
        lines.append(_IMAGE % (json.dumps(name), lb.src_w, lb.src_h, ", ".join(detections[start : start + count])))
        start += count
        next_ok, count = next(per_image, (-1, 0))
    return lines

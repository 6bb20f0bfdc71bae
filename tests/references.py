"""Readable references of the JSON records yolopipe writes: an image's record as a dict, built
the way anyone would write it. ``app.records`` writes every record from arrays, without a dict
per box; tests hold its bytes (and what the service answers) to ``json.dumps`` of these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.contracts import DetectedBatch, ImageResult
from app.errors import YolopipeError
from app.ipc.answers import TIMES, Answers
from app.types import Detections


def detections_json(detections: Detections, names: list[str]) -> list[dict[str, Any]]:
    """An image's ``detections``: box and score rounded as ``round`` does, the class by id and name."""
    return [
        {
            "box": [round(v, 2) for v in box],
            "score": round(score, 5),
            "class_id": cid,
            "class_name": names[cid] if 0 <= cid < len(names) else str(cid),
        }
        for box, score, cid in zip(detections.boxes.tolist(), detections.scores.tolist(),
                                   detections.class_ids.tolist())
    ]


def image_json(result: ImageResult, image: str, names: list[str]) -> dict[str, Any]:
    """An image's record: its name and size and detections, or its name and error."""
    if result.error is not None:
        return {"image": image, "error": str(result.error)}
    assert result.detections is not None
    return {"image": image, "width": result.width, "height": result.height,
            "detections": detections_json(result.detections, names)}


def coco_document(records: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """``predict --coco``'s document, from the records the lines hold (``image_json``'s; a video
    frame's named ``video#frame``): the images that did not fail, each detection as a scored
    annotation, and the categories."""
    images, annotations = [], []
    for image_id, rec in enumerate(r for r in records if "error" not in r):
        images.append({"id": image_id, "file_name": rec["image"], "width": rec["width"], "height": rec["height"]})
        for d in rec["detections"]:
            x1, y1, x2, y2 = d["box"]
            annotations.append(
                {
                    "id": len(annotations),
                    "image_id": image_id,
                    "category_id": d["class_id"],
                    "bbox": [x1, y1, round(x2 - x1, 2), round(y2 - y1, 2)],
                    "area": round((x2 - x1) * (y2 - y1), 2),
                    "score": d["score"],
                    "iscrowd": 0,
                }
            )
    categories = [{"id": i, "name": n} for i, n in enumerate(names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def detected_batch(results: list[ImageResult]) -> DetectedBatch:
    """Per-image answers (``ImageResult``) as the detector's arrays, image by image."""
    n = len(results)
    widths, heights, counts = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    parts, errors = [], {}
    for i, r in enumerate(results):
        if r.error is not None:
            errors[i] = r.error
            continue
        det = r.detections if r.detections is not None else Detections.empty()
        part = np.empty((len(det), 6), np.float32)
        part[:, :4], part[:, 4], part[:, 5] = det.boxes, det.scores, det.class_ids
        parts.append(part)
        widths[i], heights[i], counts[i] = r.width, r.height, len(det)
    rows = np.concatenate(parts) if parts else np.zeros((0, 6), np.float32)
    return DetectedBatch(widths, heights, counts, rows, errors)


@dataclass
class ImageAnswer:
    """One image's answer as an object: its ticket's request, index and times, then its size
    and detections or its error."""

    req_id: int
    index: int
    width: int = 0
    height: int = 0
    detections: Detections | None = None
    error: YolopipeError | None = None
    decode_ms: float = 0.0
    queue_ms: float = 0.0
    batch: dict[str, float] = field(default_factory=dict)  # its batch's times: batch_ms and the pipeline's stages


def image_answers(answers: Answers) -> list[ImageAnswer]:
    """Answers (e.g. a RESULTS frame's, ``app.ipc.answers.read_answers``) as an object per
    image, for tests that look at one image at a time (the service reads them as arrays)."""
    out = []
    for i, (ticket, values) in enumerate(zip(answers.tickets.tolist(), answers.times())):
        req_id, index = ticket[:2]
        times = dict(zip(TIMES, values))
        batch = {k: v for k, v in times.items() if k not in ("decode_ms", "queue_ms")}
        result = answers.detected.result(i)
        out.append(ImageAnswer(req_id, index, result.width, result.height, result.detections, result.error,
                               times["decode_ms"], times["queue_ms"], batch))
    return out

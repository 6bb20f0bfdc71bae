"""Synthetic YOLOv8 head outputs for NMS tests: clustered, overlapping boxes like a real head's."""

from __future__ import annotations

import numpy as np


def random_head(rng: np.random.Generator, nc: int, anchors: int, objects: int = 20, ties: bool = False) -> np.ndarray:
    """A head output ``[4 + nc, anchors]`` (cx, cy, w, h, class scores) with ``objects`` clusters."""
    centers = rng.uniform(50, 590, (objects, 2))
    owner = rng.integers(0, objects, anchors)
    xy = centers[owner] + rng.normal(0, 6, (anchors, 2))
    wh = rng.uniform(20, 160, (objects, 2))[owner] * rng.uniform(0.8, 1.2, (anchors, 2))
    scores = rng.uniform(0, 1, (nc, anchors)) ** 3
    if ties:
        scores = np.round(scores, 2)
    return np.concatenate([xy.T, wh.T, scores]).astype(np.float32)


def random_boxes(rng: np.random.Generator, n: int, *, duplicates: bool = False, ties: bool = False):
    """``n`` xyxy float32 boxes with scores and 3 class ids; optionally repeated boxes and tied scores."""
    xy = rng.uniform(0, 300, (n, 2)).astype(np.float32)
    wh = rng.uniform(1, 80, (n, 2)).astype(np.float32)
    boxes = np.concatenate([xy, xy + wh], 1)
    if duplicates and n > 10:
        boxes[n // 2 :] = boxes[: n - n // 2]
    scores = rng.uniform(0, 1, n).astype(np.float32)
    if ties:
        scores = np.round(scores, 1).astype(np.float32)
    return boxes, scores, rng.integers(0, 3, n).astype(np.int32)

"""Greedy NMS for the CPU path: the keep set of ``app.boxes.nms_keep_indices``, faster.

The reference walks the score order and suppresses every later box a kept box overlaps, one
NumPy call per kept box; at a low confidence (thousands of candidates) that is ~17 ms per batch
of 16 on two cores. ``nms_keep_indices_compiled`` walks the same order and keeps a box unless a
box kept before it overlaps it: the same greedy result, with the IoU of each pair computed
exactly as the reference does (float32, same operand order, ``>`` against the same float32
threshold, 0/0 → NaN → kept). Numba's CPU compiler (not numba.cuda) compiles it on first use
and caches the code on disk.

Loading Numba and its cached code takes seconds of a short run's start-up (``yolopipe predict
samples``), so ``nms_keep_indices_cpu``, what the CPU pipeline calls, runs the reference itself
while an image has at most ``SMALL_NMS`` candidates (a few NumPy calls; the usual case at the
default confidence) and the compiled walk above that, loading Numba then.
"""

from __future__ import annotations

import functools

import numpy as np

from app.boxes import iou_threshold_f32, nms_keep_indices

SMALL_NMS = 256  # candidates up to which the NumPy reference is as quick as loading the compiler


def _greedy_keep(boxes: np.ndarray, order: np.ndarray, threshold: np.float32) -> np.ndarray:
    zero = np.float32(0)
    keep = np.empty(order.shape[0], np.int64)
    kept = 0
    for i in order:
        x1, y1, x2, y2 = boxes[i, 0], boxes[i, 1], boxes[i, 2], boxes[i, 3]
        area_i = (x2 - x1) * (y2 - y1)
        suppressed = False
        for k in range(kept):
            j = keep[k]
            w = max(zero, min(boxes[j, 2], x2) - max(boxes[j, 0], x1))
            h = max(zero, min(boxes[j, 3], y2) - max(boxes[j, 1], y1))
            inter = w * h
            area_j = (boxes[j, 2] - boxes[j, 0]) * (boxes[j, 3] - boxes[j, 1])
            if inter / (area_j + area_i - inter) > threshold:  # the kept box first, as the reference adds them
                suppressed = True
                break
        if not suppressed:
            keep[kept] = i
            kept += 1
    return keep[:kept]


@functools.cache
def _compiled():
    from numba import njit

    return njit(cache=True, error_model="numpy", nogil=True)(_greedy_keep)


def nms_keep_indices_compiled(boxes: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    """Drop-in for ``app.boxes.nms_keep_indices``: same arguments, same keep set, same order."""
    boxes = np.ascontiguousarray(boxes, dtype=np.float32)
    order = np.argsort(-np.asarray(scores, dtype=np.float32), kind="stable")
    return _compiled()(boxes, order, iou_threshold_f32(iou))


def nms_keep_indices_cpu(boxes: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    """The same keep set again: the reference for a few candidates, the compiled walk for many."""
    if len(boxes) <= SMALL_NMS:
        return nms_keep_indices(boxes, scores, iou)
    return nms_keep_indices_compiled(boxes, scores, iou)

"""Greedy NMS compiled for the CPU path: the keep set of ``app.boxes.nms_keep_indices``, faster.

The reference walks the score order and suppresses every later box a kept box overlaps, one
NumPy call per kept box; at a low confidence (thousands of candidates) that is ~17 ms per batch
of 16 on two cores. This walks the same order and keeps a box unless a box kept before it
overlaps it: the same greedy result, with the IoU of each pair computed exactly as the reference
does (float32, same operand order, ``>`` against the same float32 threshold, 0/0 → NaN → kept).
Numba's CPU compiler (not numba.cuda) is used; its code is cached on disk after the first run.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from app.boxes import iou_threshold_f32


@njit(cache=True, error_model="numpy", nogil=True)
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


def nms_keep_indices_compiled(boxes: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    """Drop-in for ``app.boxes.nms_keep_indices``: same arguments, same keep set, same order."""
    boxes = np.ascontiguousarray(boxes, dtype=np.float32)
    order = np.argsort(-np.asarray(scores, dtype=np.float32), kind="stable")
    return _greedy_keep(boxes, order, iou_threshold_f32(iou))

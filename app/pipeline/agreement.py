"""Agreement between two detection lists, as the issues define it: greedy one-to-one matching
at an IoU threshold, same class, and F1. Used by tests, the INT8 report and the benchmarks."""

from __future__ import annotations

import numpy as np


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of xyxy boxes, float64."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    return inter / np.maximum(area_a[:, None] + area_b[None] - inter, 1e-12)


def match_pairs(ref_boxes, ref_cls, boxes, cls, iou_thr: float = 0.5) -> list[tuple[int, int, float]]:
    """Greedy one-to-one matching by IoU, same class → ``(ref index, pred index, IoU)`` per pair.

    The pair with the highest IoU left is taken first (ties: the lowest indices), until none
    reaches ``iou_thr``.
    """
    ious = box_iou(ref_boxes, boxes)
    same = np.asarray(ref_cls)[:, None] == np.asarray(cls)[None, :]
    ious = np.where(same, ious, 0.0)
    pairs = []
    while ious.size and ious.max() >= iou_thr:
        i, j = np.unravel_index(ious.argmax(), ious.shape)
        pairs.append((int(i), int(j), float(ious[i, j])))
        ious[i, :] = 0
        ious[:, j] = 0
    return pairs


def match_counts(ref_boxes, ref_cls, boxes, cls, iou_thr: float = 0.5) -> tuple[int, int, int]:
    """Greedy one-to-one matching by IoU, same class → (true positives, n_ref, n_pred)."""
    return len(match_pairs(ref_boxes, ref_cls, boxes, cls, iou_thr)), len(ref_cls), len(cls)


def f1(tp: int, n_ref: int, n_pred: int) -> float:
    if n_ref == 0 and n_pred == 0:
        return 1.0
    return 2 * tp / (n_ref + n_pred)

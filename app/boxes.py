"""Box maths shared by every path: the NumPy NMS reference, box scaling, and agreement.

Head decode and NMS in NumPy are the exact, readable reference.

The GPU kernels in ``app/gpu/nms.py`` are tested against these functions, so every step
mirrors Ultralytics' ``non_max_suppression`` and ``torchvision.ops.nms`` in float32:

1. a box is a candidate when its best class score is ``> conf`` (best class only);
2. the class filter applies to that best class;
3. per-class NMS uses the class-offset trick (``box + class * MAX_WH``; 0 when agnostic);
4. greedy NMS visits candidates by descending score, ties by ascending anchor index (a stable
   sort, as torchvision's), and suppresses a later box when IoU ``>`` the threshold;
5. the first ``max_det`` kept boxes are returned, still in descending score order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.contracts import DetectParams
from app.types import Detections, Letterbox

MAX_WH = np.float32(7680.0)  # Ultralytics' per-class offset, larger than any image side


def head_candidates(
    pred: np.ndarray, conf: float, classes: tuple[int, ...] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One image's raw head output ``[4 + nc, anchors]`` → candidates above ``conf``.

    Returns ``(boxes_xyxy [N, 4], scores [N], class_ids [N], anchor_idx [N])`` in anchor order.
    """
    pred = np.asarray(pred, dtype=np.float32)
    cls_scores = pred[4:]
    class_ids = cls_scores.argmax(0)  # first maximum, like torch.max
    scores = cls_scores[class_ids, np.arange(cls_scores.shape[1])]
    keep = scores > np.float32(conf)
    if classes is not None:
        keep &= np.isin(class_ids, np.asarray(classes))
    anchor_idx = np.nonzero(keep)[0]
    xywh = pred[:4, anchor_idx].T
    half_wh = xywh[:, 2:] / np.float32(2)
    boxes = np.concatenate([xywh[:, :2] - half_wh, xywh[:, :2] + half_wh], axis=1)
    return boxes, scores[anchor_idx], class_ids[anchor_idx].astype(np.int32), anchor_idx


def iou_one_to_many(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one xyxy box with many, in float32 and in torchvision's order of operations."""
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    w = np.maximum(np.float32(0), np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]))
    h = np.maximum(np.float32(0), np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]))
    inter = w * h
    return inter / (area + areas - inter)


def iou_threshold_f32(iou: float) -> np.float32:
    """The float32 threshold ``t`` with ``iou32 > t`` ⇔ ``float(iou32) > iou``.

    torchvision compares the float32 IoU with the threshold as a double. Rounding the threshold
    to the nearest float32 can round it up (0.6 does) and keep a box torchvision suppresses;
    the largest float32 not above it gives the same answer for every float32 IoU.
    """
    t = np.float32(iou)
    return np.nextafter(t, np.float32(-np.inf)) if float(t) > iou else t


def nms_keep_indices(boxes: np.ndarray, scores: np.ndarray, iou: float) -> np.ndarray:
    """Greedy NMS: indices into ``boxes`` of the kept boxes, by descending score (stable)."""
    boxes = np.asarray(boxes, dtype=np.float32)
    order = np.argsort(-np.asarray(scores, dtype=np.float32), kind="stable")
    suppressed = np.zeros(len(order), dtype=bool)
    keep = []
    for rank, i in enumerate(order):
        if suppressed[rank]:
            continue
        keep.append(i)
        later = order[rank + 1 :]
        with np.errstate(invalid="ignore", divide="ignore"):  # 0/0 for empty boxes is NaN: not > iou
            suppressed[rank + 1 :] |= iou_one_to_many(boxes[i], boxes[later]) > iou_threshold_f32(iou)
    return np.asarray(keep, dtype=np.int64)


def offset_boxes(boxes: np.ndarray, class_ids: np.ndarray, agnostic: bool) -> np.ndarray:
    """Shift each class to its own region so one NMS never lets two classes suppress each other."""
    if agnostic:
        return boxes
    return boxes + class_ids.astype(np.float32)[:, None] * MAX_WH


def nms_numpy(pred: np.ndarray, params: DetectParams, keep_indices=nms_keep_indices) -> np.ndarray:
    """One image's head output → ``[K, 6]`` rows (x1, y1, x2, y2, score, class) in input pixels.

    ``keep_indices(boxes, scores, iou)``: the greedy NMS itself; the CPU path passes a compiled
    one with the same keep set (``app.pipeline.nms_cpu``), the default is the readable reference.
    """
    boxes, scores, class_ids, _ = head_candidates(pred, params.conf, params.classes)
    keep = keep_indices(offset_boxes(boxes, class_ids, params.agnostic), scores, params.iou)
    keep = keep[: params.max_det]
    rows = np.empty((len(keep), 6), np.float32)
    rows[:, :4] = boxes[keep]
    rows[:, 4] = scores[keep]
    rows[:, 5] = class_ids[keep]
    return rows


def scale_boxes_stacked(boxes: np.ndarray, lbs: Sequence[Letterbox], counts: Sequence[int]) -> np.ndarray:
    """Input-pixel xyxy boxes → original-image pixels, clipped (Ultralytics' ``scale_boxes``), for
    many images at once: ``boxes`` holds ``counts[i]`` boxes of image ``i`` (placed by ``lbs[i]``,
    undone by its ``Letterbox.undo``), one image after another. The one letterbox undo: every
    path's boxes go through it.

    Per element ``(x - pad) / gain``, clipped to the source size, in float32 with each letterbox
    value rounded to float32 once, whatever the batch: the same bits for an image alone or in a
    batch of 128 (in a few array ops instead of three per image, each box's two corners against
    its image's (x, y) values by broadcasting)."""
    out = np.array(boxes, dtype=np.float32, copy=True).reshape(-1, 2, 2)  # per box its two (x, y) corners
    # per image: (pad_x, pad_y), (gain_x, gain_y), (src_w, src_h)
    per_image = np.array([(*lb.undo, lb.src_w, lb.src_h) for lb in lbs], np.float64).astype(np.float32)
    per_image = per_image.reshape(-1, 3, 2)
    per_box = per_image if len(per_image) == 1 else np.repeat(per_image, np.asarray(counts, np.int64), axis=0)
    out -= per_box[:, 0:1]
    out /= per_box[:, 1:2]
    np.clip(out, 0, per_box[:, 2:3], out=out)
    return out.reshape(-1, 4)


def scale_boxes(boxes: np.ndarray, lb: Letterbox) -> np.ndarray:
    """``scale_boxes_stacked`` of one image's boxes."""
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    return scale_boxes_stacked(boxes, [lb], [len(boxes)])


def rows_to_detections(rows: np.ndarray, lb: Letterbox) -> Detections:
    """NMS output rows in input pixels → final detections in original pixels."""
    det = Detections.from_rows(rows)
    det.boxes = scale_boxes(det.boxes, lb)
    return det


# --- agreement between two detection lists: greedy one-to-one matching, same class, F1 ---
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


def f1(tp: int, n_ref: int, n_pred: int) -> float:
    if n_ref == 0 and n_pred == 0:
        return 1.0
    return 2 * tp / (n_ref + n_pred)

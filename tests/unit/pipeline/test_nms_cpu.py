"""The compiled CPU NMS keeps exactly what the NumPy reference and torchvision keep."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from app.boxes import nms_keep_indices, nms_numpy, offset_boxes
from app.contracts import DetectParams
from app.pipeline.nms_cpu import nms_keep_indices_compiled
from tests.heads import random_boxes, random_head


@pytest.mark.parametrize("seed", range(40))
def test_same_keep_set_and_order_as_the_reference_and_torchvision(seed):
    rng = np.random.default_rng(seed)
    boxes, scores, class_ids = random_boxes(rng, int(rng.integers(0, 1500)), duplicates=seed % 4 == 0,
                                            ties=seed % 3 == 0)
    if seed % 5 == 0 and len(boxes):  # empty boxes: 0/0 IoU is NaN, which suppresses nothing
        boxes[::7, 2:] = boxes[::7, :2]
    iou = [0.6, 0.45, 0.7, 0.5, float(rng.uniform(0.1, 0.9))][seed % 5]
    shifted = offset_boxes(boxes, class_ids, agnostic=seed % 6 == 0)
    ours = nms_keep_indices_compiled(shifted, scores, iou)
    np.testing.assert_array_equal(ours, nms_keep_indices(shifted, scores, iou))
    theirs = torchvision.ops.nms(torch.from_numpy(shifted), torch.from_numpy(scores), iou).numpy()
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("seed", range(8))
def test_low_confidence_heads_give_the_reference_rows(seed):
    """conf 0.001 on a dense head: thousands of candidates, the case the compiled walk is for."""
    rng = np.random.default_rng(1000 + seed)
    head = random_head(rng, nc=[1, 2, 80, 3][seed % 4], anchors=8400, objects=40, ties=seed % 2 == 0)
    params = DetectParams(conf=0.001, iou=[0.7, 0.45][seed % 2], max_det=300, agnostic=seed % 3 == 0)
    np.testing.assert_array_equal(nms_numpy(head, params, nms_keep_indices_compiled), nms_numpy(head, params))


def test_iou_exactly_at_the_threshold_is_kept_like_torchvision():
    for iou in (0.6, 0.45, 0.5, 0.7, 0.3):
        inner_h = np.float32(10 * iou)  # IoU = inner_h / 10 exactly: torchvision compares with the double
        boxes = np.array([[0, 0, 10, 10], [0, 0, 10, inner_h]], np.float32)
        scores = np.array([0.9, 0.8], np.float32)
        theirs = torchvision.ops.nms(torch.from_numpy(boxes), torch.from_numpy(scores), iou).numpy()
        np.testing.assert_array_equal(nms_keep_indices_compiled(boxes, scores, iou), theirs)

"""The NumPy reference NMS equals Ultralytics' ``non_max_suppression`` and torchvision's NMS."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from ultralytics.utils.nms import non_max_suppression
from ultralytics.utils.ops import scale_boxes as ul_scale_boxes

from app.boxes import head_candidates, nms_keep_indices, nms_numpy, offset_boxes, scale_boxes
from app.contracts import DetectParams
from app.imaging.letterbox import letterbox_params
from tests.heads import random_boxes, random_head


@pytest.mark.parametrize("seed", range(12))
def test_nms_numpy_equals_ultralytics(seed):
    rng = np.random.default_rng(seed)
    nc = [1, 2, 3, 80][seed % 4]
    head = random_head(rng, nc, anchors=2000, ties=seed % 3 == 0)
    conf, iou = [(0.25, 0.7), (0.001, 0.7), (0.1, 0.45)][seed % 3]
    max_det = [300, 5][seed % 2]
    classes = None if seed % 5 else (0,)
    agnostic = seed % 7 == 0
    params = DetectParams(conf=conf, iou=iou, max_det=max_det, classes=classes, agnostic=agnostic)
    ours = nms_numpy(head, params)
    theirs = non_max_suppression(
        torch.from_numpy(head[None]), conf, iou, classes=list(classes) if classes else None,
        agnostic=agnostic, max_det=max_det,
    )[0].numpy()
    assert ours.shape == theirs.shape
    if seed % 3 == 0:  # with tied scores only the set is defined by Ultralytics (its sort is not stable)
        ours_set, theirs_set = {tuple(r) for r in ours.tolist()}, {tuple(r) for r in theirs.tolist()}
        if len(ours) < max_det:
            assert ours_set == theirs_set
        else:  # cut by max_det inside a run of tied scores: which tied boxes make the cut is the sort's choice
            cut = float(ours[:, 4].min())
            assert float(theirs[:, 4].min()) == cut
            assert {r for r in ours_set if r[4] > cut} == {r for r in theirs_set if r[4] > cut}
    else:
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("seed", range(20))
def test_keep_indices_equal_torchvision(seed):
    rng = np.random.default_rng(100 + seed)
    # identical boxes; many ties (torchvision's sort is stable too)
    boxes, scores, class_ids = random_boxes(rng, int(rng.integers(0, 400)), duplicates=seed % 4 == 0, ties=seed % 3 == 0)
    iou = float(rng.uniform(0.3, 0.8))
    ours = nms_keep_indices(offset_boxes(boxes, class_ids, agnostic=False), scores, iou)
    theirs = torchvision.ops.batched_nms(
        torch.from_numpy(boxes), torch.from_numpy(scores), torch.from_numpy(class_ids), iou
    ).numpy()
    assert sorted(ours.tolist()) == sorted(theirs.tolist())
    np.testing.assert_array_equal(ours, theirs)


def test_empty_and_single():
    empty = np.zeros((6, 100), np.float32)
    assert nms_numpy(empty, DetectParams()).shape == (0, 6)
    one = empty.copy()
    one[:, 7] = [100, 100, 20, 40, 0.9, 0.1]
    rows = nms_numpy(one, DetectParams())
    np.testing.assert_allclose(rows, [[90, 80, 110, 120, 0.9, 0]])


def test_candidates_use_best_class_then_filter():
    head = np.zeros((4 + 3, 2), np.float32)
    head[:4] = 10
    head[4:, 0] = [0.2, 0.9, 0.3]  # best class 1
    head[4:, 1] = [0.5, 0.1, 0.4]  # best class 0
    _, scores, cls, idx = head_candidates(head, 0.25, classes=(2,))
    assert len(idx) == 0  # class 2 is never the best class: nothing, as in Ultralytics
    _, scores, cls, idx = head_candidates(head, 0.25)
    assert cls.tolist() == [1, 0] and idx.tolist() == [0, 1]


@pytest.mark.parametrize("shape", [(480, 640), (1080, 810), (33, 1000), (720, 1280)])
def test_scale_boxes_equals_ultralytics(shape):
    rng = np.random.default_rng(0)
    boxes = rng.uniform(0, 640, (50, 4)).astype(np.float32)
    boxes[:, 2:] = boxes[:, :2] + rng.uniform(1, 100, (50, 2))
    ours = scale_boxes(boxes, letterbox_params(*shape, 640))
    theirs = ul_scale_boxes((640, 640), torch.from_numpy(boxes.copy()), shape).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("shape", [(480, 640), (1080, 810), (517, 333), (101, 1000), (5, 99), (12, 239), (160, 90)])
def test_rect_scale_boxes_equals_ultralytics_bit_for_bit(shape):
    """Rect: boxes go back as Ultralytics' ``scale_boxes`` takes them from the rect input (its gain
    recomputed from the input and source shapes, which for 5 × 99 and 12 × 239 is not the
    placement's own), to the bit."""
    lb = letterbox_params(*shape, 640, 32)
    rng = np.random.default_rng(1)
    boxes = rng.uniform(-20, 660, (50, 4)).astype(np.float32)
    boxes[:, 2:] = boxes[:, :2] + rng.uniform(1, 100, (50, 2))
    ours = scale_boxes(boxes, lb)
    theirs = ul_scale_boxes((lb.input_h, lb.input_w), torch.from_numpy(boxes.copy()), shape).numpy()
    assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("iou", [0.6, 0.45, 0.5, 0.7, 0.3])
def test_threshold_compares_like_torchvision_at_exact_ties(iou):
    """IoU exactly equal to float32(iou): torchvision compares with the double threshold."""
    inner_h = np.float32(10 * iou)  # box 2 inside box 1 (10 × 10): IoU = inner_h / 10 in float32
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, inner_h]], np.float32)
    scores = np.array([0.9, 0.8], np.float32)
    theirs = torchvision.ops.nms(torch.from_numpy(boxes), torch.from_numpy(scores), iou).numpy()
    np.testing.assert_array_equal(nms_keep_indices(boxes, scores, iou), theirs)


def test_scale_boxes_stacked_is_bitwise_scale_boxes_per_image():
    """Many images' boxes at once (the folder's JSON lines) give the very bits ``scale_boxes`` gives
    each image alone: boxes inside, outside (clipped), empty images among them."""
    from app.boxes import scale_boxes_stacked

    rng = np.random.default_rng(3)
    shapes = [(480, 640), (1080, 810), (33, 1000), (720, 1280), (1, 1), (4000, 3), (640, 640)]
    counts = [int(rng.integers(0, 9)) if i % 3 else 0 for i in range(40)]
    lbs = [letterbox_params(*shapes[i % len(shapes)], 640, 32 * (i % 2)) for i in range(len(counts))]  # square, rect
    per_image = [rng.uniform(-50, 700, (n, 4)).astype(np.float32) for n in counts]
    stacked = scale_boxes_stacked(np.concatenate(per_image), lbs, counts)
    expected = np.concatenate([scale_boxes(b, lb) for b, lb in zip(per_image, lbs)])
    assert stacked.dtype == np.float32 and stacked.shape == expected.shape
    assert stacked.tobytes() == expected.tobytes()
    assert scale_boxes_stacked(np.zeros((0, 4), np.float32), [], []).shape == (0, 4)

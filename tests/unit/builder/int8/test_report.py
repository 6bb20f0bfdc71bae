"""The INT8 agreement figures: matching, F1, drift, and the real CPU path on a real image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.builder.int8_report import compare_models, match_detections, summarize
from app.boxes import box_iou, match_counts
from app.types import Detections


def dets(rows) -> Detections:
    return Detections.from_rows(np.array(rows, np.float32).reshape(-1, 6))


def test_box_iou_equals_torchvision():
    torch = pytest.importorskip("torch")
    from torchvision.ops import box_iou as tv_box_iou

    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 500, (20, 2))
    a = np.concatenate([xy, xy + rng.uniform(1, 200, (20, 2))], axis=1).astype(np.float32)
    xy = rng.uniform(0, 500, (15, 2))
    b = np.concatenate([xy, xy + rng.uniform(1, 200, (15, 2))], axis=1).astype(np.float32)
    expected = tv_box_iou(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    np.testing.assert_allclose(box_iou(a, b), expected, rtol=1e-5, atol=1e-6)


def test_matching_needs_same_class_and_iou_half():
    ref = dets([[0, 0, 100, 100, 0.9, 0], [200, 200, 300, 300, 0.8, 1]])
    test = dets([[0, 0, 100, 100, 0.85, 1], [205, 205, 305, 305, 0.7, 1]])  # first: wrong class
    pairs = match_detections(ref, test)
    assert [(i, j) for i, j, _ in pairs] == [(1, 1)]
    assert pairs[0][2] == pytest.approx(box_iou(ref.boxes[1:2], test.boxes[1:2])[0, 0])
    # IoU just below 0.5 does not count: 100x100 vs a box sharing 1/3 of the union
    assert match_detections(dets([[0, 0, 100, 100, 0.9, 0]]), dets([[50, 0, 150, 100, 0.9, 0]])) == []


def test_matching_is_one_to_one_highest_iou_first():
    ref = dets([[0, 0, 100, 100, 0.9, 0], [10, 10, 110, 110, 0.5, 0]])
    test = dets([[9, 9, 109, 109, 0.8, 0], [30, 30, 130, 130, 0.7, 0]])
    # ref 1 / test 0 is the best pair (IoU 0.96) even though ref 0 scores higher; ref 0 then
    # takes test 1 (IoU 0.32 < 0.5: no match). One-to-one: 1 pair.
    pairs = match_detections(ref, test)
    assert [(i, j) for i, j, _ in pairs] == [(1, 0)]
    assert pairs[0][2] == pytest.approx(box_iou(ref.boxes[1:], test.boxes[:1])[0, 0])
    # the same matching the rest of the project counts with
    assert match_counts(ref.boxes, ref.class_ids, test.boxes, test.class_ids) == (1, 2, 2)


def test_summary_f1_drift_and_lost_images():
    fp32 = [dets([[0, 0, 10, 10, 0.9, 0], [20, 20, 40, 40, 0.6, 1]]), dets([[0, 0, 50, 50, 0.7, 0]]), dets([])]
    int8 = [dets([[0, 0, 10, 10, 0.8, 0]]), dets([]), dets([[5, 5, 9, 9, 0.3, 0]])]
    r = summarize("m.onnx", ["a", "b", "c"], fp32, int8)
    assert (r.fp32_boxes, r.int8_boxes, r.matched) == (3, 2, 1)
    assert r.f1 == pytest.approx(2 * 1 / 5)
    assert r.precision == pytest.approx(0.5) and r.recall == pytest.approx(1 / 3)
    assert r.mean_iou == pytest.approx(1.0)
    assert r.mean_score_drift == pytest.approx(0.1, abs=1e-6) and r.max_score_drift == pytest.approx(0.1, abs=1e-6)
    assert r.lost_all == ["b"]  # "c" had no FP32 boxes: nothing to lose
    assert summarize("m", ["x"], [dets([])], [dets([])]).f1 == 1.0


def test_fp32_against_itself_through_the_real_pipeline():
    import cv2
    import ultralytics

    from app.builder.export import export_onnx

    exported = export_onnx("sample")
    bus = cv2.imread(str(Path(ultralytics.__file__).parent / "assets" / "bus.jpg"))
    report, fp32 = compare_models(exported.onnx_path, exported.onnx_path, exported.meta, [bus], ["bus.jpg"])
    assert len(fp32[0]) > 0  # the sample model finds people in bus.jpg
    assert report.f1 == 1.0 and report.mean_iou == pytest.approx(1.0) and report.max_score_drift == 0.0

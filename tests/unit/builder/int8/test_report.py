"""The INT8 report: matching, F1 and its interval, mAP50, and the detection path it runs."""

from __future__ import annotations

import numpy as np
import pytest

from app.boxes import match_pairs
from app.builder.int8.report import HeldOut, bootstrap_f1, detect, map50, summarize
from app.imaging.letterbox import letterbox
from app.types import Detections


def dets(rows) -> Detections:
    return Detections.from_rows(np.array(rows, np.float32).reshape(-1, 6))


def test_summary_f1_drift_lost_images_and_both_thresholds():
    fp32 = [dets([[0, 0, 10, 10, 0.9, 0], [20, 20, 40, 40, 0.6, 1], [50, 50, 60, 60, 0.15, 0]]),
            dets([[0, 0, 50, 50, 0.7, 0]]), dets([])]
    int8 = [dets([[0, 0, 10, 10, 0.8, 0], [50, 50, 60, 60, 0.2, 0]]), dets([]), dets([[5, 5, 9, 9, 0.3, 0]])]
    r = summarize("m.onnx", ["a", "b", "c"], fp32, int8, min_images=3, min_boxes=3)
    assert (r.fp32_boxes, r.int8_boxes, r.matched) == (3, 2, 1)  # conf 0.25: the 0.15/0.2 boxes do not count
    assert r.f1 == pytest.approx(2 * 1 / 5)
    assert r.precision == pytest.approx(0.5) and r.recall == pytest.approx(1 / 3)
    assert r.f1_conf01 == pytest.approx(2 * 2 / (4 + 3)) and r.fp32_boxes_conf01 == 4
    assert r.mean_iou == pytest.approx(1.0)
    assert r.mean_score_drift == pytest.approx(0.1, abs=1e-6) and r.max_score_drift == pytest.approx(0.1, abs=1e-6)
    assert r.lost_all == ["b"]  # "c" had no FP32 boxes: nothing to lose
    assert [w["image"] for w in r.worst_images] == ["b", "c", "a"]
    assert r.trustworthy
    few = summarize("m", ["x"], [dets([])], [dets([])])
    assert few.f1 == 1.0 and not few.trustworthy and len(few.warnings) == 2  # 1 image, 0 boxes


def test_bootstrap_interval_matches_a_plain_resampling():
    rng = np.random.default_rng(0)
    fp32, int8, names = [], [], []
    for k in range(40):
        n = int(rng.integers(1, 6))
        boxes = [[10 * j, 0, 10 * j + 8, 8, 0.9, 0] for j in range(n)]
        fp32.append(dets(boxes))
        int8.append(dets(boxes[: n - int(rng.random() < 0.3)]))  # ~30 % of images lose a box
        names.append(str(k))
    r = summarize("m", names, fp32, int8)
    draws = np.random.default_rng(0).integers(0, 40, (2000, 40))
    per = np.array([(a.matched, a.fp32_boxes + a.int8_boxes) for a in r.per_image])
    plain = [2 * per[d, 0].sum() / per[d, 1].sum() for d in draws]
    assert r.f1_ci95 == pytest.approx(tuple(np.percentile(plain, [2.5, 97.5])))
    assert r.f1_ci95[0] < r.f1 < r.f1_ci95[1] < 1.0
    assert bootstrap_f1(r.per_image[:1] * 5)[0] == bootstrap_f1(r.per_image[:1] * 5)[1]  # no spread, no width


def test_map50_is_one_for_identical_detections_and_counts_misses():
    fp32 = [dets([[0, 0, 10, 10, 0.9, 0], [20, 20, 40, 40, 0.8, 1]]), dets([[0, 0, 50, 50, 0.7, 0]])]
    assert map50(fp32, fp32) == pytest.approx(1.0)
    # class 1's only box found, class 0 finds one of its two: AP 1.0 and 0.5
    half = [dets([[20, 20, 40, 40, 0.8, 1], [0, 0, 10, 10, 0.9, 0]]), dets([[100, 100, 120, 120, 0.9, 0]])]
    assert map50(fp32, half) == pytest.approx((1.0 + 0.5) / 2, abs=0.01)
    assert map50([dets([])], [dets([])]) is None


def test_detect_equals_ultralytics_on_real_photos(sample_model_dir, ultralytics_model, assets_dir):
    import cv2

    held = HeldOut()
    originals = []
    for name in ("bus.jpg", "zidane.jpg"):
        img = cv2.imread(str(assets_dir / name))
        placed, lb = letterbox(img, 640)
        held.names.append(name)
        held.images.append(placed)
        held.placements.append(lb)
        originals.append(img)
    ours = detect(sample_model_dir / "model.onnx", held)
    total = 0
    for img, det in zip(originals, ours):
        ref = ultralytics_model.predict(img, imgsz=640, rect=False, conf=0.25, iou=0.7, verbose=False)[0].boxes
        served = det.scores > 0.25
        boxes, cls, scores = det.boxes[served], det.class_ids[served], det.scores[served]
        pairs = match_pairs(ref.xyxy.numpy(), ref.cls.numpy().astype(int), boxes, cls)
        assert len(pairs) == len(ref) == len(boxes)
        total += len(pairs)
        for i, j, iou in pairs:
            assert iou > 0.99 and abs(float(scores[j]) - float(ref.conf[i])) < 2e-3
    assert total > 0

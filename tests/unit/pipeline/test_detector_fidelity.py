"""The CPU path (ONNX Runtime FP32) gives Ultralytics' own detections on the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from app.boxes import box_iou, f1, match_pairs
from app.contracts import RunShape
from app.errors import InvalidParameter
from app.predict.folder import list_images
from app.runtime import OpenOptions, open_detector


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=4))
    with open_detector(options) as det:
        yield det


def ultralytics_predict(model, path):
    r = model.predict(str(path), imgsz=640, rect=False, conf=0.25, iou=0.7, verbose=False)[0]
    return r.boxes.xyxy.numpy(), r.boxes.conf.numpy(), r.boxes.cls.numpy().astype(int)


@pytest.mark.parametrize("name", ["bus.jpg", "zidane.jpg"])
def test_every_detection_equals_ultralytics(name, detector, ultralytics_model, assets_dir):
    path = assets_dir / name
    boxes, scores, cls = ultralytics_predict(ultralytics_model, path)
    (ours,) = detector.detect([path.read_bytes()], detector.params())
    det = ours.detections
    assert len(boxes) > 0 and len(det) == len(boxes)
    np.testing.assert_array_equal(det.class_ids, cls)
    assert np.diag(box_iou(boxes, det.boxes)).min() >= 0.99
    assert np.abs(det.scores - scores).max() <= 1e-3


def test_varied_folder_matches_ultralytics(detector, ultralytics_model, varied_images):
    """Sizes from 160 to 1280 px, JPEG and PNG, gray and alpha: F1 ≥ 0.99 at IoU 0.5, same class."""
    images = list_images(str(varied_images))
    assert len(images) >= 10
    results = detector.detect([img.path.read_bytes() for img in images], detector.params())
    tp = n_ref = n_pred = 0
    for img, res in zip(images, results):
        assert res.error is None, img.name
        ref_boxes, _, ref_cls = ultralytics_predict(ultralytics_model, img.path)
        pairs = match_pairs(ref_boxes, ref_cls, res.detections.boxes, res.detections.class_ids)
        tp, n_ref, n_pred = tp + len(pairs), n_ref + len(ref_cls), n_pred + len(res.detections)
    assert n_ref >= 10
    assert f1(tp, n_ref, n_pred) >= 0.99


def test_arrays_and_bytes_agree(detector, assets_dir):
    import cv2

    data = (assets_dir / "bus.jpg").read_bytes()
    frame = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    a, b = detector.detect([data, frame], detector.params())
    np.testing.assert_array_equal(a.detections.boxes, b.detections.boxes)
    assert (a.width, a.height) == (810, 1080)


def test_bad_item_does_not_stop_the_batch(detector, assets_dir):
    data = (assets_dir / "zidane.jpg").read_bytes()
    results = detector.detect([b"", data, b"<html>", data[:500]], detector.params())
    assert [r.error is None for r in results] == [False, True, False, False]
    assert len(results[1].detections) > 0


def test_params_are_validated(detector):
    with pytest.raises(InvalidParameter):
        detector.params(conf=1.5)
    with pytest.raises(InvalidParameter):
        detector.params(classes=[7])  # the sample model has 2 classes
    p = detector.params(conf=0.5, classes=[1], max_det=3)
    assert p.classes == (1,) and p.max_det == 3


def test_class_filter_and_max_det(detector, assets_dir):
    data = (assets_dir / "bus.jpg").read_bytes()
    (full,) = detector.detect([data], detector.params(conf=0.001))  # low enough for both classes
    (only0,) = detector.detect([data], detector.params(conf=0.001, classes=[0]))
    (top1,) = detector.detect([data], detector.params(max_det=1))
    # per-class NMS: the class filter keeps exactly the unfiltered run's class-0 boxes
    is0 = full.detections.class_ids == 0
    assert is0.any() and (~is0).any()
    np.testing.assert_array_equal(only0.detections.boxes, full.detections.boxes[is0])
    np.testing.assert_array_equal(only0.detections.class_ids, full.detections.class_ids[is0])
    assert len(top1.detections) == 1 and top1.detections.scores[0] == full.detections.scores.max()

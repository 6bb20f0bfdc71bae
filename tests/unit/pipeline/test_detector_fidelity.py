"""The CPU path (ONNX Runtime FP32) gives Ultralytics' own detections on the same weights: rect
(the default) equals ``model.predict(source)`` with its defaults (batch 1, rect letterbox), on
photos of every shape and on a video; ``--square`` equals ``model.predict(source, rect=False)``."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from app.boxes import box_iou, f1, match_pairs
from app.contracts import RunShape
from app.errors import InvalidParameter
from app.predict.folder import list_images, predict_folder
from app.runtime import OpenOptions, open_detector

CONF, IOU = 0.25, 0.7  # both sides' defaults


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=4))
    with open_detector(options) as det:
        assert det.shape.letterbox == "rect"  # the default
        yield det


@pytest.fixture(scope="module")
def square(artifacts_dir):
    shape = RunShape(max_batch=4, letterbox="square")
    with open_detector(OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=shape)) as det:
        yield det


def ultralytics_predict(model, source, **kwargs):
    """``model.predict(source)`` with its defaults (imgsz 640 from the weights, batch 1, rect)
    unless ``kwargs`` say otherwise."""
    r = model.predict(source, conf=CONF, iou=IOU, verbose=False, **kwargs)[0]
    return r.boxes.xyxy.numpy(), r.boxes.conf.numpy(), r.boxes.cls.numpy().astype(int)


@pytest.mark.parametrize("letterbox", ["rect", "square"])
@pytest.mark.parametrize("name", ["bus.jpg", "zidane.jpg"])
def test_every_detection_equals_ultralytics(name, letterbox, detector, square, ultralytics_model, assets_dir):
    """Box for box: rect against Ultralytics' defaults, square against ``rect=False``."""
    path = assets_dir / name
    boxes, scores, cls = ultralytics_predict(ultralytics_model, str(path), **({} if letterbox == "rect" else
                                                                             {"rect": False}))
    (ours,) = (detector if letterbox == "rect" else square).detect([path.read_bytes()], detector.params())
    det = ours.detections
    assert len(boxes) > 0 and len(det) == len(boxes)
    np.testing.assert_array_equal(det.class_ids, cls)
    assert np.diag(box_iou(boxes, det.boxes)).min() >= 0.99
    assert np.abs(det.scores - scores).max() <= 1e-3


def agreement(pairs) -> tuple[float, float, int]:
    """F1 (IoU 0.5, same class) and the largest |Δscore| of a matched box over ``(reference, ours)``
    pairs of ``(boxes, scores, classes)``, and the reference's box count."""
    tp = n_ref = n_ours = 0
    worst = 0.0
    for (rb, rs, rc), (b, s, c) in pairs:
        matched = match_pairs(rb, rc, b, c)
        tp, n_ref, n_ours = tp + len(matched), n_ref + len(rc), n_ours + len(c)
        worst = max([worst, *(abs(float(rs[i]) - float(s[j])) for i, j, _ in matched)])
    return f1(tp, n_ref, n_ours), worst, n_ref


def line_boxes(record) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dets = record["detections"]
    return (np.array([d["box"] for d in dets], np.float32).reshape(-1, 4), np.array([d["score"] for d in dets]),
            np.array([d["class_id"] for d in dets], int))


@pytest.fixture(scope="module")
def shapes_folder(tmp_path_factory, assets_dir):
    """Photos of every shape made from Ultralytics' two: 3:4, 4:3, 16:9, 9:16-ish, 1:1, odd sizes,
    thin strips, images below imgsz (scaled up) and above it, PNG beside JPEG, and a JPEG stored
    on its side with EXIF orientation 6 (OpenCV turns it upright, for both)."""
    from app.benchmark.workloads import with_exif_orientation

    out = tmp_path_factory.mktemp("shapes")
    bus, zidane = cv2.imread(str(assets_dir / "bus.jpg")), cv2.imread(str(assets_dir / "zidane.jpg"))

    def sized(img, w, h):
        return cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA if w * h < img.shape[0] * img.shape[1]
                          else cv2.INTER_LINEAR)

    views = {
        "bus_3x4.jpg": bus,  # 810 × 1080
        "zidane_16x9.jpg": zidane,  # 1280 × 720
        "zidane_4x3.jpg": zidane[:, 160:1120],  # 960 × 720
        "bus_480x640.png": sized(bus, 480, 640),
        "bus_1x1.jpg": bus[135:945],  # 810 × 810
        "zidane_1x1.png": sized(zidane[:, 280:1000], 500, 500),
        "bus_333x517.jpg": sized(bus, 333, 517),
        "zidane_1000x101.jpg": sized(zidane[300:420], 1000, 101),
        "bus_16x9.jpg": bus[300:756],  # 810 × 456
        "zidane_small_320x180.jpg": sized(zidane, 320, 180),
        "bus_small_150x200.png": sized(bus, 150, 200),
        "zidane_large_1600x900.jpg": sized(zidane, 1600, 900),
        "bus_mirror_3x4.jpg": bus[:, ::-1],
        "zidane_crop_417x611.jpg": zidane[50:661, 400:817],
    }
    for name, img in views.items():
        cv2.imwrite(str(out / name), img, [cv2.IMWRITE_JPEG_QUALITY, 95] if name.endswith(".jpg") else [])
    side = cv2.imencode(".jpg", cv2.rotate(bus, cv2.ROTATE_90_COUNTERCLOCKWISE), [cv2.IMWRITE_JPEG_QUALITY, 95])[1]
    (out / "bus_exif6.jpg").write_bytes(with_exif_orientation(side.tobytes(), 6))
    return out


def test_predict_on_photos_of_every_shape_equals_ultralytics_defaults(detector, ultralytics_model, shapes_folder,
                                                                      tmp_path):
    """``predict`` on the folder (rect, the default, in windows grouped by input size) against
    ``model.predict(path)`` with its defaults on each file: F1 ≥ 0.999 and |Δscore| ≤ 1e-3."""
    out = tmp_path / "p.jsonl"
    summary = predict_folder(detector, str(shapes_folder), out, detector.params())
    records = {r["image"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert summary.errors == 0 and len(records) == 15
    assert (records["bus_exif6.jpg"]["width"], records["bus_exif6.jpg"]["height"]) == (810, 1080)  # turned upright
    pairs = [(ultralytics_predict(ultralytics_model, str(shapes_folder / name)), line_boxes(rec))
             for name, rec in records.items()]
    score, worst, n_ref = agreement(pairs)
    assert n_ref >= 40  # the comparison has content
    assert score >= 0.999 and worst <= 1e-3, (score, worst)


def test_square_is_not_what_ultralytics_defaults_give(square, ultralytics_model, shapes_folder):
    """Why rect is the default: the same photos letterboxed to the square (Ultralytics'
    ``rect=False``) give other boxes and scores than its defaults."""
    images = list_images(str(shapes_folder))
    ours = square.detect([img.path.read_bytes() for img in images], square.params())
    pairs = [(ultralytics_predict(ultralytics_model, str(img.path)),
              (r.detections.boxes, r.detections.scores, r.detections.class_ids)) for img, r in zip(images, ours)]
    score, worst, _ = agreement(pairs)
    assert worst > 1e-2
    same = [(ultralytics_predict(ultralytics_model, str(img.path), rect=False),
             (r.detections.boxes, r.detections.scores, r.detections.class_ids)) for img, r in zip(images, ours)]
    score, worst, _ = agreement(same)
    assert score >= 0.999 and worst <= 1e-3, (score, worst)


def test_predict_on_a_video_equals_ultralytics_defaults_on_its_frames(detector, ultralytics_model, assets_dir,
                                                                      tmp_path):
    """A 16:9 clip written here (OpenCV's MJPG), read by ``predict`` and by Ultralytics itself:
    frame by frame, F1 ≥ 0.999 and |Δscore| ≤ 1e-3; every frame runs at 384 × 640."""
    from tests.videos import clip_frames

    clip = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (640, 360))
    if not writer.isOpened():
        pytest.skip("this OpenCV cannot write MJPG video")
    for frame in clip_frames(assets_dir, 12, size=(640, 360)):
        writer.write(frame)
    writer.release()
    out = tmp_path / "v.jsonl"
    summary = predict_folder(detector, str(clip), out, detector.params())
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary.errors == 0 and [r["frame"] for r in records] == list(range(12))
    assert detector.input_size(360, 640) == (384, 640)
    results = ultralytics_model.predict(str(clip), stream=True, conf=CONF, iou=IOU, verbose=False)
    theirs = [(r.boxes.xyxy.numpy(), r.boxes.conf.numpy(), r.boxes.cls.numpy().astype(int)) for r in results]
    assert len(theirs) == 12
    score, worst, n_ref = agreement(zip(theirs, map(line_boxes, records)))
    assert n_ref >= 12 and score >= 0.999 and worst <= 1e-3, (score, worst)


def test_varied_folder_matches_ultralytics(detector, ultralytics_model, varied_images):
    """Sizes from 160 to 1280 px, JPEG and PNG, gray and alpha: F1 ≥ 0.999 at IoU 0.5, same class."""
    images = list_images(str(varied_images))
    assert len(images) >= 10
    results = detector.detect([img.path.read_bytes() for img in images], detector.params())
    pairs = []
    for img, res in zip(images, results):
        assert res.error is None, img.name
        pairs.append((ultralytics_predict(ultralytics_model, str(img.path)),
                      (res.detections.boxes, res.detections.scores, res.detections.class_ids)))
    score, worst, n_ref = agreement(pairs)
    assert n_ref >= 10 and score >= 0.999 and worst <= 1e-3, (score, worst)


def test_an_image_gets_the_same_json_whatever_it_is_batched_with(detector, shapes_folder):
    """Rect runs one input size per run, and an image's answer depends on nothing else in its run:
    each photo's JSON line is byte for byte the same alone, in a batch of its own size, and in a
    batch mixing every size (runs of up to four)."""
    from app.records import image_lines

    images = list_images(str(shapes_folder))
    data = [img.path.read_bytes() for img in images]
    names, params = [img.name for img in images], detector.params()
    mixed = image_lines(names, detector.run(data, params), detector.names)
    alone = [image_lines([n], detector.run([d], params), detector.names)[0] for n, d in zip(names, data)]
    assert mixed == alone
    sizes = {}
    for k, d in enumerate(data):
        sizes.setdefault(detector.input_size(*cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR).shape[:2]),
                         []).append(k)
    assert len(sizes) >= 6
    for same in sizes.values():
        together = image_lines([names[k] for k in same], detector.run([data[k] for k in same], params), detector.names)
        assert together == [alone[k] for k in same]


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

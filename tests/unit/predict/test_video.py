"""Videos in ``predict``: one line per frame, equal to ``detect`` on the frames OpenCV decodes, and
to Ultralytics' own predict on them; ``--vid-stride``, ``--resume``, ``--save-images``, ``--track``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import cv2
import pytest

from app.boxes import f1, match_pairs
from app.contracts import RunShape
from app.predict.folder import predict_folder
from app.runtime import OpenOptions, open_detector
from tests.references import detections_json
from tests.videos import CLIP_FPS, CLIP_SIZE, decoded_frames, write_clip

CLI = [sys.executable, "-m", "app.cli"]


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=4))
    with open_detector(options) as det:
        yield det


@pytest.fixture(scope="module")
def media(tmp_path_factory, assets_dir):
    """A folder with a photo and a clip in a subfolder."""
    src = tmp_path_factory.mktemp("media")
    shutil.copy(assets_dir / "bus.jpg", src / "bus.jpg")
    write_clip(src / "cams" / "clip.avi", assets_dir)
    return src


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def frame_lines(records, name="cams/clip.avi"):
    return [r for r in records if r["image"] == name]


@pytest.fixture(scope="module")
def full_run(detector, media, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out.jsonl"
    summary = predict_folder(detector, str(media), out, detector.params())
    return out, summary


def test_each_frame_equals_detect_on_the_frames_opencv_decodes(detector, media, full_run):
    out, summary = full_run
    records = lines(out)
    frames = decoded_frames(media / "cams" / "clip.avi")
    video = frame_lines(records)
    assert [r["frame"] for r in video] == list(range(len(frames))) and len(frames) == 12
    assert [r["time_s"] for r in video] == [round(i / CLIP_FPS, 6) for i in range(12)]
    assert all((r["width"], r["height"]) == CLIP_SIZE for r in video)
    reference = detector.detect(frames, detector.params())
    assert [r["detections"] for r in video] == [detections_json(ref.detections, detector.names) for ref in reference]
    assert sum(len(r["detections"]) for r in video) >= 12  # people in every frame: the comparison has content
    assert [r["image"] for r in records if "frame" not in r] == ["bus.jpg"]  # images as before
    assert (summary.images, summary.videos, summary.errors) == (13, 1, 0)


def test_frames_match_ultralytics_on_the_same_frames(media, full_run, ultralytics_model):
    frames = decoded_frames(media / "cams" / "clip.avi")
    tp = n_ref = n_pred = 0
    for frame, rec in zip(frames, frame_lines(lines(full_run[0]))):
        r = ultralytics_model.predict(frame, conf=0.25, iou=0.7, verbose=False)[0]  # its defaults: rect, as ours
        ours_boxes = [d["box"] for d in rec["detections"]]
        ours_cls = [d["class_id"] for d in rec["detections"]]
        import numpy as np

        pairs = match_pairs(r.boxes.xyxy.numpy(), r.boxes.cls.numpy().astype(int),
                            np.array(ours_boxes, np.float32).reshape(-1, 4), np.array(ours_cls, int))
        tp, n_ref, n_pred = tp + len(pairs), n_ref + len(r.boxes), n_pred + len(ours_cls)
    assert n_ref >= 12
    assert f1(tp, n_ref, n_pred) >= 0.99


def test_vid_stride_keeps_every_nth_frame_with_its_own_index(detector, media, full_run, tmp_path):
    out = tmp_path / "stride.jsonl"
    predict_folder(detector, str(media / "cams"), out, detector.params(), vid_stride=5)
    strided = lines(out)
    assert [r["frame"] for r in strided] == [0, 5, 10]
    every = {r["frame"]: r for r in frame_lines(lines(full_run[0]))}
    assert [r["detections"] for r in strided] == [every[i]["detections"] for i in (0, 5, 10)]
    assert strided[0]["image"] == "clip.avi"  # relative to SOURCE, as for images


def test_resume_goes_on_after_the_last_frame_written(detector, media, full_run, tmp_path):
    full = full_run[0].read_text().splitlines()
    out = tmp_path / "partial.jsonl"
    out.write_text("\n".join(full[:6]) + '\n{"image": "cams/clip.av')  # the photo, frames 0-4, a torn line
    summary = predict_folder(detector, str(media), out, detector.params(), resume=True)
    records = [r for r in lines_tolerant(out)]
    assert [r["frame"] for r in frame_lines(records)] == list(range(12))
    assert frame_lines(records) == frame_lines(lines(full_run[0]))
    assert summary.skipped == 1 and summary.images == 7  # bus.jpg skipped; frames 5..11 done now


def lines_tolerant(path):
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def test_save_images_writes_the_annotated_video(detector, media, tmp_path):
    saved = tmp_path / "annotated"
    predict_folder(detector, str(media), tmp_path / "o.jsonl", detector.params(), save_images=saved)
    assert (saved / "bus.jpg").is_file()
    written = decoded_frames(saved / "cams" / "clip.avi.mp4")
    assert len(written) == 12 and written[0].shape[:2] == (CLIP_SIZE[1], CLIP_SIZE[0])
    original = decoded_frames(media / "cams" / "clip.avi")
    assert cv2.absdiff(written[0], original[0]).max() > 100  # boxes were drawn on it


def test_coco_holds_the_images_then_each_frame_as_the_lines_hold_them(detector, media, tmp_path):
    """``--coco`` over a photo and a video, from the batches' arrays: byte for byte the document
    built from the lines written, a frame named ``video#frame``."""
    from tests.references import coco_document

    out, coco = tmp_path / "o.jsonl", tmp_path / "coco.json"
    predict_folder(detector, str(media), out, detector.params(), coco=coco)
    records = [{**r, "image": f"{r['image']}#{r['frame']}"} if "frame" in r else r for r in lines(out)]
    assert [r["image"] for r in records[:3]] == ["bus.jpg", "cams/clip.avi#0", "cams/clip.avi#1"]
    assert coco.read_text() == json.dumps(coco_document(records, detector.names)) + "\n"


def test_track_adds_ids_and_keeps_every_detection(detector, media, full_run, tmp_path):
    out = tmp_path / "track.jsonl"
    predict_folder(detector, str(media / "cams"), out, detector.params(), track=True)
    tracked = lines(out)
    plain = frame_lines(lines(full_run[0]))
    assert [[{k: v for k, v in d.items() if k != "track_id"} for d in r["detections"]] for r in tracked] == [
        r["detections"] for r in plain]
    ids = [d["track_id"] for r in tracked for d in r["detections"]]
    confirmed = [i for i in ids if i is not None]
    assert confirmed, "ByteTrack confirmed no track over 12 frames of moving people"
    assert len(confirmed) > len(set(confirmed))  # one person keeps one id across frames


def test_cli_predict_on_a_video_and_a_broken_one(media, tmp_path, artifacts_dir):
    src = tmp_path / "videos"
    src.mkdir()
    shutil.copy(media / "cams" / "clip.avi", src / "clip.avi")
    (src / "broken.mp4").write_bytes(b"\x00" * 4096)
    out = tmp_path / "cli.jsonl"
    proc = subprocess.run([*CLI, "predict", str(src), "--out", str(out), "--vid-stride", "4", "--batch", "4"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, proc.stderr  # the broken video is an error line; the clip still ran
    records = lines(out)
    assert [r["frame"] for r in records if r["image"] == "clip.avi"] == [0, 4, 8]
    assert next(r for r in records if r["image"] == "broken.mp4")["error"].startswith("cannot open video")
    assert "Traceback" not in proc.stderr


def with_max_pixels(detector, max_pixels: int):
    """The same pipeline under a run shape with this pixel limit (``RunShape.max_pixels``)."""
    return detector.reshaped(max_pixels=max_pixels)


def test_a_video_whose_frames_are_over_the_pixel_limit_is_refused_before_reading(detector, media):
    """Frame size is read from the container before any frame is decoded; a file (or a camera)
    of giant frames is one clear error, as an image over the limit is."""
    from app.predict.video import predict_video

    written = []
    limited = with_max_pixels(detector, 640 * 480 - 1)  # the clip's frames are 640x480
    summary = predict_video(limited, media / "cams" / "clip.avi", "clip.avi", written.append, detector.params())
    assert summary.frames == 0 and "has frames of 640x480 pixels, over the limit of 307,199" in summary.error
    assert written == [json.dumps({"image": "clip.avi", "error": summary.error})]
    ok = predict_video(with_max_pixels(detector, 640 * 480), media / "cams" / "clip.avi", "clip.avi", [].append,
                       detector.params(), vid_stride=8)
    assert ok.error is None and ok.frames > 0


def test_a_frame_over_the_limit_that_the_container_did_not_announce_ends_the_video_as_an_error(
        detector, media, monkeypatch):
    import app.predict.sources as sources
    from app.predict.video import predict_video

    monkeypatch.setattr(sources, "checked_size", lambda cap, *_: cap)  # as if the container gave no size
    written = []
    summary = predict_video(with_max_pixels(detector, 640 * 480 - 1), media / "cams" / "clip.avi", "clip.avi",
                            written.append, detector.params())
    assert summary.frames == 0 and "has frames of 640x480 pixels" in summary.error
    assert written == [json.dumps({"image": "clip.avi", "error": summary.error})]

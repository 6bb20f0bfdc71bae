"""Calibration inputs: folders (recursive) of photos and videos, the split, clear errors."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from app.builder.int8 import images as im
from app.errors import CalibrationError


def write_video(path: Path, frames: int = 30, size=(96, 64)) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, size)
    written = []
    for k in range(frames):
        frame = np.full((size[1], size[0], 3), (k * 8) % 256, np.uint8)
        frame[:8, :8] = rng.integers(0, 255, (8, 8, 3))
        writer.write(frame)
        written.append(frame)
    writer.release()
    return written


@pytest.fixture
def folder(tmp_path, assets_dir) -> Path:
    (tmp_path / "a" / "b").mkdir(parents=True)
    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    cv2.imwrite(str(tmp_path / "bus.jpg"), bus)
    cv2.imwrite(str(tmp_path / "a" / "b" / "bus.png"), bus[::2, ::2])
    cv2.imwrite(str(tmp_path / "a" / "bus.tif"), bus[:, ::-1])
    (tmp_path / "notes.txt").write_text("not an image")
    write_video(tmp_path / "a" / "clip.avi")
    return tmp_path


def test_folders_are_listed_recursively_with_video_frames(folder):
    items = im.list_items(folder, frames_per_video=5)
    photos = sorted(str(i.path.relative_to(folder)) for i in items if i.frame is None)
    assert photos == ["a/b/bus.png", "a/bus.tif", "bus.jpg"]
    frames = [i.frame for i in items if i.frame is not None]
    assert frames == [0, 7, 14, 21, 29]  # spread evenly over the 30 frames
    assert im.list_items(folder, frames_per_video=0) == [i for i in items if i.frame is None]


def test_a_video_frame_is_read_as_opencv_reads_it(folder):
    item = next(i for i in im.list_items(folder / "a" / "clip.avi", frames_per_video=3) if i.frame == 14)
    cap = cv2.VideoCapture(str(item.path))
    for _ in range(15):
        _, frame = cap.read()
    cap.release()
    np.testing.assert_array_equal(im.read_item(item), frame)
    assert item.relative_name(folder) == "a/clip.avi#frame14"


def test_split_is_disjoint_deterministic_and_holds_out_100_when_it_can():
    items = [im.CalibrationItem(Path(f"img{i:04d}.jpg")) for i in range(700)]
    calib, held = im.split_items(items, num_images=512)
    assert len(held) == 100 and len(calib) == 512 and not set(calib) & set(held)
    assert (calib, held) == im.split_items(items, num_images=512)
    # a small folder is shared: half held out, and never below the calibration minimum
    calib, held = im.split_items(items[:20], num_images=512)
    assert (len(calib), len(held)) == (10, 10)
    calib, held = im.split_items(items[:12], num_images=512, min_calibration=8)
    assert (len(calib), len(held)) == (8, 4)
    calib, held = im.split_items(items[:120], num_images=512)
    assert (len(calib), len(held)) == (60, 60)


def test_digest_follows_the_contents_not_the_place(folder, tmp_path_factory):
    items = [i for i in im.list_items(folder, frames_per_video=2)]
    other = tmp_path_factory.mktemp("copy")
    moved = []
    for item in items:
        target = other / item.path.name
        target.write_bytes(item.path.read_bytes())
        moved.append(im.CalibrationItem(target, item.frame))
    assert im.items_digest(items) == im.items_digest(moved)
    assert im.items_digest(items) != im.items_digest(items[:-1])


def test_missing_and_empty_folders_say_what_is_needed(tmp_path):
    with pytest.raises(CalibrationError, match="not found") as err:
        im.list_items(tmp_path / "nope")
    assert "164+" in str(err.value)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CalibrationError, match="no images or videos in"):
        im.list_items(tmp_path)


def test_unreadable_files_are_skipped_with_a_warning(tmp_path, assets_dir, caplog):
    good = tmp_path / "good.jpg"
    good.write_bytes((assets_dir / "bus.jpg").read_bytes())
    (tmp_path / "broken.jpg").write_bytes(good.read_bytes()[:200])
    (tmp_path / "fake.png").write_bytes(b"definitely not a png")
    assert [item.path.name for item in im.list_items(tmp_path)] == ["good.jpg"]  # counts are of readable images
    out = list(im.letterboxed(im.list_items(tmp_path), 320))
    assert [item.path.name for item, _, _ in out] == ["good.jpg"]
    assert out[0][1].shape == (320, 320, 3)
    assert "skipping" in caplog.text and "broken.jpg" in caplog.text

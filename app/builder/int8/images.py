"""The calibration and held-out images: photo folders (recursive) and video files (N frames each).

Items are loaded lazily, one at a time, and reduced to what the model sees (the letterboxed
``[S, S, 3]`` image and its placement): a folder of 4000×3000 photos never sits decoded in memory.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.errors import CalibrationError, YolopipeError
from app.imaging.decode import decode_image
from app.imaging.headers import IMAGE_SUFFIXES
from app.imaging.letterbox import letterbox
from app.types import Letterbox

# The same list as the CPU folder reader (app/predict/folder.py); both decode with OpenCV.
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg")
FRAMES_PER_VIDEO = 32
ADVISED_CALIBRATION = 64  # below this the ranges depend too much on the particular images
MIN_CALIBRATION = 8  # below this calibration is refused
HOLDOUT = 100  # held-out images for the report, when the folder has enough
MIN_REPORT_BOXES = 200  # FP32 boxes on the held-out images for an F1 to within ~±0.02
SPLIT_SEED = 0


@dataclass(frozen=True)
class CalibrationItem:
    """A photo (``frame`` None) or one frame of a video."""

    path: Path
    frame: int | None = None

    @property
    def name(self) -> str:
        return str(self.path) if self.frame is None else f"{self.path}#frame{self.frame}"

    def relative_name(self, root: Path) -> str:
        rel = self.path.relative_to(root) if self.path.is_relative_to(root) else self.path
        return str(rel) if self.frame is None else f"{rel}#frame{self.frame}"


def needed_images_hint(holdout: int = HOLDOUT) -> str:
    return (f"use photos (or videos) like the ones you will serve: {holdout} are held out for the accuracy "
            f"report and {ADVISED_CALIBRATION}+ calibrate ({holdout + ADVISED_CALIBRATION}+ in all, "
            f"{holdout + 512} for the default 512 calibration images)")


def video_frame_indices(path: Path, count: int) -> list[int]:
    """``count`` frame indices spread evenly over the video (all of them if it is shorter)."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            raise CalibrationError(f"cannot open video {path}")
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    finally:
        cap.release()
    if total <= 0:
        raise CalibrationError(f"video {path} has no frames OpenCV can count")
    return sorted({int(i) for i in np.linspace(0, total - 1, min(count, total))})


def list_items(source: Path, *, frames_per_video: int = FRAMES_PER_VIDEO, console=None) -> list[CalibrationItem]:
    """Photos and video frames under ``source`` (a folder, searched recursively, or one file)."""
    source = Path(source)
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file())
    else:
        raise CalibrationError(f"calibration image folder not found: {source}", hint=needed_images_hint())
    items: list[CalibrationItem] = []
    for path in files:
        suffix = path.suffix.lower()
        if suffix in IMAGE_SUFFIXES:
            try:  # decoded once here so that every count said about the folder is of readable images
                decode_image(path.read_bytes())
            except (OSError, YolopipeError) as exc:
                warn(console, f"skipping {path}: {exc}")
                continue
            items.append(CalibrationItem(path))
        elif suffix in VIDEO_SUFFIXES and frames_per_video > 0:
            try:
                items += [CalibrationItem(path, i) for i in video_frame_indices(path, frames_per_video)]
            except CalibrationError as exc:
                warn(console, f"skipping {path}: {exc}")
    if not items:
        raise CalibrationError(
            f"no images or videos in {source} (looked for {', '.join(sorted(IMAGE_SUFFIXES) + list(VIDEO_SUFFIXES))}, "
            "recursively)", hint=needed_images_hint())
    return items


def split_items(items: Sequence[CalibrationItem], *, num_images: int, holdout: int = HOLDOUT,
                min_calibration: int = MIN_CALIBRATION) -> tuple[list[CalibrationItem], list[CalibrationItem]]:
    """Deterministic shuffle → (calibration items, held-out items), disjoint.

    ``holdout`` items are held out when the folder has them besides ``ADVISED_CALIBRATION``
    calibration items; with fewer, the folder is shared: at most half held out, and never so
    many that fewer than ``min_calibration`` are left. Calibration takes up to ``num_images``.
    """
    order = np.random.default_rng(SPLIT_SEED).permutation(len(items))
    shuffled = [items[i] for i in order]
    n = len(shuffled)
    n_hold = min(holdout, max(n - ADVISED_CALIBRATION, n // 2), max(n - min_calibration, 0))
    heldout, rest = shuffled[:n_hold], shuffled[n_hold:]
    key = lambda item: (str(item.path), item.frame or 0)
    return sorted(rest[:num_images], key=key), sorted(heldout, key=key)


def warn(console, message: str) -> None:
    if console is not None:
        console.print(f"[yellow]warning:[/yellow] {message}")
    else:
        logging.getLogger(__name__).warning(message)


class _Frames:
    """One open video at a time, read forwards (grab to the next wanted frame: no seeking,
    which is slow and, in some containers, not frame-exact)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.cap = None
        self.position = 0

    def read(self, path: Path, index: int) -> np.ndarray:
        import cv2

        if path != self.path or index < self.position:
            self.close()
            self.cap, self.path, self.position = cv2.VideoCapture(str(path)), path, 0
        ok = True
        while ok and self.position < index:
            ok = self.cap.grab()
            self.position += 1
        ok, frame = self.cap.read() if ok else (False, None)
        self.position += 1
        if not ok or frame is None:
            raise CalibrationError(f"cannot read frame {index} of {path}")
        return frame

    def close(self) -> None:
        if self.cap is not None:
            self.cap.release()
        self.cap, self.path = None, None


def read_item(item: CalibrationItem, frames: _Frames | None = None) -> np.ndarray:
    """Decoded BGR pixels: photos through the serving decoder, frames as OpenCV reads them."""
    if item.frame is None:
        return decode_image(item.path.read_bytes())
    reader = frames or _Frames()
    try:
        return reader.read(item.path, item.frame)
    finally:
        if frames is None:
            reader.close()


def letterboxed(items: Sequence[CalibrationItem], imgsz: int, console=None,
                ) -> Iterator[tuple[CalibrationItem, np.ndarray, Letterbox]]:
    """``(item, letterboxed BGR image, placement)`` one at a time; unreadable items are skipped
    with a warning."""
    frames = _Frames()
    try:
        for item in items:
            try:
                img = read_item(item, frames)
            except (OSError, YolopipeError) as exc:
                warn(console, f"skipping {item.name}: {exc}")
                continue
            placed, lb = letterbox(img, imgsz)
            yield item, placed, lb
    finally:
        frames.close()


def items_digest(items: Sequence[CalibrationItem]) -> str:
    """sha256 over the items' bytes (and frame numbers) in order: same images, same digest."""
    digest = hashlib.sha256()
    file_hashes: dict[Path, bytes] = {}
    for item in items:
        if item.path not in file_hashes:
            file_hashes[item.path] = hashlib.sha256(item.path.read_bytes()).digest()
        digest.update(file_hashes[item.path])
        digest.update(b"" if item.frame is None else f"#{item.frame}".encode())
    return digest.hexdigest()

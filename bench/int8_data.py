"""The image sets the INT8 benchmarks calibrate and judge on, made from the shared data.

Calibration: every frame of ``video/dance.avi`` (as a video: the calibration reads frames itself)
plus photos and variations of them up to ``--calibration`` images. Held out: other photos
(never calibrated on, no video frames) and variations of them (mirror, crops, rescales,
colour and brightness changes, blur): another distribution than the calibration set.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np

ASSETS = Path(__import__("ultralytics").__file__).parent / "assets"


def variations(img: np.ndarray, rng: np.random.Generator, count: int) -> list[np.ndarray]:
    """``count`` variations of one photo: the first 8 fixed kinds, then random mixes of them."""
    h, w = img.shape[:2]
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    warm = hsv.copy()
    warm[..., 0] = (warm[..., 0].astype(int) + 8) % 180
    warm[..., 1] = np.clip(warm[..., 1] * 1.3, 0, 255)
    fixed = [
        img[:, ::-1],
        img[h // 8 : h - h // 8, w // 8 : w - w // 8],
        img[: int(h * 0.7), int(w * 0.25) :],
        cv2.resize(img, (w // 2, h // 2), interpolation=cv2.INTER_AREA),
        cv2.resize(img, (int(w * 1.6), int(h * 1.6)), interpolation=cv2.INTER_LINEAR),
        cv2.convertScaleAbs(img, alpha=0.6, beta=5),
        cv2.cvtColor(warm, cv2.COLOR_HSV2BGR),
        cv2.GaussianBlur(cv2.convertScaleAbs(img, alpha=1.25, beta=15), (5, 5), 0),
    ]
    out = [np.ascontiguousarray(v) for v in fixed[:count]]
    while len(out) < count:
        v = img[:, ::-1] if rng.random() < 0.5 else img
        y0, x0 = int(rng.uniform(0, 0.25) * h), int(rng.uniform(0, 0.25) * w)
        v = v[y0 : y0 + int(h * rng.uniform(0.6, 0.75)), x0 : x0 + int(w * rng.uniform(0.6, 0.75))]
        v = cv2.convertScaleAbs(v, alpha=rng.uniform(0.6, 1.3), beta=rng.uniform(-20, 20))
        scale = rng.uniform(0.5, 1.5)
        out.append(cv2.resize(v, (max(32, int(v.shape[1] * scale)), max(32, int(v.shape[0] * scale)))))
    return out


def make_sets(data: Path, out: Path, *, heldout_photos: int = 12, heldout_variations: int = 8,
              calibration: int = 512) -> tuple[Path, Path, list[str]]:
    """Write ``out/calibration`` and ``out/heldout``; returns them and the held-out photo names."""
    photos = sorted((data / "images").glob("*.jpg")) + sorted(ASSETS.glob("*.jpg"))
    order = [photos[i] for i in np.random.default_rng(0).permutation(len(photos))]
    held, calib = sorted(order[:heldout_photos]), sorted(order[heldout_photos:])
    calib_dir, held_dir = out / "calibration", out / "heldout"
    for d in (calib_dir, held_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for path in held:
        img = cv2.imread(str(path))
        cv2.imwrite(str(held_dir / path.name), img)
        for k, v in enumerate(variations(img, rng, heldout_variations)):
            cv2.imwrite(str(held_dir / f"{path.stem}_v{k}.jpg"), v)
    video = data / "video" / "dance.avi"
    (calib_dir / "video").mkdir()
    shutil.copyfile(video, calib_dir / "video" / video.name)
    cap = cv2.VideoCapture(str(video))
    frames = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    cap.release()
    per_photo = max(0, -(-(calibration - frames) // len(calib)) - 1)  # ceil: at least `calibration` in all
    for path in calib:
        img = cv2.imread(str(path))
        cv2.imwrite(str(calib_dir / path.name), img)
        for k, v in enumerate(variations(img, rng, per_photo)):
            cv2.imwrite(str(calib_dir / f"{path.stem}_v{k}.jpg"), v)
    return calib_dir, held_dir, [p.name for p in held]

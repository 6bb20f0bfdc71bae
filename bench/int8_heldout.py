"""The INT8 comparison's image sets (issue #20), the same files every run, from a data folder
(``images/``, ``video/dance.avi``, ``video/dance-1080p30.mp4``) and photos shipped in packages:
calibration, the 20 photos and every 3rd frame of ``dance.avi`` (84); held out, the 1080p clip
after the 4.1 s ``dance.avi`` covers (12 frames each whole, zoomed and degraded), Ultralytics',
Matplotlib's and scikit-image's photos (its wheel's when it is not installed), each whole and in
8 variants (108)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import cv2
import numpy as np

SKIMAGE_VERSION = "0.26.0"
SKIMAGE_PHOTOS = ("astronaut.png", "camera.png", "coffee.png", "chelsea.png", "motorcycle_left.png")
AVI_FRAMES = 205  # dance.avi: 4.1 s at 50 fps; the 1080p clip's frames 130+ come after that


def _package_file(module: str, rel: str) -> Path | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    path = Path(mod.__file__).parent / rel
    return path if path.is_file() else None


def skimage_photos(cache: Path) -> list[Path]:
    """scikit-image's sample photos: from ``cache/skimage`` (filled from the wheel once, or carried
    to a machine without an index), else from the installed package, else from the wheel."""
    out = cache / "skimage"
    if all((out / name).is_file() for name in SKIMAGE_PHOTOS):
        return [out / name for name in SKIMAGE_PHOTOS]
    found = [_package_file("skimage", f"data/{name}") for name in SKIMAGE_PHOTOS]
    if all(found):
        return found
    if not all((out / name).is_file() for name in SKIMAGE_PHOTOS):
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
                        f"scikit-image=={SKIMAGE_VERSION}"], check=True)
        wheel = next(cache.glob(f"scikit_image-{SKIMAGE_VERSION}-*.whl"))
        out.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel) as zf:
            for name in SKIMAGE_PHOTOS:
                (out / name).write_bytes(zf.read(f"skimage/data/{name}"))
    return [out / name for name in SKIMAGE_PHOTOS]


def jpeg(img: np.ndarray, quality: int) -> np.ndarray:
    return cv2.imdecode(cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])[1], cv2.IMREAD_COLOR)


def gray(img: np.ndarray) -> np.ndarray:
    return cv2.cvtColor(cv2.cvtColor(img, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)


def degraded(img: np.ndarray, k: int) -> np.ndarray:
    h, w = img.shape[:2]
    kinds = [
        lambda: gray(img),
        lambda: jpeg(img, 25),
        lambda: cv2.convertScaleAbs(img, alpha=0.45, beta=0),
        lambda: cv2.convertScaleAbs(img, alpha=1.35, beta=25),
        lambda: cv2.GaussianBlur(img, (7, 7), 0),
        lambda: cv2.warpAffine(img, cv2.getRotationMatrix2D((w / 2, h / 2), 8, 1.1), (w, h),
                               borderMode=cv2.BORDER_REFLECT),
    ]
    return kinds[k % len(kinds)]()


def photo_variants(img: np.ndarray) -> list[np.ndarray]:
    h, w = img.shape[:2]
    return [
        img[:, ::-1],
        img[h // 6 : h - h // 8, w // 8 : w - w // 6],
        cv2.resize(img, (w // 2, h // 2), interpolation=cv2.INTER_AREA),
        cv2.resize(img, (int(w * 1.6), int(h * 1.6)), interpolation=cv2.INTER_CUBIC),
        jpeg(img, 25),
        gray(img),
        cv2.convertScaleAbs(img, alpha=0.5, beta=0),
        cv2.convertScaleAbs(img, alpha=1.3, beta=30),
    ]


def read_frames(path: Path, indices: list[int]) -> dict[int, np.ndarray]:
    cap, out, pos = cv2.VideoCapture(str(path)), {}, 0
    wanted = set(indices)
    while pos <= max(indices):
        ok, frame = cap.read()
        if not ok:
            break
        if pos in wanted:
            out[pos] = frame
        pos += 1
    cap.release()
    return out


def make_calibration(data: Path, out: Path) -> Path:
    """The issue's 84 images: the 20 photos and every 3rd frame of dance.avi (64 frames)."""
    out.mkdir(parents=True, exist_ok=True)
    for photo in sorted((data / "images").glob("*.jpg")):
        (out / photo.name).write_bytes(photo.read_bytes())
    for index, frame in read_frames(data / "video" / "dance.avi", list(range(0, 192, 3))).items():
        cv2.imwrite(str(out / f"dance_{index:03d}.png"), frame)
    return out


def make_heldout(data: Path, out: Path, cache: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    indices = [int(i) for i in np.linspace(AVI_FRAMES * 30 // 50 + 8, 299, 36)]  # 130..299
    frames = read_frames(data / "video" / "dance-1080p30.mp4", indices)
    for k, index in enumerate(indices):
        frame = frames[index]
        h, w = frame.shape[:2]
        if k % 3 == 0:
            img = frame
        elif k % 3 == 1:  # the crowd band zoomed: people at about twice the scale, another framing
            x0 = (k * 131) % (w // 2)
            img = frame[h // 8 : h // 8 + h // 2, x0 : x0 + w // 2]
        else:
            img = degraded(frame, k // 3)
        cv2.imwrite(str(out / f"clip1080_{index:03d}_{'fcd'[k % 3]}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 92])
    assets = Path(__import__("ultralytics").__file__).parent / "assets"
    photos = [assets / "bus.jpg", assets / "zidane.jpg",
              Path(__import__("matplotlib").__file__).parent / "mpl-data/sample_data/grace_hopper.jpg",
              *skimage_photos(cache)]
    for photo in photos:
        img = cv2.imread(str(photo), cv2.IMREAD_COLOR)
        cv2.imwrite(str(out / f"{photo.stem}.png"), img)
        for k, variant in enumerate(photo_variants(img)):
            cv2.imwrite(str(out / f"{photo.stem}_v{k}.png"), np.ascontiguousarray(variant))
    return out


"""Test clips made here from Ultralytics' bus.jpg and zidane.jpg (no shared data needed):
a window panning over each photo, so frames differ and objects move between them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import cv2
import numpy as np

CLIP_SIZE = (640, 480)  # width, height
CLIP_FPS = 10.0


def clip_frames(assets_dir: Path, count: int = 12, size: tuple[int, int] = CLIP_SIZE) -> list[np.ndarray]:
    """``count`` BGR frames of ``size`` (width, height): the first half pans over zidane.jpg, the
    second over bus.jpg."""
    photos = [cv2.imread(str(assets_dir / "zidane.jpg")), cv2.imread(str(assets_dir / "bus.jpg"))]
    w, h = size
    frames = []
    for k in range(count):
        photo = photos[0] if k < count / 2 else photos[1]
        ph, pw = photo.shape[:2]
        crop_w, crop_h = int(pw * 0.8), int(ph * 0.8)
        step = k % max(count // 2, 1)
        x = int((pw - crop_w) * step / max(count // 2 - 1, 1))
        y = int((ph - crop_h) * step / max(count // 2 - 1, 1))
        frames.append(cv2.resize(photo[y : y + crop_h, x : x + crop_w], (w, h), interpolation=cv2.INTER_AREA))
    return frames


def write_clip(path: Path, assets_dir: Path, count: int = 12) -> Path:
    """An MJPG .avi written by OpenCV (its FFmpeg has that encoder on every platform)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), CLIP_FPS, CLIP_SIZE)
    assert writer.isOpened(), f"OpenCV cannot write {path}"
    for frame in clip_frames(assets_dir, count):
        writer.write(frame)
    writer.release()
    return path


def decoded_frames(path: Path) -> list[np.ndarray]:
    """Every frame of ``path`` as OpenCV decodes it: the reference the video path is held to."""
    cap = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame)
    cap.release()
    return frames


def ffmpeg() -> str | None:
    return shutil.which("ffmpeg")


def write_h264(path: Path, source: Path) -> Path:
    """``source`` re-encoded as H.264 in MP4 by Debian's ffmpeg (what RTSP carries with ``-c copy``)."""
    subprocess.run(
        [ffmpeg() or "ffmpeg", "-v", "error", "-y", "-i", str(source), "-c:v", "libx264", "-preset", "ultrafast",
         "-g", "5", "-pix_fmt", "yuv420p", str(path)],
        check=True, timeout=120,
    )
    return path


def write_tagged_h264(path: Path, frames: list[np.ndarray], *, colorspace: str | None = None, full_range: bool = False,
                      profile: str = "high", fps: float = CLIP_FPS) -> Path:
    """``frames`` (BGR, one size) as H.264 by Debian's ffmpeg, with the colour matrix ``colorspace``
    (an ffmpeg name: bt709, smpte170m, bt2020nc...; None: untagged) and range in the stream."""
    h, w = frames[0].shape[:2]
    tags = f"setparams=colorspace={colorspace or 'unknown'}:range={'pc' if full_range else 'tv'}"
    scale = f"scale=out_color_matrix={colorspace or 'bt601'}:out_range={'pc' if full_range else 'tv'}"
    subprocess.run(
        [ffmpeg() or "ffmpeg", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "bgr24", "-s", f"{w}x{h}",
         "-r", str(fps), "-i", "-", "-vf", f"{scale},{tags}", "-c:v", "libx264", "-profile:v", profile,
         "-preset", "ultrafast", "-g", "4", "-pix_fmt", "yuv420p", str(path)],
        input=b"".join(np.ascontiguousarray(f).tobytes() for f in frames), check=True, timeout=120,
    )
    return path


def yuv_frames(path: Path) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int, bool]]:
    """FFmpeg's own decode of ``path`` (PyAV): per frame its Y, U and V planes, its AVColorSpace
    code and whether it is full range: the bytes NVDEC decodes to, H.264 decoding being exact."""
    import av

    out = []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            y, u, v = (np.frombuffer(p, np.uint8).reshape(-1, p.line_size)[: p.height, : p.width].copy()
                       for p in frame.planes)
            full = frame.color_range == 2 or frame.format.name.startswith("yuvj")
            out.append((y, u, v, int(frame.colorspace), full))
    return out

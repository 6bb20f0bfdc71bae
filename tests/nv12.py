"""NV12 test frames made from BGR ones, laid out as a decoder hands them over (rows padded to a
pitch, the UV plane after the coded picture's rows), and OpenCV's decode-time conversion
(swscale's, ``app.imaging.yuv``) + letterbox of them: the reference the NV12 kernel and the
pipeline's NV12 input are held to."""

from __future__ import annotations

import cv2
import numpy as np

from app.imaging.letterbox import letterbox, to_input
from app.imaging.yuv import YuvConstants, nv12_to_bgr, swscale_constants


def to_nv12(bgr: np.ndarray) -> np.ndarray:
    """BGR (even sizes) → NV12 ``[H * 3 / 2, W]``: OpenCV's I420, with U and V interleaved."""
    h, w = bgr.shape[:2]
    i420 = cv2.cvtColor(bgr, cv2.COLOR_BGR2YUV_I420).reshape(-1)
    y, u, v = i420[: h * w], i420[h * w : h * w * 5 // 4], i420[h * w * 5 // 4 :]
    uv = np.empty(h * w // 2, np.uint8)
    uv[0::2], uv[1::2] = u, v
    return np.concatenate([y, uv]).reshape(h * 3 // 2, w)


def with_pitch(nv12: np.ndarray, pitch: int, fill: int = 201) -> np.ndarray:
    """Rows padded to ``pitch`` bytes with junk, as decoder surfaces are."""
    rows, w = nv12.shape
    out = np.full((rows, pitch), fill, np.uint8)
    out[:, :w] = nv12
    return out


class Surface:
    """One decoded picture as a decoder hands it over: NV12 rows of ``pitch`` bytes holding an
    even-sized coded picture, of which the top-left ``height × width`` is shown."""

    def __init__(self, bgr: np.ndarray, height: int, width: int, pitch: int, size: int = 32,
                 colour: YuvConstants | None = None) -> None:
        self.coded = to_nv12(bgr)  # bgr has even sizes >= (height, width)
        self.height, self.width, self.pitch = height, width, pitch
        self.bytes = with_pitch(self.coded, pitch).reshape(-1)
        self.luma_rows = self.coded.shape[0] * 2 // 3
        self.size = size  # the model input the reference is letterboxed to
        self.colour = colour or swscale_constants()  # untagged: BT.601, limited range

    def reference(self) -> np.ndarray:
        """OpenCV's decode of it: what is shown converted as swscale does, then letterboxed."""
        bgr = nv12_to_bgr(self.coded, self.height, self.width, self.colour)
        return to_input([letterbox(bgr, self.size)[0]])[0]


def surface(frame: np.ndarray, height: int, width: int, pitch: int | None = None, size: int = 32,
            colour: YuvConstants | None = None) -> Surface:
    """``frame`` shrunk to a coded picture of even sizes, of which ``height × width`` is shown."""
    coded = cv2.resize(frame, (width + width % 2, height + height % 2), interpolation=cv2.INTER_AREA)
    return Surface(coded, height, width, pitch or width + width % 2, size, colour)

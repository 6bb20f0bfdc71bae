"""Letterbox and model input on the CPU, equal to what Ultralytics does before its model.

These functions are also the reference that the GPU letterbox kernel is tested against, and
``letterbox_params``/``PAD_VALUE`` are the placement both share.
"""

from __future__ import annotations

import cv2
import numpy as np

from app.types import Letterbox

PAD_VALUE = 114


def letterbox_params(src_h: int, src_w: int, size: int) -> Letterbox:
    """Placement of a ``src_h × src_w`` image in a ``size × size`` square, as Ultralytics' ``LetterBox``."""
    r = min(size / src_h, size / src_w)
    new_w, new_h = max(round(src_w * r), 1), max(round(src_h * r), 1)
    dw, dh = (size - new_w) / 2, (size - new_h) / 2
    # Ultralytics rounds (pad - 0.1) on the top/left side; the rest goes to bottom/right.
    return Letterbox(src_h, src_w, new_h, new_w, pad_top=round(dh - 0.1), pad_left=round(dw - 0.1), size=size)


def letterbox(img: np.ndarray, size: int) -> tuple[np.ndarray, Letterbox]:
    """Resize (bilinear, OpenCV) and pad with 114 into a ``size × size`` BGR uint8 image."""
    lb = letterbox_params(img.shape[0], img.shape[1], size)
    if (img.shape[1], img.shape[0]) != (lb.new_w, lb.new_h):
        img = cv2.resize(img, (lb.new_w, lb.new_h), interpolation=cv2.INTER_LINEAR)
    bottom = size - lb.new_h - lb.pad_top
    right = size - lb.new_w - lb.pad_left
    out = cv2.copyMakeBorder(
        img, lb.pad_top, bottom, lb.pad_left, right, cv2.BORDER_CONSTANT, value=(PAD_VALUE,) * 3
    )
    return out, lb


def to_input(letterboxed: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """BGR uint8 HWC images → RGB float32 NCHW in [0, 1] (the ONNX model's input)."""
    batch = np.stack(letterboxed)[..., ::-1].transpose(0, 3, 1, 2)
    if out is None:
        out = np.empty(batch.shape, np.float32)
    # Divide (not multiply by 1/255): bit-equal to Ultralytics' ``im /= 255`` in float32.
    np.divide(batch, np.float32(255), out=out, casting="unsafe")
    return out

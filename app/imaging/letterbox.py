"""Letterbox and model input on the CPU, equal to what Ultralytics does before its model.

Two placements, both Ultralytics' ``LetterBox``: the ``imgsz`` square (``auto=False``: its
exported engines, ``model.predict(source, rect=False)``) and rect (``auto=True`` with the
model's stride: what ``model.predict(source)`` does on a ``.pt`` with its defaults), which pads
the resized image only up to the next multiple of the stride, so a 640×480 photo runs at
640×480 (``input_size``).

These functions are also the reference that the GPU letterbox kernel is tested against, and
``letterbox_params``/``PAD_VALUE`` are the placement both share.
"""

from __future__ import annotations

import cv2
import numpy as np

from app.types import Letterbox

PAD_VALUE = 114


def letterbox_params(src_h: int, src_w: int, size: int, stride: int = 0) -> Letterbox:
    """Placement of a ``src_h × src_w`` image as Ultralytics' ``LetterBox(size, auto=stride > 0,
    stride=stride)`` places it: scaled so its long side is ``size`` (up or down), then padded to
    the ``size × size`` square (``stride`` 0) or only to the next multiple of ``stride`` (rect)."""
    r = min(size / src_h, size / src_w)
    new_w, new_h = max(round(src_w * r), 1), max(round(src_h * r), 1)
    dw, dh = size - new_w, size - new_h
    if stride:
        dw, dh = dw % stride, dh % stride
    # Ultralytics halves the padding and rounds (half - 0.1) on the top/left side; the rest goes
    # to bottom/right.
    return Letterbox(src_h, src_w, new_h, new_w, pad_top=round(dh / 2 - 0.1), pad_left=round(dw / 2 - 0.1),
                     input_h=new_h + dh, input_w=new_w + dw)


def input_size(src_h: int, src_w: int, size: int, stride: int = 0) -> tuple[int, int]:
    """The model input's ``(height, width)`` for a ``src_h × src_w`` image (``letterbox_params``)."""
    lb = letterbox_params(src_h, src_w, size, stride)
    return lb.input_h, lb.input_w


def letterbox(img: np.ndarray, size: int, stride: int = 0) -> tuple[np.ndarray, Letterbox]:
    """Resize (bilinear, OpenCV) and pad with 114 into the input ``letterbox_params`` places it
    in (``stride`` 0: the ``size × size`` square); a BGR uint8 image."""
    lb = letterbox_params(img.shape[0], img.shape[1], size, stride)
    if (img.shape[1], img.shape[0]) != (lb.new_w, lb.new_h):
        img = cv2.resize(img, (lb.new_w, lb.new_h), interpolation=cv2.INTER_LINEAR)
    bottom = lb.input_h - lb.new_h - lb.pad_top
    right = lb.input_w - lb.new_w - lb.pad_left
    out = cv2.copyMakeBorder(
        img, lb.pad_top, bottom, lb.pad_left, right, cv2.BORDER_CONSTANT, value=(PAD_VALUE,) * 3
    )
    return out, lb


def to_input(letterboxed: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """BGR uint8 HWC images of one size → RGB float32 NCHW in [0, 1] (the ONNX model's input)."""
    batch = np.stack(letterboxed)[..., ::-1].transpose(0, 3, 1, 2)
    if out is None:
        out = np.empty(batch.shape, np.float32)
    # Divide (not multiply by 1/255): bit-equal to Ultralytics' ``im /= 255`` in float32.
    np.divide(batch, np.float32(255), out=out, casting="unsafe")
    return out

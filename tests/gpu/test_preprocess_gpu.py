"""The letterbox kernel at full size on the device, every staging layout, against the CPU
reference (the simulator runs it only at toy sizes: tests/kernels)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from numba import cuda

from app.gpu.preprocess import (
    LAYOUT_CHW_RGB,
    LAYOUT_HWC_BGR,
    LAYOUT_HWC_RGB,
    PARAMS_PER_IMAGE,
    fill_params,
    launch_letterbox,
    letterbox_placement,
)
from app.imaging.letterbox import letterbox, to_input

pytestmark = pytest.mark.requires_gpu


def _as_layout(img: np.ndarray, layout: int) -> np.ndarray:
    if layout == LAYOUT_HWC_BGR:
        return img
    if layout == LAYOUT_HWC_RGB:
        return np.ascontiguousarray(img[..., ::-1])
    return np.ascontiguousarray(img[..., ::-1].transpose(2, 0, 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_letterbox_kernel_full_size_on_device(dtype, assets_dir):
    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    zidane = cv2.imread(str(assets_dir / "zidane.jpg"))
    images = [bus, zidane, cv2.resize(zidane, (301, 171)), bus[:640, :640].copy(), cv2.resize(bus, (1919, 2001)),
              cv2.resize(zidane, (1920, 1080))]
    size = 640
    chunks, rows, offset = [], [], 0
    layouts = [LAYOUT_HWC_BGR, LAYOUT_CHW_RGB, LAYOUT_HWC_RGB] * 2
    for img, layout in zip(images, layouts):
        data = _as_layout(img, layout)
        row = np.zeros(PARAMS_PER_IMAGE, np.int64)
        fill_params(row, letterbox_placement(*img.shape[:2], size), offset, layout)
        rows.append(row)
        chunks.append(data.reshape(-1))
        offset += data.size
    out = cuda.device_array((len(images), 3, size, size), dtype)
    launch_letterbox(cuda.to_device(np.concatenate(chunks)), cuda.to_device(np.stack(rows)), out, len(images))
    got = out.copy_to_host()
    for i, img in enumerate(images):
        ref = to_input([letterbox(img, size)[0]])[0].astype(dtype).astype(np.float32)
        diff = np.abs(got[i].astype(np.float32) - ref)
        exact = float((diff == 0).mean())
        print(f"image {i} {img.shape} layout {layouts[i]}: max {diff.max() * 255:.3f} levels, {exact:.6f} exact")
        assert diff.max() <= 1 / 255 + (1e-3 if dtype == np.float16 else 1e-7)

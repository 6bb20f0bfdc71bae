"""The NV12 letterbox kernel against OpenCV: ``cvtColor(COLOR_YUV2BGR_NV12)`` then the CPU
letterbox and ``to_input``. Tiny sizes: in the simulator every CUDA thread is a Python thread."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from app.imaging.letterbox import PAD_VALUE, letterbox, letterbox_params, to_input

cuda = pytest.importorskip("numba.cuda")
from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox

ONE_LEVEL = 1.0 / 255.0
SIZE = 32


def bgr_frame(rng, h, w):
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 9 + yy * 2) % 256, (yy * 13) % 256, (xx * 6 + 30) % 256], axis=-1)
    return np.clip(base + rng.integers(-25, 26, (h, w, 3)), 0, 255).astype(np.uint8)


def to_nv12(bgr):
    """BGR → NV12 ``[H * 3 / 2, W]``: OpenCV's I420, with U and V interleaved."""
    h, w = bgr.shape[:2]
    i420 = cv2.cvtColor(bgr, cv2.COLOR_BGR2YUV_I420).reshape(-1)
    y, u, v = i420[: h * w], i420[h * w : h * w * 5 // 4], i420[h * w * 5 // 4 :]
    uv = np.empty(h * w // 2, np.uint8)
    uv[0::2], uv[1::2] = u, v
    return np.concatenate([y, uv]).reshape(h * 3 // 2, w)


def with_pitch(nv12, pitch, fill=201):
    """Rows padded to ``pitch`` bytes with junk, as NVDEC surfaces are."""
    rows, w = nv12.shape
    out = np.full((rows, pitch), fill, np.uint8)
    out[:, :w] = nv12
    return out


def reference(nv12):
    bgr = cv2.cvtColor(nv12, cv2.COLOR_YUV2BGR_NV12)
    return to_input([letterbox(bgr, SIZE)[0]])[0]


def run(frames_with_pitch):
    """Pack (nv12 [rows, pitch], width) frames into one staging buffer; one launch; a trailing empty slot."""
    chunks, params, offset = [np.full(5, 9, np.uint8)], [], 5  # a misaligned start: never read
    for nv12, width in frames_with_pitch:
        rows, pitch = nv12.shape
        row = np.zeros(NV12_PARAMS, np.int64)
        fill_nv12_params(row, letterbox_params(rows * 2 // 3, width, SIZE), offset, pitch)
        params.append(row)
        chunks.append(nv12.reshape(-1))
        offset += nv12.size
    empty = np.zeros(NV12_PARAMS, np.int64)
    fill_nv12_params(empty, None, 0, 0)
    params.append(empty)
    staging = cuda.to_device(np.concatenate(chunks))
    d_params = cuda.to_device(np.stack(params))
    out = cuda.device_array((len(params), 3, SIZE, SIZE), np.float32)
    launch_nv12_letterbox(staging, d_params, out, len(params))
    return out.copy_to_host()


def test_equals_opencv_conversion_then_letterbox_within_one_level():
    rng = np.random.default_rng(0)
    upscale, downscale, portrait = bgr_frame(rng, 20, 30), bgr_frame(rng, 48, 40), bgr_frame(rng, 24, 12)
    frames = [(to_nv12(upscale), 30), (to_nv12(downscale), 40), (with_pitch(to_nv12(portrait), 16), 12)]
    got = run(frames)
    for k, (nv12, width) in enumerate(frames):
        ref = reference(np.ascontiguousarray(nv12[:, :width]))
        diff = np.abs(got[k] - ref)
        assert diff.max() <= ONE_LEVEL + 1e-6, (k, diff.max() * 255)
        assert (diff > 1e-6).mean() < 0.05, k  # nearly every pixel bit-equal
    assert np.all(got[-1] == np.float32(PAD_VALUE) / np.float32(255))  # the empty slot is padding


def test_chroma_reaches_the_right_channels():
    """A saturated red frame comes out red in RGB order (channel 0), not blue."""
    red = np.zeros((16, 16, 3), np.uint8)
    red[..., 2] = 255
    got = run([(to_nv12(red), 16)])[0]
    ref = reference(to_nv12(red))
    assert got[0, SIZE // 2, SIZE // 2] > 0.9 and got[2, SIZE // 2, SIZE // 2] < 0.1
    np.testing.assert_allclose(got, ref, atol=ONE_LEVEL + 1e-6)

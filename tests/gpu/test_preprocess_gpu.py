"""GPU preprocessing: the letterbox kernel at full size on the device, nvJPEG decode, EXIF.

The EXIF tests at the top run on any machine (CPU tensors); the rest skip without a CUDA GPU.
"""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

from app.errors import InvalidImage, UnsupportedMediaType
from app.imaging.letterbox import letterbox, to_input

torch = pytest.importorskip("torch")
from app.gpu.preprocess import apply_orientation, exif_orientation

HAS_CUDA = torch.cuda.is_available() and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (and not the Numba simulator)")


def with_exif_orientation(jpeg: bytes, orientation: int) -> bytes:
    """Insert an APP1 EXIF segment holding only the orientation tag right after SOI."""
    tiff = b"II*\x00" + (8).to_bytes(4, "little") + (1).to_bytes(2, "little")
    tiff += (0x0112).to_bytes(2, "little") + (3).to_bytes(2, "little") + (1).to_bytes(4, "little")
    tiff += orientation.to_bytes(2, "little") + b"\x00\x00" + (0).to_bytes(4, "little")
    payload = b"Exif\x00\x00" + tiff
    app1 = b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload
    return jpeg[:2] + app1 + jpeg[2:]


@pytest.fixture(scope="module")
def asymmetric_jpeg() -> bytes:
    """A small image whose every orientation looks different (gradients + a corner mark)."""
    yy, xx = np.mgrid[0:48, 0:80]
    img = np.stack([xx * 3, yy * 5, (xx + yy) * 2], axis=-1).astype(np.uint8)
    img[:10, :16] = (0, 0, 255)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 98])
    assert ok
    return buf.tobytes()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_opencv(asymmetric_jpeg, orientation):
    """Our EXIF reading + turning of an un-oriented decode equals cv2.imdecode (which applies EXIF)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    data = with_exif_orientation(asymmetric_jpeg, orientation)
    assert exif_orientation(data) == orientation
    raw = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    ours = apply_orientation(raw, orientation).permute(1, 2, 0).numpy()[..., ::-1]
    ref = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert ours.shape == ref.shape, f"orientation {orientation}: {ours.shape} vs {ref.shape}"
    diff = np.abs(ours.astype(int) - ref.astype(int))
    assert diff.mean() < 1.5, f"orientation {orientation}: mean |diff| {diff.mean():.2f} levels"


def test_exif_orientation_absent_is_1(asymmetric_jpeg):
    assert exif_orientation(asymmetric_jpeg) == 1
    assert exif_orientation(b"\xff\xd8\xff\xe1\x00") == 1  # truncated header: no crash


# ----------------------------------------------------------------------------- on the GPU
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_letterbox_kernel_full_size_on_device(dtype, assets_dir):
    from numba import cuda

    from app.gpu.preprocess import (
        LAYOUT_CHW_RGB,
        LAYOUT_HWC_BGR,
        PARAMS_PER_IMAGE,
        fill_params,
        launch_letterbox,
        letterbox_placement,
    )

    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    zidane = cv2.imread(str(assets_dir / "zidane.jpg"))
    images = [bus, zidane, cv2.resize(zidane, (301, 171)), bus[:640, :640].copy(), cv2.resize(bus, (1919, 2001))]
    size = 640
    chunks, rows, offset = [], [], 0
    layouts = [LAYOUT_HWC_BGR, LAYOUT_CHW_RGB] * 3
    for img, layout in zip(images, layouts):
        data = img if layout == LAYOUT_HWC_BGR else np.ascontiguousarray(img[..., ::-1].transpose(2, 0, 1))
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


@needs_cuda
def test_nvjpeg_decode_close_to_opencv(assets_dir):
    from app.gpu.preprocess import decode_jpegs

    datas = [(assets_dir / n).read_bytes() for n in ("bus.jpg", "zidane.jpg")]
    decoded = decode_jpegs(datas)
    for data, t in zip(datas, decoded):
        assert isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == torch.uint8 and t.shape[0] == 3
        ours = t.permute(1, 2, 0).cpu().numpy()[..., ::-1]
        ref = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert ours.shape == ref.shape
        diff = np.abs(ours.astype(int) - ref.astype(int))
        print(f"nvJPEG vs OpenCV: mean {diff.mean():.3f}, p99 {np.percentile(diff, 99)}, max {diff.max()} levels")
        assert diff.mean() < 1.5 and np.percentile(diff, 99) <= 8


@needs_cuda
def test_nvjpeg_decode_applies_exif(asymmetric_jpeg):
    from app.gpu.preprocess import decode_jpegs

    datas = [with_exif_orientation(asymmetric_jpeg, o) for o in range(1, 9)]
    for o, (data, t) in enumerate(zip(datas, decode_jpegs(datas)), start=1):
        ref = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        ours = t.permute(1, 2, 0).cpu().numpy()[..., ::-1]
        assert ours.shape == ref.shape, f"orientation {o}"
        assert np.abs(ours.astype(int) - ref.astype(int)).mean() < 2.0, f"orientation {o}"


@needs_cuda
def test_bad_images_fail_alone(assets_dir):
    from app.gpu.preprocess import decode_jpegs

    good = (assets_dir / "bus.jpg").read_bytes()
    _, png = cv2.imencode(".png", np.full((20, 30, 3), 99, np.uint8))
    datas = [good, good[: len(good) // 3], b"\xff\xd8\xff\xe0 not really a jpeg", png.tobytes(), b"hello", b""]
    out = decode_jpegs(datas)
    assert isinstance(out[0], torch.Tensor) and out[0].is_cuda
    # A truncated JPEG may decode partially on either decoder; it must not take the batch down.
    assert isinstance(out[1], (torch.Tensor, np.ndarray, InvalidImage))
    assert isinstance(out[2], InvalidImage)
    assert isinstance(out[3], np.ndarray) and out[3].shape == (20, 30, 3)  # PNG: CPU decode
    assert isinstance(out[4], UnsupportedMediaType)
    assert isinstance(out[5], InvalidImage)

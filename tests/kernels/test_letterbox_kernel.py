"""The fused letterbox kernel against the CPU reference (``letterbox`` + ``to_input``).

Runs in Numba's CUDA simulator (tests/conftest.py) unless YOLOPIPE_REAL_GPU=1, so the
sizes are tiny: every CUDA thread is a Python thread there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from app.imaging.letterbox import letterbox, to_input

cuda = pytest.importorskip("numba.cuda")
from app.gpu.preprocess import (
    LAYOUT_CHW_RGB,
    LAYOUT_HWC_BGR,
    LAYOUT_HWC_RGB,
    PARAMS_PER_IMAGE,
    fill_params,
    launch_letterbox,
    letterbox_placement,
)

ONE_LEVEL = 1.0 / 255.0


def _image(rng, h, w):
    """Smooth gradients plus noise: exercises both the interpolation and the rounding."""
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 7 + yy * 3) % 256, (yy * 11) % 256, (xx * 5 + 40) % 256], axis=-1)
    noise = rng.integers(-30, 31, (h, w, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def _run_kernel(images, layouts, size, dtype, *, extra_empty_slots=0, misalign=0):
    """Pack ``images`` (BGR HWC) into one staging buffer in the given layouts and launch once."""
    chunks, rows, offset = [], [], misalign
    chunks.append(np.full(misalign, 7, np.uint8))  # bytes before the first image: never read
    for img, layout in zip(images, layouts):
        if layout == LAYOUT_HWC_BGR:
            data = img
        elif layout == LAYOUT_HWC_RGB:
            data = np.ascontiguousarray(img[..., ::-1])
        else:
            data = np.ascontiguousarray(img[..., ::-1].transpose(2, 0, 1))
        row = np.zeros(PARAMS_PER_IMAGE, np.int64)
        fill_params(row, letterbox_placement(img.shape[0], img.shape[1], size), offset, layout)
        rows.append(row)
        chunks.append(data.reshape(-1))
        offset += data.size + 3  # odd gaps: offsets need no alignment
        chunks.append(np.full(3, 255, np.uint8))
    for _ in range(extra_empty_slots):
        row = np.zeros(PARAMS_PER_IMAGE, np.int64)
        fill_params(row, None, 0, 0)
        rows.append(row)
    staging = np.concatenate(chunks)
    params = np.stack(rows)
    batch = len(rows)
    out = cuda.device_array((batch + 1, 3, size, size), dtype)  # one more slot: must stay untouched
    sentinel = np.full(out.shape, -1.0, dtype)
    out.copy_to_device(sentinel)
    launch_letterbox(cuda.to_device(staging), cuda.to_device(params), out, batch)
    return out.copy_to_host()


def _reference(img, size, dtype):
    lb_img, _ = letterbox(img, size)
    return to_input([lb_img])[0].astype(dtype)


CASES = [  # (size, [(h, w), ...]): upscaling, downscaling, tall, wide, already square, tiny
    (32, [(20, 30), (50, 70), (31, 17)]),
    (48, [(48, 48), (7, 100), (90, 33)]),
    (64, [(37, 53), (17, 29), (130, 64)]),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("size,shapes", CASES)
def test_letterbox_kernel_matches_cpu_reference(size, shapes, dtype):
    rng = np.random.default_rng(size)
    images = [_image(rng, h, w) for h, w in shapes] * 2
    layouts = [LAYOUT_HWC_BGR] * len(shapes) + [LAYOUT_CHW_RGB] * len(shapes)
    out = _run_kernel(images, layouts, size, dtype, extra_empty_slots=1, misalign=5)

    worst = 0.0
    for i, img in enumerate(images):
        ref = _reference(img, size, dtype).astype(np.float32)
        diff = np.abs(out[i].astype(np.float32) - ref)
        worst = max(worst, float(diff.max()))
        tol = ONE_LEVEL + (1e-3 if dtype == np.float16 else 1e-7)
        assert diff.max() <= tol, (
            f"image {i} {img.shape} layout {layouts[i]} size {size}: max |diff| {diff.max() * 255:.3f} levels "
            f"at {np.unravel_index(diff.argmax(), diff.shape)}"
        )
    # The fixed-point emulation is meant to be bit-exact with OpenCV's SIMD path; report how close.
    print(f"size {size} {np.dtype(dtype).name}: max |diff| = {worst * 255:.4f} levels")

    pad = np.float32(114) / np.float32(255)
    np.testing.assert_array_equal(out[len(images)], np.full((3, size, size), pad, dtype), "empty slot is all padding")
    assert (out[len(images) + 1] == -1).all(), "the kernel wrote past the launched batch"


def test_same_image_every_layout_is_identical():
    rng = np.random.default_rng(1)
    img = _image(rng, 45, 61)
    out = _run_kernel([img, img, img], [LAYOUT_HWC_BGR, LAYOUT_CHW_RGB, LAYOUT_HWC_RGB], 40, np.float32)
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], out[2])
    ref = _reference(img, 40, np.float32)
    assert np.abs(out[0] - ref).max() <= ONE_LEVEL + 1e-7


def test_placement_is_ultralytics_rounding():
    for h, w, size in [(480, 640, 640), (1080, 1920, 640), (17, 29, 64), (100, 7, 32), (640, 640, 640)]:
        lb = letterbox_placement(h, w, size)
        _, ref = letterbox(np.zeros((h, w, 3), np.uint8), size)
        assert lb == ref


@pytest.mark.skipif(os.environ.get("YOLOPIPE_REAL_GPU") == "1", reason="compile check is for GPU-less CI")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kernel_compiles_for_the_real_target(dtype):
    """The simulator does not type-check like NVVM does: compile the real kernel to PTX (sm_90)
    in a subprocess without the simulator; this needs no GPU and no driver."""
    code = textwrap.dedent(
        f"""
        import types as pytypes
        from numba import cuda, types
        import numba.cuda.dispatcher as dispatcher
        # Device functions are compiled for the current device's CC, and there is none here.
        dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
        from app.gpu.preprocess import letterbox_kernel
        sig = (types.uint8[::1], types.int64[:, ::1], types.{dtype}[:, :, :, ::1])
        ptx, _ = cuda.compile_ptx(letterbox_kernel.py_func, sig, cc=(9, 0))
        assert ".entry" in ptx
        # No FMA in the float64 coordinate maths (OpenCV rounds each step).
        print("fma.rn.f64" in ptx)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False", "float64 coordinate maths was contracted to an FMA"

"""The NV12 letterbox kernel against OpenCV's decode: swscale's YUV → BGR conversion (the host
reference ``app.imaging.yuv``, itself held to ``VideoCapture`` in tests/unit/imaging/test_yuv.py)
then the CPU letterbox and ``to_input``, on frames of the test clip turned into NV12 the way a
decoder lays them out (rows padded to a pitch, the UV plane after the Y plane's rows), on every
Y/U/V value, and on H.264 clips decoded by FFmpeg against ``VideoCapture``'s own frames. Tiny
sizes: in the simulator every CUDA thread is a Python thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from app.imaging.letterbox import PAD_VALUE, letterbox, letterbox_params, to_input
from app.imaging.yuv import swscale_constants, yuv420_to_bgr
from tests.nv12 import Surface, surface
from tests.videos import clip_frames, decoded_frames, ffmpeg, write_tagged_h264, yuv_frames

cuda = pytest.importorskip("numba.cuda")
from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox

SIZE = 32


@pytest.fixture(scope="module")
def frames(assets_dir) -> list[np.ndarray]:
    """Two frames of the test clip (zidane, then bus), full size; each case shrinks them."""
    clip = clip_frames(assets_dir, 12)
    return [clip[0], clip[11]]


def run(surfaces: list[Surface | None], gap: int = 7) -> np.ndarray:
    """Every surface at its own offset of one staging buffer (odd gaps of junk between them, a
    misaligned first one), ``None`` an empty slot; one launch."""
    chunks, params, offset = [np.full(5, 9, np.uint8)], [], 5
    for s in surfaces:
        row = np.zeros(NV12_PARAMS, np.int64)
        if s is None:
            fill_nv12_params(row, None, 0, 0)
        else:
            fill_nv12_params(row, letterbox_params(s.height, s.width, SIZE), offset, s.pitch, s.luma_rows, s.colour)
            chunks += [s.bytes, np.full(gap, 77, np.uint8)]
            offset += s.bytes.size + gap
        params.append(row)
    staging = cuda.to_device(np.concatenate(chunks))
    out = cuda.device_array((len(params), 3, SIZE, SIZE), np.float32)
    launch_nv12_letterbox(staging, cuda.to_device(np.stack(params)), out, len(params))
    return out.copy_to_host()


def assert_same(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Bit-equal: swscale's integer colour conversion and OpenCV's fixed-point resize arithmetic."""
    diff = np.abs(got - ref)
    assert diff.max() == 0, (what, f"{int((diff > 0).sum())} values differ, by up to {diff.max() * 255:.2f} levels")


def test_frames_of_mixed_sizes_in_one_staging_buffer(frames):
    """Upscaled, downscaled, exactly halved (what 1280x720 → 640 is), odd-sized (a coded picture
    larger than the one shown) and portrait frames, with row pitches over the width, and an empty
    slot between them: each equals OpenCV's conversion + letterbox of its own bytes."""
    zidane, bus = frames
    cases = {
        "upscaled, pitch 48": surface(zidane, 20, 30, pitch=48),
        "downscaled": surface(bus, 48, 40),
        "halved": surface(zidane, 36, 64, pitch=80),
        "odd 21x33 shown of 22x34, pitch 40": surface(bus, 21, 33, pitch=40),
        "portrait, pitch 16": surface(zidane, 24, 12, pitch=16),
    }
    surfaces: list[Surface | None] = list(cases.values())
    surfaces.insert(2, None)
    got = run(surfaces)
    for k, s in enumerate(surfaces):
        if s is None:
            assert np.all(got[k] == np.float32(PAD_VALUE) / np.float32(255)), "the empty slot is padding only"
        else:
            assert_same(got[k], s.reference(), next(name for name, c in cases.items() if c is s))


def test_a_frame_at_the_model_size_is_only_converted(frames):
    """A frame already ``SIZE`` wide is not resized (the CPU letterbox skips ``cv2.resize``): the
    colour conversion alone, bit-equal."""
    s = surface(frames[1], 24, SIZE, pitch=SIZE + 8)
    got = run([s])[0]
    np.testing.assert_array_equal(got, s.reference())


class Planes(Surface):
    """A surface made from Y, U and V planes as they are (no BGR on the way)."""

    def __init__(self, y: np.ndarray, u: np.ndarray, v: np.ndarray, colour, pitch: int) -> None:
        h, w = y.shape
        uv = np.empty((h // 2, w), np.uint8)
        uv[:, 0::2], uv[:, 1::2] = u, v
        self.coded = np.concatenate([y, uv])
        self.height, self.width, self.pitch, self.size, self.colour = h, w, pitch, SIZE, colour
        self.bytes = np.full((self.coded.shape[0], pitch), 201, np.uint8)
        self.bytes[:, :w] = self.coded
        self.bytes = self.bytes.reshape(-1)
        self.luma_rows = h


def test_every_value_converts_as_swscale():
    """Frames at the model size (converted only, no resize) holding every Y value and every U
    and V value, in three colour matrices and ranges: each pixel as swscale converts it."""
    y = ((np.arange(SIZE * SIZE) * 37) % 256).astype(np.uint8).reshape(SIZE, SIZE)
    u = np.arange(256, dtype=np.uint8).reshape(16, 16)
    v = ((np.arange(256) * 91 + 7) % 256).astype(np.uint8).reshape(16, 16)
    colours = [swscale_constants(), swscale_constants(1), swscale_constants(1, True)]
    surfaces = [Planes(y, u, v, k, SIZE + 16) for k in colours]
    got = run(surfaces)
    for k, s in zip(got, surfaces):
        expected = to_input([yuv420_to_bgr(y, u, v, s.colour)])[0]
        assert_same(k, expected, str(s.colour))
    assert not np.array_equal(got[0], got[1]), "the matrix reaches the kernel"


@pytest.mark.skipif(ffmpeg() is None, reason="needs ffmpeg to encode the clips")
@pytest.mark.parametrize(("colorspace", "full_range"), [("bt709", False), (None, True)])
def test_decoded_frames_equal_videocaptures(tmp_path, frames, colorspace, full_range):
    """A H.264 frame decoded by FFmpeg (the bytes NVDEC decodes to), laid out as NV12 with its
    stream's colour matrix and range, letterboxes to what OpenCV's ``VideoCapture`` frame of the
    same clip does: an odd-sized picture (42x26, a 42x26 coded one shown whole)."""
    pytest.importorskip("av")
    small = [np.ascontiguousarray(f[40:300, 100:520][::10, ::10]) for f in frames]
    clip = write_tagged_h264(tmp_path / "clip.mp4", small, colorspace=colorspace, full_range=full_range)
    y, u, v, cs, full = yuv_frames(clip)[1]
    s = Planes(y, u, v, swscale_constants(cs, full), 48)
    expected = to_input([letterbox(decoded_frames(clip)[1], SIZE)[0]])[0]
    assert_same(run([s])[0], expected, f"{colorspace} full={full_range}")


def test_chroma_reaches_the_right_channels():
    """A saturated red frame comes out red in RGB order (channel 0), not blue."""
    red = np.zeros((16, 16, 3), np.uint8)
    red[..., 2] = 255
    s = Surface(red, 16, 16, 16, colour=swscale_constants(1))
    got = run([s])[0]
    assert got[0, SIZE // 2, SIZE // 2] > 0.9 and got[2, SIZE // 2, SIZE // 2] < 0.1
    assert_same(got, s.reference(), "red")


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
        from app.gpu.nv12 import nv12_letterbox_kernel
        sig = (types.uint8[::1], types.int64[:, ::1], types.{dtype}[:, :, :, ::1])
        ptx, _ = cuda.compile_ptx(nv12_letterbox_kernel.py_func, sig, cc=(9, 0))
        assert ".entry" in ptx
        print("fma.rn.f64" in ptx)  # the float64 coordinate maths must round each step, as OpenCV
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False", "float64 coordinate maths was contracted to an FMA"

"""``app.imaging.yuv`` against OpenCV's ``VideoCapture``: FFmpeg's own YUV planes of H.264 clips
made here (PyAV decodes them; H.264 decoding is exact, so they are the bytes NVDEC gives),
converted by the host reference, equal OpenCV's BGR frames of the same clips pixel for pixel:
untagged and tagged colour matrices, limited and full range, Baseline/Main/High profiles, a
width that is no multiple of 8 or 16 (the SIMD converter's tail)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from app.imaging.yuv import nv12_to_bgr, swscale_constants, yuv420_to_bgr
from tests.videos import decoded_frames, ffmpeg, write_tagged_h264, yuv_frames

pytest.importorskip("av")
pytestmark = pytest.mark.skipif(ffmpeg() is None, reason="needs ffmpeg to encode the clips")


@pytest.fixture(scope="module")
def frames(assets_dir) -> list[np.ndarray]:
    """Three 66x38 frames of the photos, saturated corners included (chroma at both ends)."""
    photos = [cv2.imread(str(assets_dir / name)) for name in ("bus.jpg", "zidane.jpg", "bus.jpg")]
    out = [cv2.resize(p, (66, 38), interpolation=cv2.INTER_AREA) for p in photos]
    out[2][:8, :8] = (255, 0, 0)
    out[2][-8:, -8:] = (0, 0, 255)
    out[2][:8, -8:] = (255, 255, 255)
    return out


@pytest.mark.parametrize(("colorspace", "full_range", "profile", "code"), [
    (None, False, "baseline", 2),  # untagged: swscale's default, BT.601
    ("bt709", False, "high", 1),
    ("bt709", True, "high", 1),
    ("smpte170m", True, "baseline", 6),
    ("bt2020nc", False, "main", 9),
])
def test_ffmpeg_planes_convert_to_opencvs_frames(tmp_path, frames, colorspace, full_range, profile, code):
    clip = write_tagged_h264(tmp_path / "clip.mp4", frames, colorspace=colorspace, full_range=full_range,
                             profile=profile)
    opencv = decoded_frames(clip)
    planes = yuv_frames(clip)
    assert len(opencv) == len(planes) == len(frames)
    for k, ((y, u, v, cs, full), reference) in enumerate(zip(planes, opencv)):
        assert (cs, full) == (code, full_range), "the stream says its colour matrix and range"
        got = yuv420_to_bgr(y, u, v, swscale_constants(cs, full))
        assert got.shape == reference.shape
        assert np.array_equal(got, reference), (k, int((got != reference).sum()), "pixels differ")


def test_another_matrix_is_not_opencvs(tmp_path, frames):
    """The comparison sees a wrong matrix: BT.709 planes converted as BT.601 are not OpenCV's."""
    clip = write_tagged_h264(tmp_path / "clip.mp4", frames, colorspace="bt709")
    y, u, v, _, full = yuv_frames(clip)[0]
    wrong = yuv420_to_bgr(y, u, v, swscale_constants(2, full))
    assert not np.array_equal(wrong, decoded_frames(clip)[0])


def test_nv12_surface_reads_as_the_planes():
    """A decoder's NV12 surface (rows padded to a pitch, taller than the picture) converts as its planes."""
    rng = np.random.default_rng(3)
    y = rng.integers(0, 256, (7, 9), np.uint8)
    u, v = rng.integers(0, 256, (4, 5), np.uint8), rng.integers(0, 256, (4, 5), np.uint8)
    surface = np.full((12, 16), 77, np.uint8)  # 8 luma rows (a coded height), then 4 UV rows
    surface[:7, :9] = y
    surface[8:, 0:10:2], surface[8:, 1:10:2] = u, v
    k = swscale_constants(1)
    np.testing.assert_array_equal(nv12_to_bgr(surface, 7, 9, k), yuv420_to_bgr(y, u, v, k))


def test_constants_are_swscales():
    """FFmpeg's own tables for BT.601 limited range, the untagged default (ff_yuv2rgb_coeffs
    through its 16-bit rounding), and full range leaves luma as it is."""
    assert tuple(swscale_constants()) == (9539, 128, 13075, 16525, -6660, -3209)
    assert swscale_constants(5) == swscale_constants(6) == swscale_constants(2) == swscale_constants(12)
    assert swscale_constants(1, True)[:2] == (8192, 0)

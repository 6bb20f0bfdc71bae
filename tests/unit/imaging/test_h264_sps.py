"""The SPS colour description of H.264 clips made here (ffmpeg's libx264, tagged or not, limited
or full range, Baseline to High with custom scaling matrices), read from the packets OpenCV's
demuxer hands over in raw mode, against what FFmpeg's decoder tells each frame (PyAV)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from app.imaging.h264_sps import UNSPECIFIED, nal_units, stream_colour
from tests.videos import ffmpeg, write_tagged_h264, yuv_frames

pytestmark = pytest.mark.skipif(ffmpeg() is None, reason="needs ffmpeg to encode the clips")


def raw_packets(path, count: int = 3) -> list[bytes]:
    cap = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    packets = []
    while len(packets) < count and cap.grab():
        ok, packet = cap.retrieve()
        assert ok
        packets.append(packet.tobytes())
    cap.release()
    return packets


@pytest.mark.parametrize(("colorspace", "full_range", "profile"), [
    (None, False, "baseline"), ("bt709", False, "main"), ("bt709", True, "high"), ("smpte170m", False, "high"),
    ("bt2020nc", True, "high444"),
])
def test_the_decoders_colour_description(tmp_path, colorspace, full_range, profile):
    pytest.importorskip("av")
    frames = [np.full((36, 50, 3), (40 * k, 90, 200 - 30 * k), np.uint8) for k in range(3)]
    clip = write_tagged_h264(tmp_path / "clip.mp4", frames, colorspace=colorspace, full_range=full_range,
                             profile=profile)
    _, _, _, code, full = yuv_frames(clip)[0]
    assert stream_colour(raw_packets(clip)) == (code, full)


def test_scaling_matrices_are_skipped(tmp_path):
    """A High-profile SPS with custom scaling lists (x264's JVT matrices) still parses to its VUI."""
    frames = [np.full((32, 48, 3), 100 + k, np.uint8) for k in range(2)]
    clip = tmp_path / "cqm.mp4"
    import subprocess

    subprocess.run([ffmpeg(), "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "bgr24", "-s", "48x32", "-r", "5",
                    "-i", "-", "-c:v", "libx264", "-x264-params", "cqm=jvt", "-colorspace", "bt709",
                    "-pix_fmt", "yuv420p", str(clip)], input=b"".join(f.tobytes() for f in frames), check=True)
    assert stream_colour(raw_packets(clip)) == (1, False)


def test_no_sps_and_a_truncated_one():
    assert stream_colour([b"\x00\x00\x00\x01\x65\x88\x84"]) is None  # an IDR slice alone
    sps = bytes.fromhex("6764001eacd940c03d")  # cut before its VUI ends
    assert stream_colour([b"\x00\x00\x01" + sps]) is None
    assert UNSPECIFIED == (2, False)


def test_nal_units_split_on_both_start_codes():
    data = b"\x00\x00\x00\x01\x67\xaa\x00\x00\x01\x68\xbb\xcc\x00\x00\x00\x01\x65\x01"
    assert nal_units(data) == [b"\x67\xaa", b"\x68\xbb\xcc", b"\x65\x01"]

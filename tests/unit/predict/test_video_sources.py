"""Which decoder reads videos and streams (``app.predict.sources.video_decoder``, from the run
shape's ``video_decode``). How a batch holding both device and host frames is split (a GPU batch
holds one kind) is ``Detector.run``'s: tests/unit/pipeline/test_detector.py. The NVDEC path
itself runs on a GPU only: tests/gpu/test_nvdec.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.contracts import DeviceNv12, RunShape
from app.errors import InvalidParameter
from app.predict.sources import video_decoder
from app.runtime import OpenOptions, open_detector
from tests.videos import write_clip


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=8))
    with open_detector(options) as det:
        yield det


def test_the_cpu_pipeline_reads_with_opencv(detector):
    assert detector.shape.video_decode == "auto"
    assert video_decoder(detector) == "opencv"  # auto: the ONNX Runtime pipeline takes no device frames
    assert video_decoder(detector.reshaped(video_decode="opencv")) == "opencv"
    assert video_decoder(detector.reshaped(video_decode="cpu")) == "opencv"  # its old name
    with pytest.raises(InvalidParameter, match="NVDEC decoding needs a GPU backend, not onnxruntime"):
        video_decoder(detector.reshaped(video_decode="nvdec"))
    with pytest.raises(InvalidParameter, match="unknown video decoder 'ffmpeg'"):
        detector.reshaped(video_decode="ffmpeg")


def test_auto_reads_with_nvdec_on_a_pipeline_that_takes_device_frames_when_pynvvideocodec_is_there(monkeypatch):
    """auto: NVDEC where it can be (a GPU pipeline, PyNvVideoCodec importable), else OpenCV."""
    import importlib.util
    import types

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "PyNvVideoCodec" else real_find_spec(name, *a))
    gpu_like = types.SimpleNamespace(shape=RunShape(video_decode="auto"), takes_nv12=True, backend="torch-cuda")
    assert video_decoder(gpu_like) == "opencv"  # not installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "PyNvVideoCodec" else real_find_spec(name, *a))
    assert video_decoder(gpu_like) == "nvdec"
    cpu_like = types.SimpleNamespace(shape=RunShape(video_decode="auto"), takes_nv12=False, backend="onnxruntime")
    assert video_decoder(cpu_like) == "opencv"  # installed, but the pipeline takes no device frames
    gpu_like.shape = RunShape(video_decode="opencv")
    assert video_decoder(gpu_like) == "opencv"


def test_opening_videos_prints_no_opencv_warning(tmp_path, assets_dir):
    """OpenCV warns at every FFmpeg capture that OPENCV_FFMPEG_IS_THREAD_SAFE (set by yolopipe on
    purpose) is set: a normal video, opened the ways videos and streams are, prints nothing."""
    clip = write_clip(tmp_path / "clip.avi", assets_dir, 2)
    code = ("import sys; from app.predict.sources import open_opencv, open_source, RawPackets\n"
            "for _ in range(3):\n"
            "    open_opencv(sys.argv[1], timeout_ms=5000, threads=1).release()\n"
            "    open_source(sys.argv[1], 'opencv', max_pixels=10**8).release()\n"
            "    RawPackets(sys.argv[1]).release()\n"
            "print('opened')\n")
    env = {k: v for k, v in os.environ.items() if k != "OPENCV_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code, str(clip)], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "opened", out.stderr
    assert "WARN" not in out.stderr and "OPENCV_FFMPEG" not in out.stderr, out.stderr
    # The warning it hides is real: OpenCV alone, with the same environment variable, prints it.
    bare = ("import os, sys; os.environ['OPENCV_FFMPEG_IS_THREAD_SAFE'] = '1'; import cv2\n"
            "cv2.VideoCapture(sys.argv[1], cv2.CAP_FFMPEG).release()\n")
    out = subprocess.run([sys.executable, "-c", bare, str(clip)], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert "OPENCV_FFMPEG_IS_THREAD_SAFE" in out.stderr


def test_device_frames_are_refused_by_the_cpu_pipeline(detector):
    torch = pytest.importorskip("torch")
    (result,) = detector.detect([DeviceNv12(torch.zeros((30, 20), dtype=torch.uint8), 20, 20)])
    assert isinstance(result.error, InvalidParameter) and "takes no device NV12 frames" in str(result.error)


def test_cli_names_the_decoder_it_cannot_use(tmp_path, assets_dir, artifacts_dir):
    clip = write_clip(tmp_path / "clip.avi", assets_dir, 2)
    cmd = [sys.executable, "-m", "app.cli", "predict", str(clip), "--backend", "onnxruntime", "--out",
           str(tmp_path / "out.jsonl"), "--artifacts-dir", str(artifacts_dir)]
    bad = subprocess.run([*cmd, "--video-decode", "gpu"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown video decoder 'gpu'; choose one of auto, nvdec, opencv" in bad.stderr
    cpu = subprocess.run([*cmd, "--video-decode", "nvdec"], capture_output=True, text=True, timeout=300)
    assert cpu.returncode == 2 and "NVDEC decoding needs a GPU backend, not onnxruntime" in cpu.stderr

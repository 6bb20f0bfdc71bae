"""Which decoder reads videos and streams (``app.pipeline.sources.video_decoder``), and how a
stream batch holding both device and host frames is split (a GPU batch holds one kind). The
NVDEC path itself runs on a GPU only: tests/gpu/test_nvdec.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from app.contracts import DeviceNv12, ImageResult
from app.errors import InvalidParameter
from app.pipeline.detector import Detector
from app.pipeline.sources import video_decoder
from app.pipeline.stream_source import Stream, StreamFrame
from app.pipeline.streams import StreamRunner
from app.runtime import open_detector
from tests.videos import write_clip


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    with open_detector("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, max_batch=8) as det:
        yield det


def test_the_cpu_pipeline_reads_with_opencv(detector):
    assert detector.video_decode == "auto"
    assert video_decoder(detector) == "opencv"  # auto: the ONNX Runtime pipeline takes no device frames
    detector.video_decode = "opencv"
    assert video_decoder(detector) == "opencv"
    detector.video_decode = "nvdec"
    try:
        with pytest.raises(InvalidParameter, match="NVDEC decoding needs a GPU backend, not onnxruntime"):
            video_decoder(detector)
    finally:
        detector.video_decode = "auto"
    with pytest.raises(InvalidParameter, match="unknown video decoder 'ffmpeg'"):
        Detector(detector.pipeline, video_decode="ffmpeg")


def test_auto_reads_with_opencv_even_on_a_pipeline_that_takes_device_frames(monkeypatch):
    """NVDEC is asked for by name until its end-to-end GPU comparisons pass (see app.pipeline.sources)."""
    import importlib.util
    import types

    gpu_like = types.SimpleNamespace(video_decode="auto", pipeline=types.SimpleNamespace(takes_nv12=True, backend="torch-cuda"))
    assert video_decoder(gpu_like) == "opencv"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "PyNvVideoCodec" else real_find_spec(name, *a))
    assert video_decoder(gpu_like) == "opencv"
    gpu_like.video_decode = "nvdec"
    assert video_decoder(gpu_like) == "nvdec"


def test_device_frames_are_refused_by_the_cpu_pipeline(detector):
    torch = pytest.importorskip("torch")
    (result,) = detector.detect([DeviceNv12(torch.zeros((30, 20), dtype=torch.uint8), 20, 20)])
    assert isinstance(result.error, InvalidParameter) and "takes no device NV12 frames" in str(result.error)


def test_a_batch_of_device_and_host_frames_is_detected_as_two(detector):
    """A source NVDEC could not read (OpenCV read it) shares the runner's batches with NVDEC
    ones: each kind goes to ``detect`` on its own, and every frame gets its own result back."""
    calls: list[list[str]] = []

    def detect(images):
        calls.append(["device" if isinstance(x, DeviceNv12) else "host" for x in images])
        return [ImageResult(width=int(getattr(x, "width", 0) or x.shape[1])) for x in images]

    runner = StreamRunner(detector, detector.params(), lambda *a: None, detect=detect)
    stream = Stream("0", "clip.avi")
    images = [DeviceNv12(None, 4, 11), np.zeros((4, 12, 3), np.uint8), DeviceNv12(None, 4, 13),
              np.zeros((4, 14, 3), np.uint8)]
    frames = [StreamFrame(stream, k, 0.0, image, 0.0) for k, image in enumerate(images)]
    _, results = runner._detect(frames)
    assert calls == [["device", "device"], ["host", "host"]]
    assert [r.width for r in results] == [11, 12, 13, 14]
    calls.clear()
    runner._detect(frames[1::2])
    assert calls == [["host", "host"]]  # one kind: one call, as before


def test_cli_names_the_decoder_it_cannot_use(tmp_path, assets_dir, artifacts_dir):
    clip = write_clip(tmp_path / "clip.avi", assets_dir, 2)
    cmd = [sys.executable, "-m", "app.cli", "predict", str(clip), "--backend", "onnxruntime", "--out",
           str(tmp_path / "out.jsonl"), "--artifacts-dir", str(artifacts_dir)]
    bad = subprocess.run([*cmd, "--video-decode", "gpu"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown video decoder 'gpu'; choose one of auto, nvdec, opencv" in bad.stderr
    cpu = subprocess.run([*cmd, "--video-decode", "nvdec"], capture_output=True, text=True, timeout=300)
    assert cpu.returncode == 2 and "NVDEC decoding needs a GPU backend, not onnxruntime" in cpu.stderr

"""Which decoder reads videos and streams (``app.predict.sources.video_decoder``, from the run
shape's ``video_decode``). How a batch holding both device and host frames is split (a GPU batch
holds one kind) is ``Detector.run``'s: tests/unit/pipeline/test_detector.py. The NVDEC path
itself runs on a GPU only: tests/gpu/test_nvdec.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.contracts import DeviceNv12, RunShape
from app.errors import InvalidParameter
from app.predict.sources import video_decoder
from app.runtime import open_detector
from tests.videos import write_clip


@pytest.fixture(scope="module")
def detector(artifacts_dir):
    with open_detector("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, max_batch=8) as det:
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


def test_auto_reads_with_opencv_even_on_a_pipeline_that_takes_device_frames(monkeypatch):
    """NVDEC is asked for by name until its end-to-end GPU comparisons pass (see app.predict.sources)."""
    import importlib.util
    import types

    gpu_like = types.SimpleNamespace(shape=RunShape(video_decode="auto"), takes_nv12=True, backend="torch-cuda")
    assert video_decoder(gpu_like) == "opencv"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "PyNvVideoCodec" else real_find_spec(name, *a))
    assert video_decoder(gpu_like) == "opencv"
    gpu_like.shape = RunShape(video_decode="nvdec")
    assert video_decoder(gpu_like) == "nvdec"


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

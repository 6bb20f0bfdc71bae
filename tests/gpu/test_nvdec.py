"""NVDEC (PyNvVideoCodec) frames into the NV12 letterbox kernel on the device: within one level of
OpenCV's conversion + letterbox of the very same NV12 bytes, and close to OpenCV's own decode
of the file (a different decoder and colour converter: a bounded difference)."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("the Numba CUDA simulator is on: these tests need a real GPU", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("PyNvVideoCodec")

from numba import cuda

from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox
from app.gpu.nvdec import NvdecReader
from app.imaging.letterbox import letterbox, letterbox_params, to_input
from tests.videos import clip_frames, decoded_frames

SIZE = 640


@pytest.fixture(scope="module")
def clip(tmp_path_factory, assets_dir):
    """MPEG-4 Part 2 written by OpenCV (no ffmpeg binary needed on the GPU machine)."""
    path = tmp_path_factory.mktemp("nvdec") / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (640, 480))
    for frame in clip_frames(assets_dir, 12):
        writer.write(frame)
    writer.release()
    return path


def letterboxed(planes: torch.Tensor, height: int, width: int) -> np.ndarray:
    row = np.zeros((1, NV12_PARAMS), np.int64)
    fill_nv12_params(row[0], letterbox_params(height, width, SIZE), 0, width)
    staging = planes.reshape(-1).contiguous()
    out = cuda.device_array((1, 3, SIZE, SIZE), np.float32)
    launch_nv12_letterbox(cuda.as_cuda_array(staging), cuda.to_device(row), out, 1)
    cuda.synchronize()
    return out.copy_to_host()[0]


def test_nvdec_frames_through_the_kernel(clip):
    reader = NvdecReader(str(clip))
    cpu = decoded_frames(clip)
    got = 0
    for frame in reader.frames():
        assert (frame.height, frame.width) == (480, 640)
        ours = letterboxed(frame.planes, frame.height, frame.width)
        nv12 = frame.planes.cpu().numpy().reshape(frame.height * 3 // 2, frame.width)
        same_bytes = to_input([letterbox(cv2.cvtColor(nv12, cv2.COLOR_YUV2BGR_NV12), SIZE)[0]])[0]
        assert np.abs(ours - same_bytes).max() <= 1.0 / 255 + 1e-6  # the kernel: OpenCV's arithmetic
        opencv = to_input([letterbox(cpu[frame.index], SIZE)[0]])[0]
        diff = np.abs(ours - opencv)
        assert diff.mean() < 3.0 / 255 and np.percentile(diff, 99) < 16.0 / 255, frame.index
        got += 1
    assert got == len(cpu) == 12

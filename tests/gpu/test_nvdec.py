"""NVDEC (PyNvVideoCodec) frames on the device, through the NV12 letterbox kernel and through
the GPU pipeline, against OpenCV's decode of the same file through the same pipeline.

Needs a CUDA GPU and ``pynvvideocodec``; the sample model's fp32 pipeline (``pipe32``: eager
torch-cuda, batch 8, no torch.compile). The clip is MPEG-4 Part 2 written by OpenCV (no ffmpeg
binary needed here); ``YOLOPIPE_NVDEC_CLIP`` may name another file (e.g. an H.264 .mp4), whose
first ``CLIP_FRAMES`` frames are compared too.
"""

from __future__ import annotations

import os
from pathlib import Path

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

from app.boxes import f1, match_pairs
from app.contracts import DetectParams, DeviceNv12
from app.errors import InvalidImage
from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox
from app.gpu.nv12_input import Nv12Layout
from app.gpu.nvdec import NvdecReader
from app.imaging.letterbox import letterbox, letterbox_params, to_input
from app.pipeline.detector import Detector
from app.pipeline.sources import NvdecCapture, video_decoder
from app.pipeline.streams import predict_streams
from app.pipeline.video import predict_video
from tests.videos import clip_frames, decoded_frames

SIZE = 640
CLIP_FRAMES = 24  # of a YOLOPIPE_NVDEC_CLIP file: enough to compare, quick to run


@pytest.fixture(scope="module")
def clip(tmp_path_factory, assets_dir) -> Path:
    path = tmp_path_factory.mktemp("nvdec") / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (640, 480))
    for frame in clip_frames(assets_dir, 12):
        writer.write(frame)
    writer.release()
    return path


def clips(clip: Path) -> list[Path]:
    extra = os.environ.get("YOLOPIPE_NVDEC_CLIP")
    return [clip] + ([Path(extra)] if extra else [])


def nvdec_frames(path: Path, count: int | None = None) -> list[DeviceNv12]:
    """The frames as the streams and videos read them (``app.pipeline.sources.NvdecCapture``)."""
    cap, frames = NvdecCapture(str(path)), []
    while (count is None or len(frames) < count) and cap.grab():
        ok, frame = cap.retrieve()
        assert ok
        frames.append(frame)
    cap.release()
    return frames


def letterboxed(planes: torch.Tensor, height: int, width: int) -> np.ndarray:
    row = np.zeros((1, NV12_PARAMS), np.int64)
    fill_nv12_params(row[0], letterbox_params(height, width, SIZE), 0, planes.stride(0), planes.shape[0] * 2 // 3)
    span = Nv12Layout(planes.shape[0], planes.shape[1], planes.stride(0)).span
    staging = torch.as_strided(planes, (span,), (1,))  # the frame's bytes, rows at its pitch
    out = cuda.device_array((1, 3, SIZE, SIZE), np.float32)
    launch_nv12_letterbox(cuda.as_cuda_array(staging), cuda.to_device(row), out, 1)
    cuda.synchronize()
    return out.copy_to_host()[0]


def host_nv12(frame: DeviceNv12) -> np.ndarray:
    return np.ascontiguousarray(frame.planes.cpu().numpy())


def test_nvdec_frames_through_the_kernel(clip):
    reader = NvdecReader(str(clip))
    cpu = decoded_frames(clip)
    got = 0
    for frame in reader.frames():
        assert (frame.height, frame.width) == (480, 640)
        ours = letterboxed(frame.planes, frame.height, frame.width)
        shown = cv2.cvtColor(frame.planes.cpu().numpy(), cv2.COLOR_YUV2BGR_NV12)[: frame.height, : frame.width]
        same_bytes = to_input([letterbox(np.ascontiguousarray(shown), SIZE)[0]])[0]
        np.testing.assert_array_equal(ours, same_bytes)  # the kernel: OpenCV's arithmetic
        opencv = to_input([letterbox(cpu[frame.index], SIZE)[0]])[0]
        diff = np.abs(ours - opencv)  # another decoder and colour converter: close, not equal
        assert diff.mean() < 3.0 / 255 and np.percentile(diff, 99) < 16.0 / 255, frame.index
        got += 1
    assert got == len(cpu) == 12


def same_detections(a, b) -> float:
    """F1 of ``b`` against ``a`` over frames (IoU 0.5, same class), and how many ``a`` has."""
    tp = n_a = n_b = 0
    for da, db in zip(a, b):
        tp += len(match_pairs(da.boxes, da.class_ids, db.boxes, db.class_ids, iou_thr=0.5))
        n_a, n_b = n_a + len(da), n_b + len(db)
    return f1(tp, n_a, n_b), n_a


def test_nvdec_frames_through_the_pipeline_equal_opencv_decoded_frames(gpu, pipe32, clip):
    detector = Detector(pipe32)  # not closed here: it owns the session's pipeline
    params = DetectParams(conf=gpu.CONF, iou=gpu.IOU)
    pipe32.warmup([8], nv12=True)  # bucket 8 captured ahead, bucket 4 (the last 4 of 12) inside a run
    for path in clips(clip):
        count = 12 if path == clip else CLIP_FRAMES
        device = nvdec_frames(path, count)
        opencv = decoded_frames(path)[:count]
        assert len(device) == len(opencv) == count
        assert [(f.height, f.width) for f in device] == [f.shape[:2] for f in opencv]
        ours = detector.detect(device, params)
        assert all(r.error is None for r in ours), [r.error for r in ours]
        assert [(r.width, r.height) for r in ours] == [(f.shape[1], f.shape[0]) for f in opencv]
        score, n = same_detections([r.detections for r in detector.detect(opencv, params)],
                                   [r.detections for r in ours])
        assert n >= count and score >= 0.99, (path.name, score, n)
        # The same NV12 bytes converted by OpenCV on the host, through the image path: the same boxes.
        host = [np.ascontiguousarray(cv2.cvtColor(host_nv12(f), cv2.COLOR_YUV2BGR_NV12)[: f.height, : f.width])
                for f in device]
        score, _ = same_detections([r.detections for r in detector.detect(host, params)],
                                   [r.detections for r in ours])
        assert score >= 0.99, (path.name, score)  # the image letterbox kernel may round a pixel one level apart


def test_pitched_frames_and_mixed_batches(gpu, pipe32, clip):
    (frame,) = nvdec_frames(clip, 1)
    rows, cols = frame.planes.shape
    padded = torch.full((rows, cols + 64), 7, dtype=torch.uint8, device=frame.planes.device)
    padded[:, :cols] = frame.planes
    pitched = DeviceNv12(padded[:, :cols], frame.height, frame.width)  # rows 64 bytes longer than the picture
    params = DetectParams(conf=gpu.CONF, iou=gpu.IOU)
    out = pipe32.run([frame, pitched, np.zeros((480, 640, 3), np.uint8)], params).images
    np.testing.assert_allclose(out[0][0], out[1][0], atol=1e-3)  # the same engine input in two batch positions
    assert len(out[0][0]) > 0
    assert isinstance(out[2], InvalidImage)  # a host frame in a batch of device frames: its own error


def test_predict_video_and_streams_by_nvdec_equal_opencv(gpu, pipe32, clip):
    nvdec, opencv = Detector(pipe32, video_decode="nvdec"), Detector(pipe32, video_decode="opencv")
    assert video_decoder(nvdec) == "nvdec" and video_decoder(opencv) == "opencv"
    params = DetectParams(conf=gpu.CONF, iou=gpu.IOU)
    lines: dict[str, list] = {"nvdec": [], "opencv": []}
    for name, det in (("nvdec", nvdec), ("opencv", opencv)):
        summary = predict_video(det, clip, "clip.mp4", lines[name].append, params, batch=4, vid_stride=2)
        assert summary.frames == 6 and summary.error is None
    key = [(r["frame"], r["time_s"], r["width"], r["height"]) for r in lines["opencv"]]
    assert [(r["frame"], r["time_s"], r["width"], r["height"]) for r in lines["nvdec"]] == key
    assert key[1][:2] == (2, 0.2)
    events: dict[str, list] = {"nvdec": [], "opencv": []}
    for name, det in (("nvdec", nvdec), ("opencv", opencv)):
        summary = predict_streams(det, [str(clip), str(clip)], events[name].append, params)
        assert summary.frames == 24 and not summary.failed
    for decoded in events.values():
        decoded.sort(key=lambda e: (e["stream"], e["frame"]))
    assert [(e["stream"], e["frame"], e["time_s"]) for e in events["nvdec"]] == \
        [(e["stream"], e["frame"], e["time_s"]) for e in events["opencv"]]
    tp = n_a = n_b = 0
    for a, b in zip(events["opencv"] + lines["opencv"], events["nvdec"] + lines["nvdec"]):
        ba = np.array([d["box"] for d in a["detections"]], np.float32).reshape(-1, 4)
        bb = np.array([d["box"] for d in b["detections"]], np.float32).reshape(-1, 4)
        ca = np.array([d["class_id"] for d in a["detections"]], int)
        cb = np.array([d["class_id"] for d in b["detections"]], int)
        tp, n_a, n_b = tp + len(match_pairs(ba, ca, bb, cb)), n_a + len(ca), n_b + len(cb)
    assert n_a >= 24 and f1(tp, n_a, n_b) >= 0.99

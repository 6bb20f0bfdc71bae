"""NVDEC (PyNvVideoCodec) frames on the device, through the NV12 letterbox kernel and through
the GPU pipeline, against OpenCV's decode of the same file through the same pipeline.

Needs a CUDA GPU, ``pynvvideocodec`` and an H.264 clip (PyNvVideoCodec decodes H.264, HEVC and
AV1, not the MPEG-4 Part 2 OpenCV writes): ``YOLOPIPE_NVDEC_CLIP``, else the shared 1080p30 clip
where it is (``CLIPS``: carried to the GPU machine as ``.data/video``, or the shared data beside
the checkout), else the test clip re-encoded by Debian's ffmpeg where there is one; the skip
says which were looked for. At most ``CLIP_FRAMES`` of its frames are
compared. The pipeline is the sample model's fp32 one (eager torch-cuda, batch 8, no
torch.compile), this module's own (``pipe``), not the session's ``pipe32``: these tests grow
its staging to 1080p batches, capture NV12 and image graphs of every bucket and run it from
reader and batch threads, none of which may reach the tests that run after them.

The reference is OpenCV's own decode of the file. H.264 decoding is exact, and the NV12
kernel converts as OpenCV's swscale does (``app.imaging.yuv``, the stream's colour matrix and
range from its SPS): NVDEC's frames through the kernel are the very model input OpenCV's
frames through the CPU letterbox are, value for value, and through the pipeline they give the
same detections (F1 1.000, scores within 1e-3: the NV12 and the image graphs of a bucket run
the same engine on the same input).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from numba import cuda

from app.boxes import f1, match_pairs
from app.contracts import DetectParams, DeviceNv12
from app.errors import InvalidImage
from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox
from app.gpu.nv12_input import Nv12Layout
from app.gpu.nvdec import NvdecReader
from app.imaging.letterbox import letterbox, letterbox_params, to_input
from app.imaging.yuv import nv12_to_bgr, swscale_constants
from app.pipeline.detector import Detector
from app.predict.sources import NvdecCapture, video_decoder
from app.predict.streams import predict_streams
from app.predict.video import predict_video
from app.runtime import cuda_device
from tests.videos import decoded_frames, ffmpeg, write_clip, write_h264

pytestmark = pytest.mark.requires_gpu("PyNvVideoCodec")

SIZE = 640
CLIP_FRAMES = 48
ROOT = Path(__file__).resolve().parents[2]
CLIPS = (ROOT / ".data/video/dance-1080p30.mp4", ROOT.parent / "shared/data/video/dance-1080p30.mp4")


@pytest.fixture(scope="module")
def pipe(gpu, sample_model_dir, meta):
    """This module's own fp32 pipeline (see the module docstring), closed after its last test."""
    p = gpu.make_pipeline(sample_model_dir, meta, "fp32")
    yield p
    p.close()


@pytest.fixture(scope="module")
def clip(tmp_path_factory, assets_dir) -> Path:
    if os.environ.get("YOLOPIPE_NVDEC_CLIP"):
        return Path(os.environ["YOLOPIPE_NVDEC_CLIP"])
    if found := [path for path in CLIPS if path.is_file()]:
        return found[0]
    if ffmpeg() is None:
        pytest.skip(f"no H.264 clip: set YOLOPIPE_NVDEC_CLIP (none at {', '.join(map(str, CLIPS))}, and there "
                    "is no ffmpeg here to make one)")
    root = tmp_path_factory.mktemp("nvdec")
    return write_h264(root / "clip.mp4", write_clip(root / "clip.avi", assets_dir, 12))


@pytest.fixture(scope="module")
def opencv_frames(clip) -> list[np.ndarray]:
    return decoded_frames(clip)[:CLIP_FRAMES]


def nvdec_frames(path: Path, count: int | None = None) -> list[DeviceNv12]:
    """The frames as the streams and videos read them (``app.predict.sources.NvdecCapture``)."""
    cap, frames = NvdecCapture(str(path), device=cuda_device(0)), []
    while (count is None or len(frames) < count) and cap.grab():
        ok, frame = cap.retrieve()
        assert ok
        frames.append(frame)
    cap.release()
    return frames


def letterboxed(frame: DeviceNv12) -> np.ndarray:
    planes = frame.planes
    row = np.zeros((1, NV12_PARAMS), np.int64)
    fill_nv12_params(row[0], letterbox_params(frame.height, frame.width, SIZE), 0, planes.stride(0),
                     planes.shape[0] * 2 // 3, swscale_constants(frame.colorspace, frame.full_range))
    span = Nv12Layout(planes.shape[0], planes.shape[1], planes.stride(0)).span
    staging = torch.as_strided(planes, (span,), (1,))  # the frame's bytes, rows at its pitch
    out = cuda.device_array((1, 3, SIZE, SIZE), np.float32)
    launch_nv12_letterbox(cuda.as_cuda_array(staging), cuda.to_device(row), out, 1)
    cuda.synchronize()
    return out.copy_to_host()[0]


def test_nvdec_frames_through_the_kernel_are_opencvs(clip, opencv_frames):
    """Every frame: the model input from NVDEC's frame is the one from OpenCV's, value for value;
    and the host reference of the conversion reads NVDEC's bytes as the kernel does."""
    frames = nvdec_frames(clip, len(opencv_frames))
    assert len(frames) == len(opencv_frames) >= 12
    for k, (frame, reference) in enumerate(zip(frames, opencv_frames)):
        assert (frame.height, frame.width) == reference.shape[:2]
        expected = to_input([letterbox(reference, SIZE)[0]])[0]
        got = letterboxed(frame)
        assert np.array_equal(got, expected), (k, int((got != expected).sum()), "values differ")
    host = nv12_to_bgr(frames[0].planes.cpu().numpy(), frames[0].height, frames[0].width,
                       swscale_constants(frames[0].colorspace, frames[0].full_range))
    np.testing.assert_array_equal(host, opencv_frames[0])  # NVDEC's bytes are FFmpeg's


def test_packets_read_by_opencv_decode_as_the_file(clip):
    """The URL path (OpenCV's demuxer in raw mode feeding NVDEC's packet decoder) on a file gives
    the bytes the file path gives, and the colour description the file's SPS holds."""
    from app.predict.sources import RawPackets

    packets = RawPackets(str(clip))
    assert packets.opened and packets.codec in ("h264", "avc1")
    device = cuda_device(0)
    by_packets = [f.planes.clone() for f in NvdecReader(str(clip), device=device, packets=packets,
                                                        codec=packets.codec).frames()]
    packets.release()
    by_file = [f.planes.clone() for f in NvdecReader(str(clip), device=device).frames()]
    assert len(by_packets) == len(by_file) >= 12
    for a, b in zip(by_packets, by_file):
        rows = min(a.shape[0], b.shape[0]) * 2 // 3  # compare the pictures: Y rows then UV rows
        assert torch.equal(a[: rows, : b.shape[1]], b[: rows, : a.shape[1]])


def same_detections(a, b) -> float:
    """F1 of ``b`` against ``a`` over frames (IoU 0.5, same class), and how many ``a`` has."""
    tp = n_a = n_b = 0
    for da, db in zip(a, b):
        tp += len(match_pairs(da.boxes, da.class_ids, db.boxes, db.class_ids, iou_thr=0.5))
        n_a, n_b = n_a + len(da), n_b + len(db)
    return f1(tp, n_a, n_b), n_a


def test_nvdec_frames_through_the_pipeline_equal_opencv_decoded_frames(gpu, pipe, clip, opencv_frames):
    detector = Detector(pipe)  # not closed here: the module's fixture closes its pipeline
    params = DetectParams(conf=gpu.CONF, iou=gpu.IOU)
    pipe.warmup([8], nv12=True)  # bucket 8 captured ahead; a smaller last batch's bucket inside a run
    count = len(opencv_frames) - 3  # 12 frames: batches of 8 and 1; 48: 8 x 5 and 5 (bucket 8)
    device = nvdec_frames(clip, count)
    assert len(device) == count
    assert [(f.height, f.width) for f in device] == [f.shape[:2] for f in opencv_frames[:count]]
    ours = detector.detect(device, params)
    assert all(r.error is None for r in ours), [r.error for r in ours]
    assert [(r.width, r.height) for r in ours] == [(f.shape[1], f.shape[0]) for f in opencv_frames[:count]]
    theirs = detector.detect(opencv_frames[:count], params)
    score, n = same_detections([r.detections for r in theirs], [r.detections for r in ours])
    assert n >= count and score == 1.0, (score, n)
    for a, b in zip(theirs, ours):
        np.testing.assert_allclose(np.sort(a.detections.scores), np.sort(b.detections.scores), atol=1e-3)


def test_pitched_frames_and_mixed_batches(gpu, pipe, clip):
    (frame,) = nvdec_frames(clip, 1)
    rows, cols = frame.planes.shape
    padded = torch.full((rows, cols + 64), 7, dtype=torch.uint8, device=frame.planes.device)
    padded[:, :cols] = frame.planes
    pitched = DeviceNv12(padded[:, :cols], frame.height, frame.width, frame.colorspace, frame.full_range)  # rows 64 bytes longer
    params = DetectParams(conf=gpu.CONF, iou=gpu.IOU)
    out = pipe.run([frame, pitched, np.zeros((frame.height, frame.width, 3), np.uint8)], params).images
    np.testing.assert_allclose(out[0][0], out[1][0], atol=1e-3)  # the same engine input in two batch positions
    assert len(out[0][0]) > 0
    assert isinstance(out[2], InvalidImage)  # a host frame in a batch of device frames: its own error


def test_predict_video_and_streams_by_nvdec_equal_opencv(gpu, pipe, clip, caplog):
    """The whole file (not only ``CLIP_FRAMES``): every 4th frame as a video, every 8th of two
    copies as streams; the same frames, times and sizes, and the same detections (F1 1.000).
    """
    caplog.set_level(logging.INFO, logger="app.predict.sources")
    nvdec = Detector(pipe, video_decode="nvdec", max_batch=4)
    opencv = Detector(pipe, video_decode="opencv", max_batch=4)
    assert video_decoder(nvdec) == "nvdec" and video_decoder(opencv) == "opencv"
    params = DetectParams(conf=gpu.CONF, iou=gpu.IOU)
    total = len(decoded_frames(clip))
    lines: dict[str, list] = {"nvdec": [], "opencv": []}  # each frame's JSON line, read back
    for name, det in (("nvdec", nvdec), ("opencv", opencv)):
        summary = predict_video(det, clip, "clip.mp4", lambda line, name=name: lines[name].append(json.loads(line)),
                                params, vid_stride=4)
        assert summary.frames == len(range(0, total, 4)) and summary.error is None, (name, summary, total)
    key = [(r["frame"], r["time_s"], r["width"], r["height"]) for r in lines["opencv"]]
    assert [(r["frame"], r["time_s"], r["width"], r["height"]) for r in lines["nvdec"]] == key
    assert key[1][0] == 4 and key[1][1] > 0
    events: dict[str, list] = {"nvdec": [], "opencv": []}
    for name, det in (("nvdec", nvdec), ("opencv", opencv)):
        summary = predict_streams(det, [str(clip), str(clip)], lambda line, name=name: events[name].append(json.loads(line)),
                                  params, vid_stride=8)
        assert summary.frames == 2 * len(range(0, total, 8)) and not summary.failed, (name, summary, total)
    assert not [r.message for r in caplog.records if "NVDEC cannot read" in r.message]  # no source fell back
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
    assert n_a >= len(key) and f1(tp, n_a, n_b) == 1.0, (f1(tp, n_a, n_b), tp, n_a, n_b)


def test_buckets_captured_while_nvdec_threads_decode(gpu, pipe, clip):
    """Issue #36's failure: NVDEC readers decode (and copy their frames out) on four threads
    while every bucket's NV12 and image graphs are captured again, three times over (each larger
    frame size grows the staging: new addresses); no capture fails, the readers read on after
    them (their decode calls wait at the device's gate while a warm-up captures: on the H200 a
    warm-up once let none through), and the graphs captured then answer as the ones before did."""
    params = DetectParams(conf=gpu.CONF, iou=gpu.IOU)
    frames = nvdec_frames(clip, 8)
    before = pipe.run(frames, params).images
    stop, decoded, errors = threading.Event(), [0], []

    def decode() -> None:
        try:
            while not stop.is_set():
                cap = NvdecCapture(str(clip), device=cuda_device(0))
                try:
                    while not stop.is_set() and cap.grab():
                        decoded[0] += 1
                finally:
                    cap.release()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=decode, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        while decoded[0] < 16:  # the readers are decoding
            assert not errors, errors
            threading.Event().wait(0.01)
        for height, width in ((1088, 1920), (1440, 2560), (2160, 3840)):
            pipe.warmup(nv12=True, frame_size=(height, width))  # grows every slot: all its graphs again
            pipe.warmup()
        after_captures, deadline = decoded[0], time.monotonic() + 60
        while decoded[0] < after_captures + 16:  # the readers go on
            assert not errors and time.monotonic() < deadline, errors
            threading.Event().wait(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    after = pipe.run(frames, params).images
    for (rows_a, _), (rows_b, _) in zip(before, after):
        np.testing.assert_array_equal(rows_a, rows_b)

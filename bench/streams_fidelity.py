"""NVDEC's frames against OpenCV's decode of the same clip, on a GPU with PyNvVideoCodec: the row of
``bench/streams.py``'s ``fidelity`` mode,
``{"mode": "nvdec_fidelity", "clip", "frames", "pixels_equal_pct", "f1_vs_opencv", ...}``.

NVDEC's frames, read as videos and streams read them (``app.predict.sources.NvdecCapture``),
through the NV12 letterbox kernel at the model's size, against OpenCV's frames through the CPU
letterbox: ``pixels_equal_pct`` is the share of the model input's values that are equal; and both
frame sets through the GPU pipeline: ``f1_vs_opencv`` (IoU 0.5, same class). On a CPU the same
conversion is held to OpenCV's frames by the tests (``tests/unit/imaging/test_yuv.py``,
``tests/kernels/test_nv12_kernel.py``).
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from app.boxes import f1, match_pairs

CONF, IOU = 0.25, 0.7


def opencv_frames(clip: Path, limit: int | None = None) -> list[np.ndarray]:
    cap, frames = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG), []
    while (limit is None or len(frames) < limit) and (got := cap.read())[0]:
        frames.append(got[1])
    cap.release()
    return frames


def detections_f1(detector, reference: list, candidate: list, batch: int = 8) -> tuple[float, int, int]:
    """F1 of ``candidate``'s detections against ``reference``'s, frame by frame, and both counts."""
    params = detector.params(conf=CONF, iou=IOU)
    tp = n_ref = n_cand = 0
    for k in range(0, len(reference), batch):
        ref = detector.detect(reference[k : k + batch], params)
        cand = detector.detect(candidate[k : k + batch], params)
        for a, b in zip(ref, cand):
            da, db = a.detections, b.detections
            tp += len(match_pairs(da.boxes, da.class_ids, db.boxes, db.class_ids, iou_thr=0.5))
            n_ref, n_cand = n_ref + len(da), n_cand + len(db)
    return round(f1(tp, n_ref, n_cand), 4), n_ref, n_cand


def gpu_row(clip: Path, detector, *, limit: int | None) -> dict:
    import torch
    from numba import cuda

    from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox
    from app.gpu.nv12_input import Nv12Layout
    from app.imaging.letterbox import letterbox, letterbox_params, to_input
    from app.imaging.yuv import swscale_constants
    from app.predict.sources import NvdecCapture

    reference = opencv_frames(clip, limit)
    cap, frames = NvdecCapture(str(clip), device=detector.cuda), []
    while len(frames) < len(reference) and (batch := cap.read(8)):
        frames.extend(batch)
    cap.release()
    size = detector.meta.imgsz
    out = cuda.device_array((1, 3, size, size), np.float32)
    equal = total = 0
    for frame, ref in zip(frames, reference):
        planes = frame.planes
        row = np.zeros((1, NV12_PARAMS), np.int64)
        fill_nv12_params(row[0], letterbox_params(frame.height, frame.width, size), 0, planes.stride(0),
                         planes.shape[0] * 2 // 3, swscale_constants(frame.colorspace, frame.full_range))
        span = Nv12Layout(planes.shape[0], planes.shape[1], planes.stride(0)).span
        launch_nv12_letterbox(cuda.as_cuda_array(torch.as_strided(planes, (span,), (1,))), cuda.to_device(row), out, 1)
        cuda.synchronize()
        expected = to_input([letterbox(ref, size)[0]])[0]
        equal += int(np.count_nonzero(out.copy_to_host()[0] == expected))
        total += expected.size
    score, n_ref, n_ours = detections_f1(detector, reference[: len(frames)], frames)
    first = frames[0] if frames else None
    return {"mode": "nvdec_fidelity", "device": "gpu", "clip": clip.name, "frames": len(frames),
            "width": reference[0].shape[1], "height": reference[0].shape[0],
            "colorspace": first.colorspace if first else None, "full_range": first.full_range if first else None,
            "pixels_equal_pct": round(100.0 * equal / total, 6) if total else None,
            "method": "NVDEC frames (NvdecCapture) through the NV12 letterbox kernel against cv2.VideoCapture's "
                      "frames through the CPU letterbox: the model input's values",
            "f1_vs_opencv": score, "f1_frames": len(frames), "boxes_opencv": n_ref, "boxes_nvdec": n_ours,
            "f1_model": f"{detector.info()['backend']} {detector.info()['precision']} {size}"}

"""NVDEC's frames against OpenCV's decode of the same clip: one row per clip,
``{"mode": "nvdec_fidelity", "clip", "frames", "pixels_equal_pct", "f1_vs_opencv", ...}``.

On a GPU with PyNvVideoCodec (``--device gpu``): NVDEC's frames, read as videos and streams read
them (``app.predict.sources.NvdecCapture``), through the NV12 letterbox kernel at the model's
size, against OpenCV's frames through the CPU letterbox: ``pixels_equal_pct`` is the share of
the model input's values that are equal; and both frame sets through the GPU pipeline:
``f1_vs_opencv`` (IoU 0.5, same class).

On a CPU (``--device cpu``, the proof before the GPU's): FFmpeg's own YUV planes of the clip
(PyAV; H.264 decoding is exact, so they are the bytes NVDEC decodes to) converted with the NV12
kernel's arithmetic (``app.imaging.yuv``, the host reference tests/kernels/test_nv12_kernel.py
holds the kernel to) against OpenCV's BGR frames, every pixel of every frame
(``pixels_equal_pct``); the kernel itself in Numba's CUDA simulator on ``--kernel-frames``
frames letterboxed to ``--kernel-size`` (``kernel_pixels_equal_pct``: the simulator runs each
CUDA thread in Python, hence the small size); both frame sets through the CPU model on every
``--f1-stride``-th frame (``f1_vs_opencv``).

    python3 bench/streams_fidelity.py --device cpu --clip clip.mp4 --out fidelity.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without `pip install -e`

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


def cpu_row(clip: Path, detector, *, kernel_frames: int, kernel_size: int, f1_stride: int, limit: int | None) -> dict:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    import av

    from app.imaging.yuv import swscale_constants, yuv420_to_bgr

    cap = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG)
    kept: list[tuple[np.ndarray, np.ndarray, tuple]] = []  # every f1_stride-th: (OpenCV's, ours, planes)
    count = equal = total = 0
    colour: tuple[int, bool] | None = None
    shape = None
    with av.open(str(clip)) as container:
        for frame in container.decode(video=0):  # both decoders in step, one frame at a time
            ok, reference = cap.read()
            if not ok or (limit is not None and count >= limit):
                break
            y, u, v = (np.frombuffer(p, np.uint8).reshape(-1, p.line_size)[: p.height, : p.width] for p in frame.planes)
            colour = (int(frame.colorspace), frame.color_range == 2 or frame.format.name.startswith("yuvj"))
            bgr = yuv420_to_bgr(y, u, v, swscale_constants(*colour))
            equal += int(np.count_nonzero(bgr == reference)) if bgr.shape == reference.shape else 0
            total += reference.size
            shape = reference.shape
            if count % f1_stride == 0:
                kept.append((reference, bgr, (y.copy(), u.copy(), v.copy(), colour)))
            count += 1
    cap.release()
    row = {"mode": "nvdec_fidelity", "device": "cpu", "clip": clip.name, "frames": count,
           "width": shape[1] if shape else None, "height": shape[0] if shape else None,
           "colorspace": colour[0] if colour else None, "full_range": colour[1] if colour else None,
           "pixels_equal_pct": round(100.0 * equal / total, 6) if total else None,
           "method": "FFmpeg's YUV planes (PyAV) converted with the NV12 kernel's arithmetic (app.imaging.yuv) "
                     "against cv2.VideoCapture's BGR frames, every pixel of every frame"}
    t0 = time.perf_counter()
    picks = sorted({round(x) for x in np.linspace(0, len(kept) - 1, kernel_frames)}) if kernel_frames and kept else []
    same = [kernel_equal(*kept[k][2], kept[k][0], kernel_size) for k in picks]
    if same:
        row.update(kernel_pixels_equal_pct=round(100.0 * sum(s[0] for s in same) / sum(s[1] for s in same), 6),
                   kernel_frames=[k * f1_stride for k in picks], kernel_size=kernel_size,
                   kernel_s=round(time.perf_counter() - t0, 1))
    score, n_ref, n_ours = detections_f1(detector, [k[0] for k in kept], [k[1] for k in kept])
    row.update(f1_vs_opencv=score, f1_frames=len(kept), boxes_opencv=n_ref, boxes_nvdec_arithmetic=n_ours,
               f1_model=f"{detector.info()['backend']} {detector.info()['precision']} {detector.meta.imgsz}")
    return row


def kernel_equal(y, u, v, colour, reference: np.ndarray, size: int) -> tuple[int, int]:
    """The NV12 letterbox kernel (the simulator here) on the planes laid out as NVDEC's NV12
    surface, against OpenCV's frame through the CPU letterbox: (equal values, values)."""
    from numba import cuda

    from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox
    from app.imaging.letterbox import letterbox, letterbox_params, to_input
    from app.imaging.yuv import swscale_constants

    h, w = y.shape
    pitch = (w + 1) // 2 * 2 + 64  # rows padded, as a decoder's surface
    coded_h = (h + 1) // 2 * 2
    surface = np.full((coded_h * 3 // 2, pitch), 7, np.uint8)
    surface[:h, :w] = y
    uv = surface[coded_h:, : 2 * u.shape[1]]
    uv[: u.shape[0], 0::2], uv[: v.shape[0], 1::2] = u, v
    row = np.zeros((1, NV12_PARAMS), np.int64)
    fill_nv12_params(row[0], letterbox_params(h, w, size), 0, pitch, coded_h, swscale_constants(*colour))
    out = cuda.device_array((1, 3, size, size), np.float32)
    launch_nv12_letterbox(cuda.to_device(surface.reshape(-1)), cuda.to_device(row), out, 1)
    expected = to_input([letterbox(reference, size)[0]])[0]
    got = out.copy_to_host()[0]
    return int(np.count_nonzero(got == expected)), expected.size


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


def fidelity_rows(clips: list[Path], detector, *, device: str, kernel_frames: int = 2, kernel_size: int = 48,
                  f1_stride: int = 10, limit: int | None = None, log=print) -> list[dict]:
    rows = []
    for clip in clips:
        t0 = time.perf_counter()
        try:
            if device == "gpu":
                row = gpu_row(clip, detector, limit=limit)
            else:
                row = cpu_row(clip, detector, kernel_frames=kernel_frames, kernel_size=kernel_size,
                              f1_stride=f1_stride, limit=limit)
        except Exception as exc:  # noqa: BLE001 - a row that says why, not the end of the run
            row = {"mode": "nvdec_fidelity", "device": device, "clip": clip.name, "error": f"{type(exc).__name__}: {exc}"}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        log(json.dumps(row))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip", type=Path, action="append", required=True, help="repeat for more clips")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--weights", default="sample")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--kernel-frames", type=int, default=2, help="cpu: frames through the kernel in the simulator")
    ap.add_argument("--kernel-size", type=int, default=48, help="cpu: the simulator's model size")
    ap.add_argument("--f1-stride", type=int, default=10, help="cpu: every N-th frame through the model")
    ap.add_argument("--frames", type=int, default=None, help="at most this many frames a clip")
    ap.add_argument("--out", type=Path, default=Path("nvdec-fidelity.json"))
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    from app.benchmark.machine import machine_info, versions
    from app.contracts import RunShape
    from app.runtime import OpenOptions, ensure_artifacts, open_model_dir

    backend = "onnxruntime" if args.device == "cpu" else "auto"
    options = OpenOptions(args.weights, backend=backend, imgsz=args.imgsz, shape=RunShape(max_batch=8))
    with open_model_dir(ensure_artifacts(options), options) as detector:
        rows = fidelity_rows(args.clip, detector, device=args.device, kernel_frames=args.kernel_frames,
                             kernel_size=args.kernel_size, f1_stride=args.f1_stride, limit=args.frames)
    doc = {"machine": machine_info(gpu=args.device == "gpu"), "versions": versions(("opencv-python", "av", "numpy")),
           "config": {"weights": args.weights, "imgsz": args.imgsz, "conf": CONF, "iou": IOU}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Entropy vs max vs percentile INT8 calibration of the sample model, on the CPU.

Calibration images: video frames of dance.avi (sampled evenly) plus some photos; held-out
images: other photos only (never video frames, never calibrated on). For each method: time
the calibration, write both Q/DQ models from the same ranges, and compare each with FP32 on
the held-out photos through the real CPU pipeline. Also times one image of calibration to
extrapolate 512 images, and the CPU latency of FP32 vs each INT8 model at batch 1.

    .venv/bin/python bench/int8_calibration.py [--data ../shared/data] [--frames 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

if __package__ in (None, ""):  # `python bench/int8_calibration.py`: make the repo importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.builder import quantize as qz
from app.builder.export import export_onnx
from app.builder.int8_report import compare_models, detect_all
from app.imaging.decode import decode_image
from app.benchmark.machine import machine_info, versions

ASSETS = Path(__import__("ultralytics").__file__).parent / "assets"


def video_frames(path: Path, count: int) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(path))
    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    frames = []
    for index in np.linspace(0, total - 1, count).astype(int):
        cap.set(cv2.CAP_PROP_POS_FRAMES, int(index))
        ok, frame = cap.read()
        if ok:
            # The JPEG round trip a saved frame would go through, decoded like a served image.
            frames.append(decode_image(cv2.imencode(".jpg", frame)[1].tobytes()))
    cap.release()
    return frames


def latency_ms(onnx_path: Path, runs: int = 10) -> float:
    from app.backends.onnxruntime import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(onnx_path)
    x = np.random.default_rng(0).random((1, 3, 640, 640), dtype=np.float32)
    backend.infer(x)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        backend.infer(x)
        times.append((time.perf_counter() - t) * 1e3)
    backend.close()
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--heldout", type=int, default=12, help="photos held out (the rest calibrate)")
    ap.add_argument("--methods", default="entropy,max,percentile")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()

    exported = export_onnx("sample")
    onnx_path, meta = exported.onnx_path, exported.meta
    photos = sorted((args.data / "images").glob("*.jpg")) + sorted(ASSETS.glob("*.jpg"))
    # Every other photo held out, from a fixed order, so both sets hold COCO and asset photos.
    rng = np.random.default_rng(0)
    order = [photos[i] for i in rng.permutation(len(photos))]
    held_paths, calib_photo_paths = sorted(order[: args.heldout]), sorted(order[args.heldout :])
    _, held_images = qz.read_images(held_paths)
    _, calib_photos = qz.read_images(calib_photo_paths)
    frames = video_frames(args.data / "video" / "dance.avi", args.frames)
    calib_images = calib_photos + frames
    names = [p.name for p in held_paths]
    print(f"calibration: {len(calib_photos)} photos + {len(frames)} video frames; held out: {len(held_images)} photos")

    fp32_dets = detect_all(onnx_path, meta, held_images, precision="fp32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for method in args.methods.split(","):
            t0 = time.perf_counter()
            ranges = qz.collect_ranges(onnx_path, meta.input_name, calib_images, method, imgsz=meta.imgsz)
            t_calib = time.perf_counter() - t0
            from onnxruntime.quantization.calibrate import save_tensors_data

            cache = tmp / f"{method}.json"
            save_tensors_data(ranges, cache)
            # Per-image cost vs fixed cost: one more image through the same collector setup.
            t0 = time.perf_counter()
            qz.collect_ranges(onnx_path, meta.input_name, calib_images[:4], method, imgsz=meta.imgsz)
            t_four = time.perf_counter() - t0
            per_image = (t_calib - t_four) / (len(calib_images) - 4)
            fixed = t_calib - per_image * len(calib_images)
            row = {
                "method": method,
                "calibration_images": len(calib_images),
                "calibration_s": round(t_calib, 1),
                "per_image_s": round(per_image, 3),
                "fixed_s": round(fixed, 1),
                "extrapolated_512_s": round(fixed + 512 * per_image, 0),
            }
            for target, fname in (("tensorrt", "model.int8.onnx"), ("cpu", "model.int8-cpu.onnx")):
                out = tmp / f"{method}-{fname}"
                qz.write_qdq_model(onnx_path, out, cache, method, target=target)
                report, _ = compare_models(onnx_path, out, meta, held_images, names, fp32_detections=fp32_dets)
                row[target] = {
                    "f1": round(report.f1, 4),
                    "fp32_boxes": report.fp32_boxes,
                    "int8_boxes": report.int8_boxes,
                    "matched": report.matched,
                    "mean_iou": round(report.mean_iou, 4),
                    "mean_score_drift": round(report.mean_score_drift, 4),
                    "max_score_drift": round(report.max_score_drift, 4),
                    "lost_all": report.lost_all,
                    "ort_cpu_latency_ms_b1": round(latency_ms(out), 1),
                }
            rows.append(row)
            print(json.dumps(row))
    result = {
        "bench": "int8-calibration-cpu",
        "date": dt.date.today().isoformat(),
        "machine": {**machine_info(), "note": "CPU shared with other work; ONNX Runtime CPUExecutionProvider"},
        "model": "sample (YOLOv8s-size, 2 classes), imgsz 640",
        "versions": versions(("onnxruntime", "onnx", "numpy", "opencv-python-headless")),
        "calibration_set": f"{len(calib_photos)} photos + {len(frames)} frames of dance.avi",
        "heldout_set": names,
        "fp32_ort_cpu_latency_ms_b1": round(latency_ms(onnx_path), 1),
        "settings": {"entropy_bins": qz.ENTROPY_NUM_BINS, "entropy_quantized_bins": qz.ENTROPY_QUANTIZED_BINS,
                     "percentile": qz.PERCENTILE, "histogram_sample_stride": qz.HISTOGRAM_SAMPLE_STRIDE,
                     "float_nodes": "head tail + the head's 6 last Convs (cv2.*.2, cv3.*.2)", "match_iou": 0.5, "conf": 0.25, "nms_iou": 0.7},
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{result['date']}-int8-calibration-cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Small real YOLOv8 exports for the distillation tests, and their two Q/DQ models written by the
calibration code itself: Ultralytics' ``yolov8n.yaml`` (random weights, seed 0) at 64 pixels for
the numerics, the sample model at 128 pixels (trained weights: real scores on real photos) for
training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from app.builder.int8 import graph, thresholds
from app.builder.int8.histograms import ActivationHistograms
from app.builder.int8.qdq import write_qdq_model
from app.builder.int8.report import OrtModel
from app.builder.int8.shift import shift_activations

IMGSZ = 64


SAMPLE_IMGSZ = 128


def tiny_export(root: Path, weights: str = "yolov8n.yaml", imgsz: int = IMGSZ) -> Path:
    from app.builder.export import export_onnx

    return export_onnx(weights, imgsz=imgsz, artifacts_dir=root).onnx_path


def photos(assets_dir: Path, imgsz: int, count: int) -> list[np.ndarray]:
    """``count`` letterboxed views (crops, mirrors, scales) of bus.jpg and zidane.jpg."""
    import cv2

    from app.imaging.letterbox import letterbox

    out = []
    for k in range(count):
        img = cv2.imread(str(assets_dir / ("bus.jpg", "zidane.jpg")[k % 2]))
        h, w = img.shape[:2]
        f = 0.55 + 0.45 * ((k * 37) % 10) / 10
        y, x = int((h - h * f) * ((k * 13) % 7) / 6), int((w - w * f) * ((k * 29) % 5) / 4)
        view = img[y : y + int(h * f), x : x + int(w * f)]
        out.append(letterbox(view[:, ::-1] if k % 3 == 0 else view, imgsz)[0])
    return out


def random_inputs(seed: int, count: int, batch: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((batch, 3, IMGSZ, IMGSZ), dtype=np.float32) for _ in range(count)]


def qdq_models(fp32_path: Path, out: Path, inputs: list[np.ndarray] | None = None) -> dict[str, onnx.ModelProto]:
    """Both targets' Q/DQ models of ``fp32_path`` as ``calibrate`` writes them (mse ranges, SiLU-fitted
    pre-activations, the head tail float; the TensorRT model shifted), calibrated on ``inputs``
    (model inputs; default: random images)."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    model = onnx.load(str(fp32_path))
    tensors = graph.activation_tensors(model)
    session = OrtModel(graph.augmented_model(model, tensors).SerializeToString())
    collector = ActivationHistograms()
    for x in inputs or random_inputs(100, 4):
        for name, values in zip(tensors, session.run(x)):
            collector.add(name, values)
    histograms = collector.finish()
    floats = graph.float_nodes(model)
    models = {}
    for target in ("tensorrt", "cpu"):
        ranges = thresholds.silu_preactivation_ranges(
            thresholds.compute_ranges(histograms, "mse", full_range=["images"], own_range=target == "tensorrt"),
            graph.silu_pairs(model))
        ranges_path = out / f"ranges-{target}.json"
        save_tensors_data(thresholds.to_tensors_data(ranges, "mse"), ranges_path)
        path = write_qdq_model(fp32_path, out / f"{target}.onnx", ranges_path, "mse", target=target, float_nodes=floats)
        written = onnx.load(str(path))
        models[target] = shift_activations(written, ranges)[0] if target == "tensorrt" else written
    return models

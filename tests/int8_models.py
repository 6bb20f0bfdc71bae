"""A tiny real YOLOv8 for the distillation tests: Ultralytics' ``yolov8n.yaml`` (random weights, seed 0)
exported at 64 pixels, and its two Q/DQ models written by the calibration code itself."""

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


def tiny_export(root: Path) -> Path:
    from app.builder.export import export_onnx

    return export_onnx("yolov8n.yaml", imgsz=IMGSZ, artifacts_dir=root).onnx_path


def random_inputs(seed: int, count: int, batch: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((batch, 3, IMGSZ, IMGSZ), dtype=np.float32) for _ in range(count)]


def qdq_models(fp32_path: Path, out: Path) -> dict[str, onnx.ModelProto]:
    """Both targets' Q/DQ models of ``fp32_path`` as ``calibrate`` writes them (mse ranges, SiLU-fitted
    pre-activations, the head tail float; the TensorRT model shifted)."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    model = onnx.load(str(fp32_path))
    tensors = graph.activation_tensors(model)
    session = OrtModel(graph.augmented_model(model, tensors).SerializeToString())
    collector = ActivationHistograms()
    for x in random_inputs(100, 4):
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

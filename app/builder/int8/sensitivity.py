"""Which Convs lose the most agreement when quantized, and mixed precision that keeps them float.

Sensitivity: for each Conv alone quantized (every other layer float) on a few held-out images,
the agreement with FP32 that is lost: 1 - F1 at conf 0.1 (more boxes than at 0.25, so finer
grained) and the mean |Δ class score| over the anchors either model scores above 0.05 (a
continuous tie-break). A few images and one ORT session per layer keep it affordable on a small
CPU; only Convs are studied: they carry the weights and all but ~0.1 % of the FLOPs.

Mixed precision: the most sensitive Convs are kept float one by one, most sensitive first, until
the gate passes on the whole held-out set or the cap on float layers is reached. What that
costs: the float layers' share of the FLOPs (on TensorRT they run in FP16/FP32 instead of INT8,
~2x the time per FLOP), and the CPU model's measured latency with and without them.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from app.builder.int8.qdq import write_qdq_model
from app.builder.int8.report import LOW_CONF, HeldOut, OrtModel, above, agreement, detect
from app.boxes import f1
from app.imaging.letterbox import to_input

SENSITIVITY_IMAGES = 8
MAX_FLOAT_LAYERS = 6
SCORE_FLOOR = 0.05


@dataclass
class LayerSensitivity:
    layer: str
    f1_lost: float  # 1 - F1 at conf 0.1 with only this layer quantized
    score_error: float  # mean |Δ class score| where either model scores above 0.05
    gflops: float

    def to_json(self) -> dict:
        return {k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _class_scores(session: OrtModel, subset: HeldOut) -> np.ndarray:
    return np.stack([session.run(to_input([img]))[0][0, 4:] for img in subset.images])


def layer_sensitivity(onnx_path: Path, ranges_path: Path, method: str, layers: Sequence[str], subset: HeldOut,
                      flops: dict[str, int], *, float_nodes: Sequence[str] = (), progress: Callable = iter,
                      ) -> list[LayerSensitivity]:
    """Each of ``layers`` alone quantized (TensorRT placement), most sensitive first."""
    fp32 = OrtModel(onnx_path)
    fp32_dets = [above(d, LOW_CONF) for d in detect(fp32, subset)]
    fp32_scores = _class_scores(fp32, subset)
    out = []
    with tempfile.TemporaryDirectory(prefix="yolopipe-sensitivity-") as tmp:
        path = Path(tmp) / "one-layer.onnx"
        for layer in progress(layers):
            write_qdq_model(onnx_path, path, ranges_path, method, target="tensorrt", float_nodes=float_nodes,
                            nodes_to_quantize=[layer])
            session = OrtModel(path)
            dets = [above(d, LOW_CONF) for d in detect(session, subset)]
            scores = _class_scores(session, subset)
            per_image, _, _ = agreement(subset.names, fp32_dets, dets)
            agree = f1(sum(a.matched for a in per_image), sum(a.fp32_boxes for a in per_image),
                       sum(a.int8_boxes for a in per_image))
            busy = np.maximum(scores, fp32_scores) > SCORE_FLOOR
            error = float(np.abs(scores - fp32_scores)[busy].mean()) if busy.any() else 0.0
            out.append(LayerSensitivity(layer, 1.0 - agree, error, flops.get(layer, 0) / 1e9))
    return sorted(out, key=lambda s: (s.f1_lost, s.score_error), reverse=True)


def cpu_latency_ms(model: Path, imgsz: int, runs: int = 10) -> float:
    """Median batch-1 latency of ``model`` in ONNX Runtime on this CPU."""
    session = OrtModel(model)
    x = np.random.default_rng(0).random((1, 3, imgsz, imgsz), dtype=np.float32)
    session.run(x)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(x)
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def flops_share(layers: Sequence[str], flops: dict[str, int]) -> float:
    total = sum(flops.values())
    return sum(flops.get(layer, 0) for layer in layers) / total if total else 0.0


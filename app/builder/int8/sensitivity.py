"""Which Convs cost the most agreement when quantized, and mixed precision that keeps them float.

Sensitivity: in the written INT8 model (TensorRT placement, run in ONNX Runtime), each Conv in
turn alone is kept float (its input and weight read straight from their float sources, every
other Q/DQ untouched), on a few held-out images: how much agreement with FP32 comes back. The
agreement is F1 at conf 0.1 (more boxes than at 0.25, so finer grained) and, as a continuous
tie-break, the mean |Δ class score| over the anchors either model scores above 0.05. Rewiring
the written model (instead of writing one per layer) and a few images keep it affordable on a
small CPU; only Convs are studied: they carry the weights and all but ~0.1 % of the FLOPs.

Mixed precision (``calibration.py``): the most sensitive Convs are kept float one by one, most
sensitive first, in rewritten models, until the gate passes on the whole held-out set or the
cap on float layers is reached. What that costs: the float layers' share of the FLOPs (on
TensorRT they run in FP16/FP32 instead of INT8, ~2x the time per FLOP) and, in the bench, the
CPU model's measured latency with and without them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from app.boxes import f1, nms_numpy, rows_to_detections
from app.builder.int8.report import LOW_CONF, MAP_PARAMS, HeldOut, OrtModel, above, agreement
from app.imaging.letterbox import to_input

SENSITIVITY_IMAGES = 8
MAX_FLOAT_LAYERS = 6
SCORE_FLOOR = 0.05


@dataclass
class LayerSensitivity:
    layer: str
    f1: float  # F1 at conf 0.1 vs FP32 with only this Conv float
    score_error: float  # mean |Δ class score| where either model scores above 0.05
    gflops: float

    def to_json(self) -> dict:
        return {k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(self).items()}


def keep_float(qdq_model, layer: str):
    """A copy of a Q/DQ model where ``layer`` reads its float input and weight (its DQs bypassed)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(qdq_model)
    producer = {o: n for n in out.graph.node for o in n.output}
    node = next(n for n in out.graph.node if n.name == layer)
    for k in range(min(2, len(node.input))):
        dq = producer.get(node.input[k])
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        q = producer.get(dq.input[0])
        if q is not None and q.op_type == "QuantizeLinear":
            node.input[k] = q.input[0]
    return out


def _scores_and_detections(session: OrtModel, subset: HeldOut):
    """Class scores of every anchor and the detections above conf 0.1, from one run per image."""
    scores, dets = [], []
    for image, lb in zip(subset.images, subset.placements):
        head = session.run(to_input([image]))[0][0]
        scores.append(head[4:])
        dets.append(above(rows_to_detections(nms_numpy(head, MAP_PARAMS), lb), LOW_CONF))
    return np.stack(scores), dets


def layer_sensitivity(fp32_path: Path, qdq_path: Path, layers: Sequence[str], subset: HeldOut,
                      flops: dict[str, int], *, progress: Callable = iter) -> tuple[float, list[LayerSensitivity]]:
    """The INT8 model's F1 at conf 0.1 on ``subset``, and each layer alone kept float, most
    sensitive (most agreement back) first."""
    import onnx

    fp32_scores, fp32_dets = _scores_and_detections(OrtModel(fp32_path), subset)
    qdq = onnx.load(str(qdq_path))

    def measure(session: OrtModel) -> tuple[float, float]:
        scores, dets = _scores_and_detections(session, subset)
        per_image, _, _ = agreement(subset.names, fp32_dets, dets)
        agree = f1(sum(a.matched for a in per_image), sum(a.fp32_boxes for a in per_image),
                   sum(a.int8_boxes for a in per_image))
        busy = np.maximum(scores, fp32_scores) > SCORE_FLOOR
        return agree, float(np.abs(scores - fp32_scores)[busy].mean()) if busy.any() else 0.0

    base_f1, _ = measure(OrtModel(qdq_path))
    out = []
    for layer in progress(layers):
        agree, error = measure(OrtModel(keep_float(qdq, layer).SerializeToString()))
        out.append(LayerSensitivity(layer, agree, error, flops.get(layer, 0) / 1e9))
    return base_f1, sorted(out, key=lambda s: (-s.f1, s.score_error))


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


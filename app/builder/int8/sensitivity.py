"""Which Convs cost the most agreement when quantized, and mixed precision that reverts them.

Measured on the model being installed, each the way its runtime can revert a layer:

* the TensorRT model (Q/DQ on Conv inputs): the Conv alone kept float, its input and weight read
  straight from their float sources (``keep_float``); TensorRT runs it in FP16;
* the CPU model (Conv outputs quantized too, so that ORT fuses QLinearConv): the Conv's output,
  SiLU's pre-activation, kept float (``keep_preactivation_float``); its input and weight stay
  int8 and ORT runs it as a float Conv (~FP32 speed for that layer). The pre-activation's
  rounding is where the CPU model loses most against the TensorRT placement.

Each candidate in turn, every other Q/DQ untouched, on a few held-out images: the agreement is
the mean |Δ class score| over the anchors either model scores above 0.05 (continuous: on 8 images
F1 is too coarse to rank 57 layers) and, as a tie-break, F1 at conf 0.1. Rewiring the written
model (instead of writing one per layer) and a few images keep it affordable on a small CPU; only
Convs are studied: they carry the weights and all but ~0.1 % of the FLOPs.

Mixed precision (``calibration.py``): the most sensitive layers are reverted one by one in
rewired copies of the written model until the model reaches the target on the whole held-out set
or a cap is reached (a number of layers; for the CPU model also a share of the FLOPs, its latency).
The sensitivities are cached (``app.artifacts.int8.sensitivity_cache_path``): a rerun with
another option does not measure them again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from app.boxes import f1, nms_numpy, rows_to_detections
from app.builder.int8.report import LOW_CONF, MAP_PARAMS, HeldOut, OrtModel, above, agreement
from app.imaging.letterbox import to_input

SENSITIVITY_IMAGES = 8
SHORTLIST = 16  # Convs measured per model: the largest rounding-noise-to-signal ratios of 57
MAX_FLOAT_LAYERS = 6
SCORE_FLOOR = 0.05


@dataclass
class LayerSensitivity:
    layer: str
    f1: float  # F1 at conf 0.1 vs FP32 with only this Conv reverted
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


def keep_preactivation_float(qdq_model, layer: str):
    """A copy of a Q/DQ model where ``layer``'s output skips its Q→DQ pair (its consumers read the
    float Conv output); the Conv keeps its int8 input and weight, and ORT no longer fuses it."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(qdq_model)
    consumers: dict[str, list] = {}
    for n in out.graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    node = next(n for n in out.graph.node if n.name == layer)
    for q in [c for c in consumers.get(node.output[0], []) if c.op_type == "QuantizeLinear"]:
        for dq in [c for c in consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"]:
            for reader in consumers.get(dq.output[0], []):
                for k, name in enumerate(reader.input):
                    if name == dq.output[0]:
                        reader.input[k] = node.output[0]
    return out


REVERT = {"tensorrt": keep_float, "cpu": keep_preactivation_float}


def candidates(qdq_model, target: str, skip_nodes: Sequence[str] = ()) -> list[str]:
    """The Convs mixed precision can revert: quantized inputs (TensorRT) or outputs (CPU)."""
    producer = {o: n for n in qdq_model.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in qdq_model.graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    skip, out = set(skip_nodes), []
    for n in qdq_model.graph.node:
        if n.op_type != "Conv" or n.name in skip:
            continue
        if target == "cpu":
            quantized = any(r.op_type == "QuantizeLinear" for r in readers.get(n.output[0], []))
        else:
            quantized = producer.get(n.input[0]) is not None and producer[n.input[0]].op_type == "DequantizeLinear"
        if quantized:
            out.append(n.name)
    return out


def with_reverted(qdq_model, target: str, layers: Sequence[str]):
    """The Q/DQ model with ``layers`` reverted the ``target``'s way, the bypassed Q/DQ removed."""
    from app.builder.int8.graph import prune_dead

    model = qdq_model
    for layer in layers:
        model = REVERT[target](model, layer)
    if model is qdq_model:
        import onnx

        model = onnx.ModelProto()
        model.CopyFrom(qdq_model)
    return prune_dead(model)


def noise_ratios(fp32_model, histograms: dict, ranges: dict[str, tuple[float, float]], target: str,
                 layers: Sequence[str]) -> dict[str, float]:
    """Each layer's rounding noise over signal, from the calibration histograms alone: the
    quantized tensor's step² / 12 over the mean square of the activation it becomes (TensorRT: the
    Conv input, s8 symmetric, shifted when one-sided; CPU: the pre-activation, u8 over its range, against SiLU's output).
    A cheap first ranking: only the ``SHORTLIST`` highest are measured on images."""
    from app.builder.int8.graph import silu_pairs
    from app.builder.int8.shift import shift_of

    pairs = silu_pairs(fp32_model)
    nodes = {n.name: n for n in fp32_model.graph.node}
    out = {}
    for layer in layers:
        node = nodes[layer]
        tensor = node.input[0] if target == "tensorrt" else node.output[0]
        signal_tensor = tensor if target == "tensorrt" else pairs.get(tensor, tensor)
        if tensor not in ranges or signal_tensor not in histograms:
            continue
        lo, hi = ranges[tensor]
        if target == "tensorrt":
            shifted = shift_of(lo, hi)
            step = shifted[0] if shifted else max(abs(lo), abs(hi)) / 127
        else:
            step = (hi - min(lo, 0.0)) / 255
        h = histograms[signal_tensor]
        centers = (np.arange(h.counts.size) + 0.5) * h.width
        signal = float((h.counts * centers**2).sum() / max(h.counts.sum(), 1))
        out[layer] = step**2 / 12 / signal if signal > 0 else 0.0
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
                      flops: dict[str, int], *, target: str = "tensorrt", base_model=None,
                      finish: Callable | None = None,
                      progress: Callable = iter) -> tuple[float, list[LayerSensitivity]]:
    """The INT8 model's F1 at conf 0.1 on ``subset``, and each layer alone reverted (the
    ``target``'s way), most sensitive (least score error left) first. ``base_model`` and ``finish``:
    as in ``mixed.accuracy_control`` (the layer is reverted in ``base_model``, then ``finish`` runs)."""
    import onnx

    fp32_scores, fp32_dets = _scores_and_detections(OrtModel(fp32_path), subset)
    qdq = base_model if base_model is not None else onnx.load(str(qdq_path))
    finish = finish or (lambda model: model)

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
        agree, error = measure(OrtModel(finish(REVERT[target](qdq, layer)).SerializeToString()))
        out.append(LayerSensitivity(layer, agree, error, flops.get(layer, 0) / 1e9))
    return base_f1, sorted(out, key=lambda s: (s.score_error, -s.f1))


def flops_share(layers: Sequence[str], flops: dict[str, int]) -> float:
    total = sum(flops.values())
    return sum(flops.get(layer, 0) for layer in layers) / total if total else 0.0


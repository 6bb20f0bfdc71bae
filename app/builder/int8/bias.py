"""Empirical bias correction: each quantized Conv's per-channel mean output error, measured on
calibration images, taken out of its bias (Nagel et al., "Data-Free Quantization Through Weight
Equalization and Bias Correction", 2019, the empirical variant).

Rounding weights and clipping activations shifts the mean of a Conv's output channels, and the
next layers and the class scores inherit the shift. Each Conv's own share is measured against a
float twin: the FP32 model's Conv (float weight and bias, its padding) added beside it, reading the
same float tensor the quantized Conv's Q reads. Both run in one pass of the quantized model, so
the error a Conv inherits from the layers before it is not counted again (correcting with the
whole model's error instead over-corrects: every layer would also cancel what the earlier ones
already fixed).

The TensorRT model's biases are float; the CPU model's are int32 (scale = input scale × weight
scale), corrected by whole steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.builder.int8.shift import conv_input_chain

IMAGES = 16  # calibration images, spread over the set


def _float_source(producer: dict, conv) -> str | None:
    """The float tensor a quantized Conv's input was quantized from: DQ ← [Pad] ← Q ← [Sub] ← x."""
    q, sub = conv_input_chain(producer, conv)
    if q is None:
        return None
    return sub.input[0] if sub is not None else q.input[0]


def _channel_means(session, outputs: list[str], batches: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    sums: dict[str, np.ndarray] = {}
    for batch in batches:
        for name, value in zip(outputs, session.run(batch, outputs)):
            sums[name] = sums.get(name, 0.0) + value.astype(np.float64).mean(axis=(0, 2, 3))
    return {name: total / len(batches) for name, total in sums.items()}


def _apply(model, conv, delta: np.ndarray) -> None:
    """``bias -= delta``, in the bias's own representation (float, or int32 behind a DQ)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    name = conv.input[2]
    if name in inits:
        bias = numpy_helper.to_array(inits[name])
        inits[name].CopyFrom(numpy_helper.from_array((bias - delta).astype(bias.dtype), name))
        return
    dq = producer.get(name)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        return
    ints = numpy_helper.to_array(inits[dq.input[0]])
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64)
    steps = np.rint(delta / scale).astype(np.int64)
    inits[dq.input[0]].CopyFrom(numpy_helper.from_array((ints.astype(np.int64) - steps).astype(ints.dtype),
                                                        dq.input[0]))


def bias_errors(qdq_model, fp32_model, batches: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Every quantized Conv's own mean output error per channel (against its FP32 twin, see the
    module docstring) on ``batches`` (model inputs), by Conv name."""
    import onnx
    from onnx import helper

    from app.builder.int8.report import OrtModel

    producer = {o: n for n in qdq_model.graph.node for o in n.output}
    twins_of = {n.name: n for n in fp32_model.graph.node if n.op_type == "Conv"}
    fp32_inits = {i.name: i for i in fp32_model.graph.initializer}
    probe = onnx.ModelProto()
    probe.CopyFrom(qdq_model)
    del probe.graph.output[:]
    pairs = {}  # quantized Conv's output → its twin's output
    for conv in qdq_model.graph.node:
        if conv.op_type != "Conv" or len(conv.input) < 3 or not conv.input[2] or conv.name not in twins_of:
            continue
        source = _float_source(producer, conv)
        if source is None:
            continue
        twin = onnx.NodeProto()
        twin.CopyFrom(twins_of[conv.name])
        twin.name, twin.input[0], twin.output[0] = f"{conv.name}_twin", source, f"{conv.name}_twin_out"
        for k in range(1, len(twin.input)):
            init = onnx.TensorProto()
            init.CopyFrom(fp32_inits[twin.input[k]])
            init.name = twin.input[k] = f"{conv.name}_twin_{k}"
            probe.graph.initializer.append(init)
        probe.graph.node.append(twin)
        for name in (conv.output[0], twin.output[0]):
            probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
        pairs[conv.name] = (conv.output[0], twin.output[0])
    if not pairs or not batches:
        return {}
    # Unfused (basic optimisation): the CPU model's quantized Conv outputs stay readable too.
    names = [n for pair in pairs.values() for n in pair]
    means = _channel_means(OrtModel(probe.SerializeToString(), optimize=False), names, batches)
    return {conv: means[out] - means[twin] for conv, (out, twin) in pairs.items()}


def correct_biases(qdq_model, errors: dict[str, np.ndarray]):
    """A copy of ``qdq_model`` with ``errors`` (``bias_errors``) taken out of its Convs' biases;
    Convs that no longer read a quantized input (kept float since) are left alone."""
    import onnx

    model = onnx.ModelProto()
    model.CopyFrom(qdq_model)
    producer = {o: n for n in model.graph.node for o in n.output}
    for conv in model.graph.node:
        if conv.op_type == "Conv" and conv.name in errors and _float_source(producer, conv) is not None:
            _apply(model, conv, errors[conv.name])
    return model

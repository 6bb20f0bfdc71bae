"""Symmetric s8 for one-sided activations: quantize ``x - s`` instead of ``x`` (TensorRT model).

TensorRT takes only symmetric int8 activations (zero point 0). YOLOv8's SiLU outputs span
``[-0.28, T]``: s8 over ``[-T, T]`` leaves them 128 of its 255 levels. Quantizing ``x - s``, with
``s`` the middle of the tensor's range, gives them all 255 (about 2x finer steps), and the graph
stays exact in float: every reader gets ``x`` back.

* ``x → Sub(s) → Q → DQ``: the Sub is a constant pointwise op after the producer (SiLU's Mul).
* A Conv reading it: ``conv(W, x' + s) = conv(W, x') + s·ΣW`` per output channel, so ``s·ΣW``
  (with the quantized weights, as the engine runs them) goes into its bias and it reads the DQ
  directly, the DQ→Conv pair TensorRT fuses. A padded Conv would pad ``x'`` with zeros where
  ``x`` has zeros: its padding moves into an int8 ``Pad`` of the Q output with value ``-s/scale``
  (``s`` is a whole number of steps, so that value is exact), and the Conv's own pads become 0.
* Any other reader (Add, Concat, MaxPool, Resize): ``DQ → Add(s)``, exact in float; that reader
  then runs in float in TensorRT.

Only tensors whose range is one-sided enough for it to pay (``MIN_GAIN``) are shifted.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# Shift when the step shrinks by at least this factor: max(|lo|, |hi|) / ((hi - lo) / 2).
MIN_GAIN = 1.1
LEVELS = 127  # s8 symmetric: steps per side


def shift_of(lo: float, hi: float) -> tuple[float, float, int] | None:
    """``(scale, shift, k)`` for a tensor spanning ``[lo, hi]``, ``shift = k·scale``, or None when
    the range is symmetric enough already."""
    half = (hi - lo) / 2
    if half <= 0 or max(abs(lo), abs(hi)) / half < MIN_GAIN:
        return None
    scale = half / LEVELS
    k = round((hi + lo) / 2 / scale)
    return scale, k * scale, k


def conv_input_chain(producer: dict, conv) -> tuple[object | None, object | None]:
    """``(Q, Sub)`` behind a quantized Conv's input, ``DQ ← [Pad] ← Q ← [Sub(x, s)]``, as written
    above: the Q node (None if the input is not quantized) and the shift's Sub (None if unshifted)."""
    node = producer.get(conv.input[0])
    if node is None or node.op_type != "DequantizeLinear":
        return None, None
    node = producer.get(node.input[0])
    if node is not None and node.op_type == "Pad":
        node = producer.get(node.input[0])
    if node is None or node.op_type != "QuantizeLinear":
        return None, None
    sub = producer.get(node.input[0])
    return node, sub if sub is not None and sub.op_type == "Sub" and node.input[0].endswith("_shifted") else None


def _quantized_weight(model, producer: dict, inits: dict, conv) -> np.ndarray | None:
    """The Conv's weight as the engine sees it: DQ(Q(W)) (or DQ of an int8 initializer)."""
    from onnx import numpy_helper

    dq = producer.get(conv.input[1])
    if dq is None or dq.op_type != "DequantizeLinear":
        return numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64) if conv.input[1] in inits else None
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64)
    q = producer.get(dq.input[0])
    if q is not None and q.op_type == "QuantizeLinear":
        w = numpy_helper.to_array(inits[q.input[0]]).astype(np.float64)
        s = scale.reshape(-1, *([1] * (w.ndim - 1))) if scale.ndim else scale
        ints = np.clip(np.rint(w / s), -128, 127)
    elif dq.input[0] in inits:
        ints = numpy_helper.to_array(inits[dq.input[0]]).astype(np.float64)
        s = scale.reshape(-1, *([1] * (ints.ndim - 1))) if scale.ndim else scale
    else:
        return None
    return ints * s


def _attr(node, name: str, default):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def shift_activations(qdq_model, ranges: Mapping[str, tuple[float, float]]):
    """A copy of an s8 Q/DQ model with every one-sided activation quantized shifted (see the
    module docstring); returns it and ``{tensor: shift}``."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(qdq_model)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    outputs = {o.name for o in g.output}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)

    def const(name: str, value, dtype) -> str:
        g.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    before: dict[str, list] = {}  # node name → nodes to emit just before it
    after: dict[str, list] = {}  # node name → nodes to emit just after it
    shifts: dict[str, float] = {}
    for q in list(g.node):
        if q.op_type != "QuantizeLinear" or q.input[0] in inits or q.input[0] not in ranges:
            continue
        zero = inits.get(q.input[2]) if len(q.input) > 2 else None
        if zero is None or zero.data_type != onnx.TensorProto.INT8 or numpy_helper.to_array(zero).any():
            continue  # not s8 symmetric
        x = q.input[0]
        found = shift_of(*(float(v) for v in ranges[x]))
        if found is None:
            continue
        scale, s, k = found
        dqs = [c for c in consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"]
        if not dqs or any(dq.output[0] in outputs for dq in dqs):
            continue
        # Conv data inputs with a weight we can read fold the shift; everything else gets it back.
        convs = [(dq, c) for dq in dqs for c in consumers.get(dq.output[0], [])
                 if c.op_type == "Conv" and c.input[0] == dq.output[0]
                 and _attr(c, "auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
                 and _quantized_weight(model, producer, inits, c) is not None]
        shifts[x] = s
        scale_name = const(f"{x}_shifted_scale", scale, np.float32)
        shift_name = const(f"{x}_shift", s, np.float32)
        before.setdefault(q.name, []).append(helper.make_node("Sub", [x, shift_name], [f"{x}_shifted"],
                                                              name=f"{x}_Shift"))
        q.input[0], q.input[1] = f"{x}_shifted", scale_name
        for dq in dqs:
            dq.input[1] = scale_name
        folded = set()
        for dq, conv in convs:
            weight = _quantized_weight(model, producer, inits, conv)
            correction = s * weight.reshape(weight.shape[0], -1).sum(axis=1)
            bias = (numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64)
                    if len(conv.input) > 2 and conv.input[2] else np.zeros(weight.shape[0]))
            bias_name = const(f"{conv.name}_bias_shifted", bias + correction, np.float32)
            if len(conv.input) > 2:
                conv.input[2] = bias_name
            else:
                conv.input.append(bias_name)
            pads = list(_attr(conv, "pads", [0] * (2 * (weight.ndim - 2))))
            if any(pads):
                rank = weight.ndim - 2
                pad_name = const(f"{conv.name}_shift_pads", [0, 0, *pads[:rank], 0, 0, *pads[rank:]], np.int64)
                fill = const(f"{conv.name}_shift_fill", -k, np.int8)
                padded = helper.make_node("Pad", [q.output[0], pad_name, fill], [f"{conv.name}_padded_q"],
                                          name=f"{conv.name}_ShiftPad", mode="constant")
                dq_pad = helper.make_node("DequantizeLinear", [padded.output[0], *dq.input[1:]],
                                          [f"{conv.name}_padded"], name=f"{conv.name}_ShiftPad_DequantizeLinear")
                after.setdefault(dq.name, []).extend([padded, dq_pad])
                conv.input[0] = dq_pad.output[0]
                for a in conv.attribute:
                    if a.name == "pads":
                        del a.ints[:]
                        a.ints.extend([0] * len(pads))
            folded.add(conv.name)
        for dq in dqs:
            others = [c for c in consumers.get(dq.output[0], []) if c.name not in folded]
            if not others:
                continue
            back = helper.make_node("Add", [dq.output[0], shift_name], [f"{dq.output[0]}_unshifted"],
                                    name=f"{dq.output[0]}_Unshift")
            after.setdefault(dq.name, []).append(back)
            for c in others:
                for i, name in enumerate(c.input):
                    if name == dq.output[0]:
                        c.input[i] = back.output[0]
    nodes = []
    for n in g.node:
        nodes.extend(before.get(n.name, []))
        nodes.append(n)
        nodes.extend(after.get(n.name, []))
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input}
    for init in [i for i in g.initializer if i.name not in used]:  # the replaced biases and scales
        g.initializer.remove(init)
    return model, shifts

"""What the ONNX graph says: the head nodes that stay float, the tensors to calibrate, FLOPs.

Everything is found from the structure (ranks, producers, consumers), not from node names.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from app.errors import CalibrationError

# Ops whose inputs get Q/DQ in the TensorRT model (ModelOpt's INT8 placement for CNNs).
TENSORRT_OP_TYPES = ("Conv", "Add", "Concat", "MaxPool", "Resize")
# The CPU model quantizes the same ops, outputs too, so that ONNX Runtime fuses QLinearConv,
# QLinearAdd, QLinearConcat and u8 MaxPool/Resize. SiLU's Sigmoid and Mul and the C2f Split stay
# float: quantized, ORT would run them as QLinearSigmoid/QLinearMul, but each adds one more
# rounding of every activation (bench/results/*-int8-libraries-cpu.json has the measurement).
CPU_OP_TYPES = TENSORRT_OP_TYPES


def _ranks(model) -> dict[str, int]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        if vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    return ranks


def head_tail_nodes(model) -> list[str]:
    """Names of the nodes after the detection head's last convolutions, to keep float.

    YOLOv8's Detect head ends each branch (box distribution ``cv2`` and class logits ``cv3``,
    at each of the three pyramid levels) with a plain Conv. After those comes bookkeeping over
    all anchors: flatten H×W into the anchor axis (Reshape to rank 3), concat the levels, the
    DFL softmax and its fixed 16-tap conv, the distance→box decode with anchor and stride
    constants, the class sigmoid, and the final concat of box pixels (0..imgsz) with scores
    (0..1). Quantized, that last concat shares one scale between both, and with a scale fit
    for 640-pixel boxes every score rounds to 0: zero detections. The decode arithmetic is
    equally scale-sensitive, and it is cheap, so all of it stays float.

    The "flatten" nodes are the Reshapes that turn a rank-4 map into a rank-3 tensor; the tail
    is every node reachable from them, plus the non-Conv nodes between a head Conv and its
    flatten (older exports concat the box and class maps of a level before flattening).
    """
    ranks = _ranks(model)
    nodes = list(model.graph.node)
    producer = {out: n for n in nodes for out in n.output}
    consumers: dict[str, list] = {}
    for n in nodes:
        for name in n.input:
            consumers.setdefault(name, []).append(n)

    flattens = [
        n for n in nodes
        if n.op_type in ("Reshape", "Flatten") and ranks.get(n.input[0]) == 4 and ranks.get(n.output[0]) == 3
    ]
    if not flattens:
        raise CalibrationError("cannot find the detection head in this ONNX model (no rank-4 → rank-3 reshape)")
    tail: dict[str, Any] = {}
    pending = deque(flattens)
    while pending:  # everything downstream of the flattens
        node = pending.popleft()
        if node.name in tail:
            continue
        tail[node.name] = node
        for out in node.output:
            pending.extend(consumers.get(out, []))
    for node in flattens:  # and the per-level concats between the last Convs and the flattens
        up = producer.get(node.input[0])
        while up is not None and up.op_type in ("Concat", "Reshape", "Transpose") and up.name not in tail:
            tail[up.name] = up
            up = producer.get(up.input[0])
    return [n.name for n in nodes if n.name in tail]


def head_output_convs(model, tail: list[str] | None = None) -> list[str]:
    """The detection head's last Convs (``cv2.*.2`` box distributions, ``cv3.*.2`` class logits):
    the Convs outside the head tail whose outputs feed it."""
    tail_set = set(head_tail_nodes(model) if tail is None else tail)
    producer = {out: n for n in model.graph.node for out in n.output}
    found = {
        producer[name].name
        for n in model.graph.node if n.name in tail_set
        for name in n.input
        if name in producer and producer[name].name not in tail_set and producer[name].op_type == "Conv"
    }
    return [n.name for n in model.graph.node if n.name in found]


def float_nodes(model, *, head_outputs: bool = True) -> list[str]:
    """The nodes every INT8 model keeps float: the head tail and (by default) the head's last Convs.

    The six last Convs are 1×1 convs producing the box distributions and class logits, ~0.1 % of
    the FLOPs; quantized, they add score drift (bench/results/*-int8-calibration-cpu.json).
    """
    tail = head_tail_nodes(model)
    return tail + (head_output_convs(model, tail) if head_outputs else [])


def activation_tensors(model, skip_nodes: list[str] = ()) -> list[str]:
    """The float activations to calibrate: the graph input and every node output outside
    ``skip_nodes``, plus the outputs those nodes read from a calibrated node."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    float_type = onnx.TensorProto.FLOAT
    floats = {vi.name for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
              if vi.type.tensor_type.elem_type == float_type}
    initializers = {i.name for i in model.graph.initializer}
    skip = set(skip_nodes)
    wanted: list[str] = [i.name for i in model.graph.input if i.name in floats and i.name not in initializers]
    for node in model.graph.node:
        if node.name in skip:
            continue
        for name in [*node.input, *node.output]:
            if name and name in floats and name not in initializers and name not in wanted:
                wanted.append(name)
    return wanted


def silu_pairs(model) -> dict[str, str]:
    """SiLU pre-activations: ``{x: y}`` for every ``y = Mul(x, Sigmoid(x))`` (YOLOv8's activation)."""
    nodes = list(model.graph.node)
    sigmoid_of = {n.output[0]: n.input[0] for n in nodes if n.op_type == "Sigmoid"}
    pairs = {}
    for n in nodes:
        if n.op_type == "Mul" and len(n.input) == 2:
            a, b = n.input
            for x, s in ((a, b), (b, a)):
                if sigmoid_of.get(s) == x:
                    pairs[x] = n.output[0]
    return pairs


def prune_dead(model):
    """Drop the nodes whose outputs nothing reads (bypassed Q/DQ pairs) and unused initializers."""
    outputs = {o.name for o in model.graph.output}
    while True:
        read = {i for n in model.graph.node for i in n.input} | outputs
        dead = [n for n in model.graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            model.graph.node.remove(n)
    read = {i for n in model.graph.node for i in n.input} | outputs
    for init in [i for i in model.graph.initializer if i.name not in read]:
        model.graph.initializer.remove(init)
    return model


def augmented_model(model, tensors: list[str]):
    """A copy of ``model`` whose outputs are ``tensors`` (to read every activation in one run)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.output[:]
    for name in tensors:
        out.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return out


def conv_layers(model, skip_nodes: list[str] = ()) -> list[str]:
    """The Convs with a weight initializer outside ``skip_nodes``: the layers mixed precision can
    keep float (Add, Concat, MaxPool and Resize carry no weights and almost no FLOPs)."""
    initializers = {i.name for i in model.graph.initializer}
    skip = set(skip_nodes)
    return [n.name for n in model.graph.node
            if n.op_type == "Conv" and n.name not in skip and len(n.input) > 1 and n.input[1] in initializers]


def conv_flops(model) -> dict[str, int]:
    """FLOPs (2 × multiply-adds) of every Conv at batch 1, from the weights and inferred shapes."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else 1 for d in dims]
    weights = {i.name: list(i.dims) for i in model.graph.initializer}
    flops = {}
    for node in model.graph.node:
        if node.op_type != "Conv" or node.input[1] not in weights or node.output[0] not in shapes:
            continue
        c_out, c_in_per_group, *kernel = weights[node.input[1]]
        out_hw = shapes[node.output[0]][2:]
        macs = c_out * c_in_per_group
        for k in kernel:
            macs *= k
        for d in out_hw:
            macs *= d
        flops[node.name] = 2 * macs
    return flops

"""The TensorRT-bound Q/DQ model made small for the trip back from the GPU machine, and made whole again.

``model.int8.onnx`` keeps float weights behind a per-channel QuantizeLinear → DequantizeLinear
pair (44 MB for the sample model), over the 16 MiB a file may be to come back. Only the integers
that Q makes of them matter: ``pack`` stores each such weight as those int8 codes (11 MB), and
``unpack`` writes ``codes × scale`` back as float, which the same Q turns into the same codes
(``round(c·s / s) = c``), so the unpacked model computes what the packed one did, bit for bit
where it matters. ``--check`` proves it on a model: the codes of every weight are equal.

    python bench/int8_transport.py pack model.int8.onnx small.onnx
    python bench/int8_transport.py unpack small.onnx model.int8.onnx [--check model.int8.onnx]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

KEY = "yolopipe.transport.int8_weights"  # metadata: {weight name: [scale name, axis]}


def _weight_qs(model) -> dict[str, tuple[str, int]]:
    """Float weight initializers read by a per-channel QuantizeLinear: ``{name: (scale name, axis)}``."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in inits or node.input[1] not in inits:
            continue
        scale = numpy_helper.to_array(inits[node.input[1]])
        if scale.ndim == 1 and numpy_helper.to_array(inits[node.input[0]]).dtype == np.float32:
            axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 1)
            out[node.input[0]] = (node.input[1], int(axis))
    return out


def _shaped(scale: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis % ndim] = scale.shape[0]
    return scale.reshape(shape)


def codes(model) -> dict[str, np.ndarray]:
    """What each per-channel Q makes of its float weight: ONNX's round half to even, saturated."""
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return {name: np.clip(np.rint(inits[name] / _shaped(inits[scale], axis, inits[name].ndim)), -128, 127).astype(np.int8)
            for name, (scale, axis) in _weight_qs(model).items()}


def pack(src: Path, dst: Path) -> None:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    weights = _weight_qs(model)
    ints = codes(model)
    for init in model.graph.initializer:
        if init.name in ints:
            init.CopyFrom(numpy_helper.from_array(ints[init.name], init.name))
    model.metadata_props.add(key=KEY, value=json.dumps(weights))
    onnx.save(model, str(dst))


def unpack(src: Path, dst: Path) -> None:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    props = {p.key: p.value for p in model.metadata_props}
    weights = json.loads(props[KEY])
    inits = {i.name: i for i in model.graph.initializer}
    for name, (scale, axis) in weights.items():
        ints = numpy_helper.to_array(inits[name]).astype(np.float32)
        s = numpy_helper.to_array(inits[scale]).astype(np.float32)
        inits[name].CopyFrom(numpy_helper.from_array((ints * _shaped(s, axis, ints.ndim)).astype(np.float32), name))
    kept = [p for p in model.metadata_props if p.key != KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    onnx.save(model, str(dst))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("verb", choices=("pack", "unpack"))
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--check", type=Path, default=None, help="unpack: the original model, whose codes must match")
    args = ap.parse_args()
    (pack if args.verb == "pack" else unpack)(args.src, args.dst)
    if args.check:
        import onnx

        a, b = codes(onnx.load(str(args.check))), codes(onnx.load(str(args.dst)))
        same = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        print(f"{len(a)} weights, codes {'equal' if same else 'DIFFERENT'}")
        sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()

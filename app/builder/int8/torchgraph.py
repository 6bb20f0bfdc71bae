"""An ONNX Q/DQ model run in torch, differentiable, for quantization-aware distillation (``distill.py``).

The torch model *is* the written model: every node of the ONNX graph is run by the torch op
that does the same arithmetic, so the fake quantization sits exactly where the model's
QuantizeLinear/DequantizeLinear nodes are, with their own scales, zero points and integer types
(the CPU model's u8 activations and per-channel s8 weights, the TensorRT model's symmetric s8 with
its shifts and int8 ``Pad``), and nothing has to be matched up with the Ultralytics modules.

* ``QuantizeLinear``: ``clamp(round(x / scale) + zero_point)`` to the zero point's type, ONNX's
  round-half-to-even; the rounding passes gradients straight through (the straight-through
  estimator) and the clamp passes none outside the range. Values stay float tensors holding
  whole numbers, so ``Pad`` and ``DequantizeLinear`` read them as ONNX does.
* Trainable: the weights and biases of the Convs named ``trainable``. A float initializer (the
  TensorRT model's weights before their Q→DQ, float biases, float Convs) becomes a parameter as
  it is. An integer one behind a DequantizeLinear (the CPU model's s8 weights and int32 biases)
  becomes a float *latent* parameter, quantized on the fly with that DQ's own scale (weights to
  the integers the written ones span, ``±127`` or ``±64``; biases to int32), initialised from the FP32
  weight when one is given (the usual QAT start) or from the dequantized value.
* ``write_back`` puts the learned values into a copy of the ONNX model: the same numbers the
  torch model computed with, so ONNX Runtime and TensorRT run the model that was trained.

Only the nodes the requested outputs need are run (``distill.py`` asks for the head's last Convs:
the tail's reshapes are pinned to the export's image size, the Convs run at any size).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from app.builder.int8.fake_quant import fake_int, per_axis
from app.builder.int8.shift import conv_input_chain
from app.errors import CalibrationError

WEIGHT_RANGE = (-127, 127)  # the TensorRT model's float weights stay within ±127 steps of their Q (no -128)
INT_RANGES = {"INT8": (-128, 127), "UINT8": (0, 255), "INT32": (-(2**31), 2**31 - 1)}


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _type_name(tensor) -> str:
    import onnx

    return onnx.TensorProto.DataType.Name(tensor.data_type)


def _weight_range(ints: np.ndarray, inits: dict, dq) -> tuple[float, float]:
    """The integers a written weight spans, ``zero ± m``: its largest step count is the writer's bound
    (127 for s8, 64 with ONNX Runtime's ``reduce_range``), which the learned weight keeps to."""
    from onnx import numpy_helper

    zero = numpy_helper.to_array(inits[dq.input[2]]).reshape(-1)[0] if len(dq.input) > 2 and dq.input[2] else 0
    m = float(np.abs(ints.astype(np.int64) - int(zero)).max())
    return float(zero) - m, float(zero) + m


class QdqGraph:
    """A Q/DQ (or float) ONNX model as a differentiable torch function of its input.

    ``outputs``: the tensors ``__call__`` returns (the nodes they need are run, nothing else).
    ``trainable``: Conv node names whose weight and bias become parameters (``parameters()``).
    ``init_weights``: float weights and biases by Conv name (``{name: (weight, bias)}``), the
    starting point of the CPU model's latent integer weights (default: their dequantized values).
    """

    def __init__(self, model, outputs: Sequence[str], *, trainable: Iterable[str] = (),
                 init_weights: Mapping[str, tuple[np.ndarray, np.ndarray | None]] | None = None,
                 device: str = "cpu") -> None:
        import torch
        from onnx import numpy_helper

        self.model, self.outputs, self.device = model, list(outputs), torch.device(device)
        graph = model.graph
        self.inits = {i.name: i for i in graph.initializer}
        self.input_name = next(i.name for i in graph.input if i.name not in self.inits)
        self.nodes = self._needed(list(graph.node), set(self.outputs))
        producer = {o: n for n in graph.node for o in n.output}
        self.consts: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.nn.Parameter] = {}  # initializer name → parameter
        self.latent: dict[str, tuple[float, float]] = {}  # integer initializer name → its clamp range
        float_init = init_weights or {}
        wanted = set(trainable)
        for node in self.nodes:
            if node.op_type != "Conv" or node.name not in wanted:
                continue
            start = float_init.get(node.name)
            for slot, name in enumerate(node.input[1:3], start=1):
                if not name:
                    continue
                source = name
                dq = producer.get(name)
                if dq is not None and dq.op_type == "DequantizeLinear":
                    q = producer.get(dq.input[0])
                    source = q.input[0] if q is not None and q.op_type == "QuantizeLinear" else dq.input[0]
                if source not in self.inits or source in self.params:
                    continue
                array = numpy_helper.to_array(self.inits[source])
                if array.dtype.kind == "f":
                    value = array.astype(np.float32)
                else:  # an integer initializer behind a DQ: a float latent in the DQ's units
                    scale = per_axis(numpy_helper.to_array(self.inits[dq.input[1]]).astype(np.float32),
                                      _attrs(dq).get("axis", 1), array.ndim)
                    given = start[slot - 1] if start is not None and len(start) >= slot else None
                    value = (np.asarray(given, np.float32) if given is not None else array.astype(np.float32) * scale)
                    self.latent[source] = (_weight_range(array, self.inits, dq) if slot == 1
                                           else INT_RANGES[_type_name(self.inits[source])])
                self.params[source] = torch.nn.Parameter(torch.from_numpy(np.array(value, np.float32)).to(self.device))
        self.fused = self._fusable(list(graph.node))
        self.all_nodes = list(graph.node)
        self._weight_bounds: list | None = None  # clip_weights': (weight, its ±127-step bound)
        self.shifted = self._shifted_convs(producer)

    def _shifted_convs(self, producer: dict) -> dict[str, tuple[float, object]]:
        """Trainable Convs that read a shifted activation (``shift.py``): ``{name: (s, ΣW at the start)}``.

        Their bias holds ``s·ΣW`` of the quantized weights the file was written with; as the
        weights learn, the forward adds ``s·(ΣW - ΣW at the start)`` per output channel, and
        ``write_back`` writes the bias with it, so the shift stays exact in float."""
        import torch
        from onnx import numpy_helper

        out = {}
        for node in self.nodes:
            if node.op_type != "Conv" or len(node.input) < 3 or node.input[2] not in self.params:
                continue
            _, sub = conv_input_chain(producer, node)
            if sub is None or sub.input[1] not in self.inits:
                continue
            shift = float(numpy_helper.to_array(self.inits[sub.input[1]]).reshape(-1)[0])
            with torch.no_grad():
                out[node.name] = (shift, self._value(node.input[1]).sum(dim=(1, 2, 3)))
        return out

    def _value(self, name: str):
        """A tensor computed from initializers and parameters alone (a Conv's quantized weight), as
        the fused forward computes it."""
        return self._run(self._needed(self.all_nodes, {name}), {}, fused=True)[name]

    def _fusable(self, all_nodes: list) -> dict[str, list[str]]:
        """Q nodes read only by DQs of the same scale and zero point: ``{Q name: the DQs' outputs}``,
        run as one fake-quantize op (torch's fused kernel: one pass, a mask kept for the gradient)."""
        consumers: dict[str, list] = {}
        for n in all_nodes:
            for name in n.input:
                consumers.setdefault(name, []).append(n)
        fused = {}
        for q in self.nodes:
            if q.op_type != "QuantizeLinear" or len(q.input) < 3:
                continue
            readers = consumers.get(q.output[0], [])
            if readers and all(r.op_type == "DequantizeLinear" and list(r.input[1:3]) == list(q.input[1:3])
                               and _attrs(r).get("axis", 1) == _attrs(q).get("axis", 1) for r in readers):
                fused[q.name] = [r.output[0] for r in readers]
        return fused

    @staticmethod
    def _needed(nodes: list, outputs: set[str]) -> list:
        needed, wanted = [], set(outputs)
        for node in reversed(nodes):
            if any(o in wanted for o in node.output):
                needed.append(node)
                wanted.update(i for i in node.input if i)
        missing = outputs - {o for n in needed for o in n.output}
        if missing:
            raise CalibrationError(f"the ONNX model has no tensor named {min(missing)!r}")
        return needed[::-1]

    def parameters(self) -> list:
        return list(self.params.values())

    def const(self, name: str):
        import torch
        from onnx import numpy_helper

        if name not in self.consts:
            array = numpy_helper.to_array(self.inits[name])  # integers as floats: Q/DQ arithmetic is float
            self.consts[name] = torch.from_numpy(np.array(array, dtype=np.float32)).to(self.device)
        return self.consts[name]

    def ints(self, name: str) -> list[int]:
        from onnx import numpy_helper

        return [int(v) for v in numpy_helper.to_array(self.inits[name]).reshape(-1)]

    def __call__(self, x, *, fused: bool = True) -> list:
        """The ``outputs`` for the model input ``x``; ``fused``: each Q→DQ pair as one fake-quantize
        op (the same numbers as the two nodes, less memory and time for the gradient)."""
        values = self._run(self.nodes, {self.input_name: x}, fused=fused)
        return [values[name] for name in self.outputs]

    def _run(self, nodes: list, values: dict, *, fused: bool) -> dict:
        skip = {name for outs in self.fused.values() for name in outs} if fused else set()

        def get(name: str):
            if name in values:
                return values[name]
            if name in self.params:
                return self.params[name]
            return self.const(name)

        for node in nodes:
            if node.output[0] in skip:
                continue
            if fused and node.name in self.fused:
                value = self.fake_quant(node, get)
                for name in self.fused[node.name]:
                    values[name] = value
                continue
            result = self.run_node(node, get)
            for name, value in zip(node.output, result if isinstance(result, (list, tuple)) else [result]):
                values[name] = value
        return values

    def fake_quant(self, q, get):
        """``DQ(Q(x))`` of a Q node in one op (torch's ``fake_quantize_*``: the gradient passes
        inside the range, none outside)."""
        import torch

        x, scale = get(q.input[0]), get(q.input[1])
        lo, hi = INT_RANGES[_type_name(self.inits[q.input[2]])]
        zero = get(q.input[2]).round().to(torch.int32)
        if scale.ndim == 0:
            return torch.fake_quantize_per_tensor_affine(x, scale, zero, int(lo), int(hi))
        return torch.fake_quantize_per_channel_affine(x, scale, zero, _attrs(q).get("axis", 1) % x.ndim, int(lo), int(hi))

    def run_node(self, node, get):
        """One ONNX node in torch; ``get(name)`` gives its inputs (tensors, parameters, constants)."""
        import torch
        import torch.nn.functional as F

        op, a = node.op_type, _attrs(node)
        inputs = node.input
        if op == "QuantizeLinear":
            x, scale = get(inputs[0]), get(inputs[1])
            lo, hi = INT_RANGES[_type_name(self.inits[inputs[2]])] if len(inputs) > 2 else INT_RANGES["UINT8"]
            zero = get(inputs[2]) if len(inputs) > 2 else 0.0
            axis = a.get("axis", 1)
            return fake_int(x, per_axis(scale, axis, x.ndim), per_axis(zero, axis, x.ndim) if
                            torch.is_tensor(zero) else zero, lo, hi)
        if op == "DequantizeLinear":
            q, scale = get(inputs[0]), get(inputs[1])
            zero = get(inputs[2]) if len(inputs) > 2 and inputs[2] else 0.0
            axis = a.get("axis", 1)
            scale_b = per_axis(scale, axis, q.ndim)
            zero_b = per_axis(zero, axis, q.ndim) if torch.is_tensor(zero) else zero
            if inputs[0] in self.latent:  # latent float → its integers on this DQ's grid
                q = fake_int(q, scale_b, zero_b, *self.latent[inputs[0]])
            return (q - zero_b) * scale_b
        if op == "Conv":
            x, w = get(inputs[0]), get(inputs[1])
            b = get(inputs[2]) if len(inputs) > 2 and inputs[2] else None
            if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise CalibrationError(f"distillation: Conv {node.name} uses auto_pad, which it does not run")
            pads = list(a.get("pads", [0] * 4))
            if pads[:2] != pads[2:]:
                x, pads = F.pad(x, [pads[1], pads[3], pads[0], pads[2]]), [0, 0, 0, 0]
            if b is not None and node.name in self.shifted:  # the shift's bias term follows the learned weights
                shift, start = self.shifted[node.name]
                b = b + shift * (w.sum(dim=(1, 2, 3)) - start)
            return F.conv2d(x, w, b, stride=tuple(a.get("strides", [1, 1])), padding=tuple(pads[:2]),
                            dilation=tuple(a.get("dilations", [1, 1])), groups=a.get("group", 1))
        if op == "Sigmoid":
            return torch.sigmoid(get(inputs[0]))
        if op in ("Mul", "Add", "Sub", "Div"):
            x, y = get(inputs[0]), get(inputs[1])
            return {"Mul": torch.mul, "Add": torch.add, "Sub": torch.sub, "Div": torch.div}[op](x, y)
        if op == "Concat":
            return torch.cat([get(i) for i in inputs], dim=a["axis"])
        if op == "Split":
            x = get(inputs[0])
            sizes = self.ints(inputs[1]) if len(inputs) > 1 and inputs[1] else a.get("split")
            if sizes is None:
                sizes = [x.shape[a.get("axis", 0)] // len(node.output)] * len(node.output)
            return list(torch.split(x, list(sizes), dim=a.get("axis", 0)))
        if op == "MaxPool":
            pads = list(a.get("pads", [0] * 4))
            if pads[:2] != pads[2:] or a.get("ceil_mode", 0) or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise CalibrationError(f"distillation: MaxPool {node.name} has padding it does not run")
            return F.max_pool2d(get(inputs[0]), tuple(a["kernel_shape"]), tuple(a.get("strides", [1, 1])),
                                tuple(pads[:2]), tuple(a.get("dilations", [1, 1])))
        if op == "Resize":
            return self._resize(node, a, get)
        if op == "Pad":
            x = get(inputs[0])
            pads = self.ints(inputs[1])
            value = float(self.const(inputs[2]).reshape(-1)[0]) if len(inputs) > 2 and inputs[2] else 0.0
            if a.get("mode", b"constant") not in (b"constant", "constant"):
                raise CalibrationError(f"distillation: Pad {node.name} is not a constant pad")
            rank = len(pads) // 2
            flat = [v for d in reversed(range(rank)) for v in (pads[d], pads[d + rank])]
            return F.pad(x, flat, value=value)
        if op == "Reshape":
            x, shape = get(inputs[0]), self.ints(inputs[1])
            shape = [x.shape[i] if v == 0 and not a.get("allowzero", 0) else v for i, v in enumerate(shape)]
            return x.reshape(shape)
        if op == "Transpose":
            return get(inputs[0]).permute(*a["perm"])
        if op == "Softmax":
            return torch.softmax(get(inputs[0]), dim=a.get("axis", -1))
        if op == "Identity":
            return get(inputs[0])
        raise CalibrationError(f"distillation cannot run the ONNX op {op} (node {node.name})",
                               hint="calibrate with --distill off (post-training quantization runs any model)")

    def _resize(self, node, a, get):
        import torch.nn.functional as F

        x = get(node.input[0])
        mode = a.get("mode", b"nearest")
        scales = self.ints_or_floats(node.input[2]) if len(node.input) > 2 and node.input[2] else []
        sizes = self.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else []
        if mode not in (b"nearest", "nearest") or a.get("coordinate_transformation_mode", b"half_pixel") not in (
                b"asymmetric", "asymmetric") or a.get("nearest_mode", b"round_prefer_floor") not in (b"floor", "floor"):
            raise CalibrationError(f"distillation: Resize {node.name} is not a nearest upsampling it runs")
        if scales:
            factors = [int(s) for s in scales[2:]]
            if any(f != s for f, s in zip(factors, scales[2:])):
                raise CalibrationError(f"distillation: Resize {node.name} scales by a fraction")
            return F.interpolate(x, scale_factor=tuple(float(f) for f in factors), mode="nearest")
        return F.interpolate(x, size=tuple(sizes[2:]), mode="nearest")

    def ints_or_floats(self, name: str) -> list[float]:
        from onnx import numpy_helper

        return [float(v) for v in numpy_helper.to_array(self.inits[name]).reshape(-1)]

    def clip_weights(self) -> None:
        """Keep every trainable weight read through a QuantizeLinear inside ``±127`` steps (what
        the torch model rounds to is then what ONNX Runtime and TensorRT round to)."""
        import torch

        if self._weight_bounds is None:  # the scales never change: the bounds are found once
            self._weight_bounds = []
            for node in self.nodes:
                if node.op_type == "QuantizeLinear" and node.input[0] in self.params and node.input[1] in self.inits:
                    scale = self.const(node.input[1])
                    if scale.ndim:
                        w = self.params[node.input[0]]
                        self._weight_bounds.append((w, per_axis(scale, _attrs(node).get("axis", 1), w.ndim)
                                                    * WEIGHT_RANGE[1]))
        with torch.no_grad():
            for w, bound in self._weight_bounds:
                w.copy_(torch.maximum(torch.minimum(w, bound), -bound))

    def write_back(self):
        """A copy of the ONNX model holding the learned weights and biases (latents as their integers)."""
        import onnx
        from onnx import numpy_helper

        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        inits = {i.name: i for i in out.graph.initializer}
        consumers: dict[str, list] = {}
        for n in self.model.graph.node:
            for name in n.input:
                consumers.setdefault(name, []).append(n)
        import torch

        biases = {}
        with torch.no_grad():
            for conv in self.nodes:
                if conv.name in self.shifted:
                    shift, start = self.shifted[conv.name]
                    biases[conv.input[2]] = self.params[conv.input[2]] + shift * (
                        self._value(conv.input[1]).sum(dim=(1, 2, 3)) - start)
        for name, param in self.params.items():
            value = biases.get(name, param).detach().cpu().numpy().astype(np.float32)
            old = numpy_helper.to_array(inits[name])
            if name in self.latent:
                dq = next(c for c in consumers[name] if c.op_type == "DequantizeLinear")
                scale = per_axis(numpy_helper.to_array(self.inits[dq.input[1]]).astype(np.float32),
                                  _attrs(dq).get("axis", 1), old.ndim)
                zero = (per_axis(numpy_helper.to_array(self.inits[dq.input[2]]).astype(np.float32),
                                  _attrs(dq).get("axis", 1), old.ndim) if len(dq.input) > 2 and dq.input[2] else 0.0)
                lo, hi = self.latent[name]
                value = np.clip(np.rint(value / scale) + zero, lo, hi)
            inits[name].CopyFrom(numpy_helper.from_array(value.astype(old.dtype), name))
        return out

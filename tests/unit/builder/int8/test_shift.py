"""The TensorRT model's shifted s8: exact in float, finer steps for one-sided tensors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from app.builder.int8.report import OrtModel
from app.builder.int8.shift import LEVELS, shift_activations, shift_of

LO, HI = -0.28, 3.0  # a SiLU output's range
SHAPE = [1, 2, 6, 6]


def qdq_graph(*, quantized: bool) -> onnx.ModelProto:
    """x → [s8 Q/DQ over ±HI] → a padded 3×3 Conv (y), a 1×1 Conv (u) and a MaxPool (z)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (3, 2, 3, 3)).astype(np.float32), "w3"),
             numpy_helper.from_array(rng.normal(0, 0.5, (3,)).astype(np.float32), "b3"),
             numpy_helper.from_array(rng.normal(0, 0.5, (4, 2, 1, 1)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.5, (4,)).astype(np.float32), "b1")]
    src = "x"
    nodes = []
    if quantized:
        inits += [numpy_helper.from_array(np.asarray(HI / LEVELS, np.float32), "x_scale"),
                  numpy_helper.from_array(np.asarray(0, np.int8), "x_zero_point")]
        nodes += [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero_point"], ["xq"], name="q"),
                  helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero_point"], ["xd"], name="dq")]
        src = "xd"
    nodes += [helper.make_node("Conv", [src, "w3", "b3"], ["y"], name="conv3", pads=[1, 1, 1, 1]),
              helper.make_node("Conv", [src, "w1", "b1"], ["u"], name="conv1"),
              helper.make_node("MaxPool", [src], ["z"], name="pool", kernel_shape=[2, 2])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "u", "z")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)], outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return OrtModel(model.SerializeToString(), optimize=False).session.run(None, {"x": x})


def test_shift_of_halves_the_step_of_a_one_sided_range_and_skips_symmetric_ones():
    scale, shift, k = shift_of(LO, HI)
    assert scale == pytest.approx((HI - LO) / 2 / LEVELS)  # all 255 levels over [LO, HI]
    assert scale < 0.55 * HI / LEVELS
    assert shift == pytest.approx(k * scale) and abs(shift - (HI + LO) / 2) <= scale / 2
    assert shift_of(-3.0, 3.0) is None and shift_of(-2.9, 3.0) is None


def test_the_shifted_model_is_exact_on_its_grid_where_plain_s8_rounds():
    """Values on the shifted grid pass its Q/DQ unchanged: the shifted model then gives the float
    graph's outputs exactly (padding included), so every reader got x back."""
    scale, shift, _ = shift_of(LO, HI)
    lowest, highest = int(np.ceil((LO - shift) / scale)), int(np.floor((HI - shift) / scale))
    x = (shift + np.random.default_rng(1).integers(lowest, highest + 1, SHAPE) * scale).astype(np.float32)
    shifted, shifts = shift_activations(qdq_graph(quantized=True), {"x": (LO, HI)})
    assert list(shifts) == ["x"]
    ops = [n.op_type for n in shifted.graph.node]
    assert "Pad" in ops and ops.count("Add") == 1  # the padded Conv pads in int8; MaxPool gets x back
    want = run(qdq_graph(quantized=False), x)
    for got, ref in zip(run(shifted, x), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    plain = run(qdq_graph(quantized=True), x)[0]
    assert not np.allclose(plain, want[0], atol=1e-3)  # plain s8 (step HI/127) rounds these values


def test_shifting_cuts_the_rounding_error_of_one_sided_values():
    x = np.random.default_rng(2).uniform(LO, HI, SHAPE).astype(np.float32)
    want = run(qdq_graph(quantized=False), x)
    shifted, _ = shift_activations(qdq_graph(quantized=True), {"x": (LO, HI)})
    plain_error = [np.abs(a - b).mean() for a, b in zip(run(qdq_graph(quantized=True), x), want)]
    shifted_error = [np.abs(a - b).mean() for a, b in zip(run(shifted, x), want)]
    assert all(s < 0.7 * p for s, p in zip(shifted_error, plain_error))


def test_symmetric_or_unknown_ranges_are_left_alone():
    model = qdq_graph(quantized=True)
    for ranges in ({"x": (-3.0, 3.0)}, {}):
        same, shifts = shift_activations(model, ranges)
        assert shifts == {} and [n.op_type for n in same.graph.node] == [n.op_type for n in model.graph.node]

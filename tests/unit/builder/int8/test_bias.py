"""Bias correction: each quantized Conv's own mean output error, found and taken out of its bias."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from app.builder.int8 import graph, thresholds
from app.builder.int8.bias import bias_errors, correct_biases
from app.builder.int8.histograms import ActivationHistograms
from app.builder.int8.qdq import write_qdq_model
from app.builder.int8.report import OrtModel

SHAPE = (1, 3, 12, 12)


def conv_silu_conv(path, *, weight_error: float = 0.0):
    """Conv → SiLU → Conv, with biases; ``weight_error`` added to conv2's weights (a systematic error)."""
    rng = np.random.default_rng(0)
    w2 = rng.normal(0, 0.3, (4, 6, 3, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(rng.normal(0, 0.4, (6, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.2, (6,)).astype(np.float32), "b1"),
             numpy_helper.from_array(w2 + np.float32(weight_error), "w2"),
             numpy_helper.from_array(rng.normal(0, 0.2, (4,)).astype(np.float32), "b2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"), helper.make_node("Mul", ["a", "s"], ["r"], name="mul"),
             helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def batches(seed: int, count: int = 6) -> list[np.ndarray]:
    return [np.random.default_rng(seed + k).random(SHAPE, dtype=np.float32) for k in range(count)]


def quantized(fp32_path, out, target: str):
    from onnxruntime.quantization.calibrate import save_tensors_data

    model = onnx.load(str(fp32_path))
    tensors = graph.activation_tensors(model)
    session = OrtModel(graph.augmented_model(model, tensors).SerializeToString())
    collector = ActivationHistograms()
    for x in batches(100):
        for name, values in zip(tensors, session.run(x)):
            collector.add(name, values)
    save_tensors_data(thresholds.to_tensors_data(thresholds.compute_ranges(collector.finish(), "max"), "max"),
                      out.with_suffix(".json"))
    return onnx.load(str(write_qdq_model(fp32_path, out, out.with_suffix(".json"), "max", target=target)))


def channel_mean_error(model, fp32_path, xs) -> np.ndarray:
    got = np.mean([OrtModel(model.SerializeToString(), optimize=False).run(x)[0].mean(axis=(0, 2, 3)) for x in xs], 0)
    want = np.mean([OrtModel(fp32_path).run(x)[0].mean(axis=(0, 2, 3)) for x in xs], 0)
    return np.abs(got - want)


def test_a_convs_own_mean_error_is_found_and_removed(tmp_path):
    """conv2's weights carry a systematic error (+0.05 each): its mean output error is found as
    conv2's own, not conv1's, and the corrected model's mean error on other images is a fraction."""
    fp32_path = conv_silu_conv(tmp_path / "fp32.onnx")
    skewed = quantized(conv_silu_conv(tmp_path / "skewed.onnx", weight_error=0.05), tmp_path / "q.onnx", "tensorrt")
    errors = bias_errors(skewed, onnx.load(str(fp32_path)), batches(0))
    assert set(errors) == {"conv1", "conv2"}
    assert np.abs(errors["conv2"]).mean() > 5 * np.abs(errors["conv1"]).mean()
    before = channel_mean_error(skewed, fp32_path, batches(50))
    after = channel_mean_error(correct_biases(skewed, errors), fp32_path, batches(50))
    assert after.mean() < 0.2 * before.mean()


def test_the_cpu_models_int32_biases_are_corrected_in_whole_steps(tmp_path):
    fp32_path = conv_silu_conv(tmp_path / "fp32.onnx")
    skewed = quantized(conv_silu_conv(tmp_path / "skewed.onnx", weight_error=0.05), tmp_path / "q.onnx", "cpu")
    inits = {i.name: i for i in skewed.graph.initializer}
    producer = {o: n for n in skewed.graph.node for o in n.output}
    bias_dqs = [producer[n.input[2]] for n in skewed.graph.node if n.op_type == "Conv"]
    assert [inits[dq.input[0]].data_type for dq in bias_dqs] == [TensorProto.INT32] * 2
    errors = bias_errors(skewed, onnx.load(str(fp32_path)), batches(0))
    corrected = correct_biases(skewed, errors)
    left = bias_errors(corrected, onnx.load(str(fp32_path)), batches(0))
    assert np.abs(left["conv2"]).mean() < 0.2 * np.abs(errors["conv2"]).mean()


def test_a_conv_kept_float_since_is_left_alone(tmp_path):
    from app.builder.int8.sensitivity import keep_float

    fp32_path = conv_silu_conv(tmp_path / "fp32.onnx")
    q = quantized(fp32_path, tmp_path / "q.onnx", "tensorrt")
    errors = bias_errors(q, onnx.load(str(fp32_path)), batches(0))
    reverted = keep_float(q, "conv2")
    corrected = correct_biases(reverted, errors)
    bias = {i.name: numpy_helper.to_array(i) for i in corrected.graph.initializer}
    original = {i.name: numpy_helper.to_array(i) for i in reverted.graph.initializer}
    conv2 = next(n for n in corrected.graph.node if n.name == "conv2")
    np.testing.assert_array_equal(bias[conv2.input[2]], original[conv2.input[2]])

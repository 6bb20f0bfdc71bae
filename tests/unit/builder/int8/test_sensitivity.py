"""Sensitivity and mixed precision: bypassing one layer's Q/DQ, and the greedy float set."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from app.builder.int8 import graph, sensitivity, thresholds
from app.builder.int8.histograms import ActivationHistograms
from app.builder.int8.qdq import write_qdq_model
from app.builder.int8.report import OrtModel


def two_convs(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])], [w1, w2])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_keep_float_bypasses_exactly_that_layers_qdq(tmp_path):
    from onnxruntime.quantization.calibrate import save_tensors_data

    fp32_path = two_convs(tmp_path / "m.onnx")
    fp32 = OrtModel(fp32_path)
    xs = [np.random.default_rng(k).random((1, 3, 16, 16), dtype=np.float32) for k in range(4)]
    tensors = graph.activation_tensors(onnx.load(str(fp32_path)))
    augmented = OrtModel(graph.augmented_model(onnx.load(str(fp32_path)), tensors).SerializeToString())
    collector = ActivationHistograms()
    for x in xs:
        for name, values in zip(tensors, augmented.run(x)):
            collector.add(name, values)
    ranges = thresholds.compute_ranges(collector.finish(), "max")
    save_tensors_data(thresholds.to_tensors_data(ranges, "max"), tmp_path / "r.json")
    qdq_path = write_qdq_model(fp32_path, tmp_path / "q.onnx", tmp_path / "r.json", "max", target="tensorrt")
    qdq = onnx.load(str(qdq_path))

    x = xs[0]
    want = fp32.run(x)[0]
    all_int8 = OrtModel(qdq_path).run(x)[0]
    one = OrtModel(sensitivity.keep_float(qdq, "conv2").SerializeToString()).run(x)[0]
    both = sensitivity.keep_float(sensitivity.keep_float(qdq, "conv2"), "conv1")
    np.testing.assert_allclose(OrtModel(both.SerializeToString()).run(x)[0], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(all_int8, want, atol=1e-4)  # quantization does change the output
    assert np.abs(one - want).mean() < np.abs(all_int8 - want).mean()  # conv2 float: closer
    assert not np.allclose(one, want, atol=1e-4)  # conv1 still quantized
    assert len(both.graph.node) == len(qdq.graph.node)  # rewired, nothing else touched


def test_mixed_precision_keeps_the_most_sensitive_convs_float(tmp_path, sample_model_dir, assets_dir, monkeypatch):
    import cv2

    from app.builder.int8 import calibrate

    images = tmp_path / "images"
    images.mkdir()
    for name in ("bus.jpg", "zidane.jpg"):
        img = cv2.imread(str(assets_dir / name))
        for k, scale in enumerate((1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.7, 0.9)):
            cv2.imwrite(str(images / f"{k}{name}"), cv2.resize(img, None, fx=scale, fy=scale)[:, :: 1 if k % 2 else -1])
    root = tmp_path / "artifacts"  # a private artifacts root holding the session's export
    private = root / sample_model_dir.relative_to(sample_model_dir.parent.parent)
    private.mkdir(parents=True)
    for f in ("model.onnx", "meta.json", "weights.pt"):
        shutil.copyfile(sample_model_dir / f, private / f)
    # Three candidate Convs keep the test short; calibrate studies all 57 of the model.
    every_conv = graph.conv_layers
    monkeypatch.setattr(graph, "conv_layers", lambda model, skip=(): every_conv(model, skip)[:3])
    result = calibrate("sample", images, method="entropy", artifacts_dir=root, calibration_root=tmp_path / "c",
                       min_f1=0.999, max_float_layers=2, sensitivity_images=2, allow_low_accuracy=True)
    assert result.installed
    ranked = [s.layer for s in result.sensitivity]
    assert len(ranked) == 3 and result.float_layers == ranked[: len(result.float_layers)]  # most sensitive first
    assert 1 <= len(result.float_layers) <= 2  # up to the cap, or until the gate passed
    f1s = [s.f1 for s in result.sensitivity]
    assert f1s == sorted(f1s, reverse=True)
    model = onnx.load(str(result.tensorrt_qdq_path))
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.name in result.float_layers:  # float input and float weight
            assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for i in node.input[:2])
    saved = json.loads(result.report_path.read_text())["mixed_precision"]
    assert saved["float_convs"] == result.float_layers and saved["float_convs_gflops"] > 0
    assert [s["layer"] for s in saved["sensitivity"]] == ranked

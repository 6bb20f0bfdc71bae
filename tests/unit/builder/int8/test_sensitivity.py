"""Sensitivity and mixed precision: bypassing one layer's Q/DQ, and the greedy float set."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from app.builder.int8 import graph, sensitivity, thresholds
from app.builder.int8.histograms import ActivationHistograms
from app.builder.int8.qdq import write_qdq_model
from app.builder.int8.report import OrtModel


def two_convs(path: Path, *, silu: bool = False) -> Path:
    """Conv → ReLU (or YOLOv8's SiLU, x · sigmoid(x)) → Conv."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32), "w2")
    act = ([helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"), helper.make_node("Mul", ["a", "s"], ["r"], name="mul")]
           if silu else [helper.make_node("Relu", ["a"], ["r"], name="relu")])
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]), *act,
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


def test_keep_preactivation_float_unfuses_exactly_that_conv(tmp_path):
    """The CPU model's revert: the Conv's output skips its Q/DQ, so ORT runs it as a float Conv
    (one QLinearConv fewer) and the rest stays fused."""
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import save_tensors_data

    fp32_path = two_convs(tmp_path / "m.onnx", silu=True)
    assert graph.silu_pairs(onnx.load(str(fp32_path))) == {"a": "r"}
    tensors = graph.activation_tensors(onnx.load(str(fp32_path)))
    augmented = OrtModel(graph.augmented_model(onnx.load(str(fp32_path)), tensors).SerializeToString())
    collector = ActivationHistograms()
    for k in range(4):
        for name, values in zip(tensors, augmented.run(np.random.default_rng(k).random((1, 3, 16, 16), np.float32))):
            collector.add(name, values)
    save_tensors_data(thresholds.to_tensors_data(thresholds.compute_ranges(collector.finish(), "max"), "max"),
                      tmp_path / "r.json")
    qdq = onnx.load(str(write_qdq_model(fp32_path, tmp_path / "q.onnx", tmp_path / "r.json", "max", target="cpu")))
    assert sensitivity.candidates(qdq, "cpu") == ["conv1", "conv2"]  # both outputs quantized: both fused

    def fused(model) -> list[str]:
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(tmp_path / "opt.onnx")
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return [n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node if n.op_type.startswith("QLinear")]

    reverted = sensitivity.with_reverted(qdq, "cpu", ["conv1"])
    assert fused(qdq).count("QLinearConv") == 2 and fused(reverted).count("QLinearConv") == 1
    consumers = [n for n in reverted.graph.node if "a" in n.input]
    assert sorted(n.op_type for n in consumers) == ["Mul", "Sigmoid"]  # SiLU reads the float Conv output
    assert len(reverted.graph.node) == len(qdq.graph.node) - 2  # its Q and DQ gone, nothing else


def test_accuracy_control_reverts_the_installed_models_layers_and_caches(tmp_path, sample_model_dir, assets_dir,
                                                                        monkeypatch):
    import cv2

    from app.builder.int8 import calibrate, mixed
    from app.builder.int8.calibration import load_heldout
    from app.builder.int8.images import list_items
    from app.builder.int8.report import detect, summarize
    from app.errors import AccuracyGateFailed

    images, held = tmp_path / "images", tmp_path / "held"
    images.mkdir()
    held.mkdir()
    for name in ("bus.jpg", "zidane.jpg"):
        img = cv2.imread(str(assets_dir / name))
        for k, scale in enumerate((1.0, 0.6, 0.4, 0.8)):  # 8 images: the test is about the layers, not accuracy
            cv2.imwrite(str(images / f"{k}{name}"), cv2.resize(img, None, fx=scale, fy=scale)[:, :: 1 if k % 2 else -1])
        for k, alpha in enumerate((0.6, 1.3)):
            cv2.imwrite(str(held / f"{k}{name}"), cv2.convertScaleAbs(img, alpha=alpha))
    root = tmp_path / "artifacts"  # a private artifacts root holding the session's export
    private = root / sample_model_dir.relative_to(sample_model_dir.parent.parent)
    private.mkdir(parents=True)
    for f in ("model.onnx", "meta.json", "weights.pt"):
        shutil.copyfile(sample_model_dir / f, private / f)
    # Three candidate Convs per model keep the test short; calibrate studies all of them.
    every = mixed.candidates
    monkeypatch.setattr(mixed, "MAX_CPU_FLOAT_SHARE", 1.0)  # off by default (latency); on here to test it
    monkeypatch.setattr(mixed, "candidates", lambda model, target, skip=(): every(model, target, skip)[:3])
    options = {"heldout_images": held, "artifacts_dir": root, "calibration_root": tmp_path / "c", "min_f1": 0.999,
               "target_f1": 1.01, "max_float_layers": 2, "sensitivity_images": 2, "min_images": 4}
    with pytest.raises(AccuracyGateFailed) as failed:  # an impossible gate: measured, refused
        calibrate("sample", images, **options)
    hint = failed.value.hint
    assert "--max-float-layers" in hint and "--allow-low-accuracy" in hint and "max_float_layers" not in hint
    cached = sorted(p.name for p in (tmp_path / "c").glob("*-sens-*.json"))
    assert sorted(name.split("-sens-")[1] for name in cached) == ["cpu.json", "tensorrt.json"]

    def measured_again(*args, **kwargs):
        raise AssertionError("the sensitivities should come from the cache")

    monkeypatch.setattr(mixed, "layer_sensitivity", measured_again)
    result = calibrate("sample", images, allow_low_accuracy=True, **options)
    assert result.installed and not result.passed
    for layers, ranked in ((result.float_layers, result.sensitivity), (result.cpu_float_layers, result.cpu_sensitivity)):
        assert len(ranked) == 3 and len(layers) == 2 and layers == [s.layer for s in ranked[:2]]  # most sensitive first
        errors = [s.score_error for s in ranked]
        assert errors == sorted(errors)
    saved = json.loads(result.report_path.read_text())["mixed_precision"]
    assert saved["cpu"]["sensitivity_from_cache"] and saved["tensorrt"]["layers"] == result.float_layers
    # The reverted layers are in the installed files, and the report is those files' agreement.
    trt = onnx.load(str(result.tensorrt_qdq_path))
    producer = {o: n for n in trt.graph.node for o in n.output}
    for node in trt.graph.node:
        if node.name in result.float_layers:  # float input and float weight
            assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for i in node.input[:2])
    cpu = onnx.load(str(result.cpu_qdq_path))
    for node in cpu.graph.node:
        if node.name in result.cpu_float_layers:  # its output read as is, not through Q/DQ
            assert not [n for n in cpu.graph.node if node.output[0] in n.input and n.op_type == "QuantizeLinear"]
    heldout = load_heldout(list_items(held), 640, held, None)
    fp32 = detect(result.onnx_path, heldout)
    for report, path in ((result.report, result.tensorrt_qdq_path), (result.cpu_report, result.cpu_qdq_path)):
        again = summarize(path.name, heldout.names, fp32, detect(path, heldout))
        assert (again.f1, again.matched, again.int8_boxes) == (report.f1, report.matched, report.int8_boxes)

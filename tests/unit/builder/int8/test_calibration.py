"""A real INT8 calibration of the sample model on a small generated folder (photos + a video).

The images are bus.jpg and zidane.jpg (shipped with Ultralytics), variations of them, and a short
video made of crops of them: 12 photos + 8 frames; 10 held out, 10 calibrated on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from app.artifacts.int8 import int8_cpu_model_path, int8_qdq_model_path, int8_report_path
from app.builder.int8 import DEFAULT_METHOD, calibrate, graph
from app.builder.int8.calibration import CalibrationResult
from app.errors import ArtifactError, CalibrationError


def variants(img: np.ndarray) -> list[np.ndarray]:
    h, w = img.shape[:2]
    return [
        img,
        img[:, ::-1].copy(),  # mirror
        img[h // 10 : h - h // 10, w // 10 : w - w // 10].copy(),  # centre crop
        img[: int(h * 0.75), : int(w * 0.75)].copy(),  # top-left crop
        cv2.resize(img, (w // 2, h // 2), interpolation=cv2.INTER_AREA),  # smaller
        cv2.convertScaleAbs(img, alpha=0.7, beta=10),  # darker
    ]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory, assets_dir) -> Path:
    out = tmp_path_factory.mktemp("calib-images")
    for name in ("bus.jpg", "zidane.jpg"):
        for k, img in enumerate(variants(cv2.imread(str(assets_dir / name)))):
            sub = out / ("sub" if k % 2 else "")  # the folder is listed recursively
            sub.mkdir(exist_ok=True)
            cv2.imwrite(str(sub / f"{Path(name).stem}_{k}.{'png' if k == 3 else 'jpg'}"), img)
    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    writer = cv2.VideoWriter(str(out / "sub" / "clip.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 5, (480, 640))
    for k in range(8):
        writer.write(np.ascontiguousarray(cv2.resize(bus[k * 20 : k * 20 + 800, :], (480, 640))))
    writer.release()
    return out


@pytest.fixture(scope="module")
def private_engines(tmp_path_factory, sample_model_dir) -> Path:
    """A private artifacts root holding the session's sample export (no re-export)."""
    out = tmp_path_factory.mktemp("artifacts")
    private = out / sample_model_dir.relative_to(sample_model_dir.parent.parent)
    private.mkdir(parents=True)
    for f in ("model.onnx", "meta.json", "weights.pt"):
        shutil.copyfile(sample_model_dir / f, private / f)
    return out


@pytest.fixture(scope="module")
def calib_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("calibration")


def run(image_dir, engines, calib_root, **kwargs) -> CalibrationResult:
    options = {"frames_per_video": 8, "max_float_layers": 0, "min_f1": 0.5, "artifacts_dir": engines,
               "calibration_root": calib_root, **kwargs}
    return calibrate("sample", image_dir, **options)


@pytest.fixture(scope="module")
def calibrated(image_dir, private_engines, calib_root) -> CalibrationResult:
    return run(image_dir, private_engines, calib_root, method="entropy", allow_low_accuracy=True)


def _graph(path: Path):
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    return model, inits, producer


def test_tensorrt_model_is_symmetric_s8_per_channel_with_float_head(calibrated):
    model, inits, producer = _graph(calibrated.tensorrt_qdq_path)
    assert calibrated.method == "entropy"
    assert calibrated.tensorrt_qdq_path == int8_qdq_model_path(calibrated.model_dir)
    fp32 = onnx.load(str(calibrated.onnx_path))
    tail, head_out = set(graph.head_tail_nodes(fp32)), set(graph.head_output_convs(fp32))
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    for n in qdq:  # symmetric int8: every zero point is an int8 zero
        zp = inits[n.input[2]]
        assert zp.dtype == np.int8 and not zp.any(), n.name
    convs = [n for n in model.graph.node if n.op_type == "Conv" and n.name not in tail | head_out]
    assert len(convs) == 57
    for conv in (n for n in model.graph.node if n.name in head_out | tail):  # those read float
        assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for i in conv.input)
    for conv in convs:
        x, w = producer[conv.input[0]], producer[conv.input[1]]
        assert x.op_type == "DequantizeLinear" and w.op_type == "DequantizeLinear", conv.name
        out_channels = inits[producer[w.input[0]].input[0]].shape[0]  # float weight → Q → DQ
        assert inits[w.input[1]].shape == (out_channels,), conv.name  # per-channel weight scales
        if len(conv.input) > 2:
            assert inits[conv.input[2]].dtype == np.float32  # float bias for TensorRT
    # The input image keeps its whole [0, 1] range, one-sided: quantized shifted by 0.5 (shift.py),
    # all 255 levels over [0, 1]; the first Conv pads the int8 tensor with the value of 0.
    shift = next(n for n in model.graph.node if n.op_type == "Sub" and n.input[0] == "images")
    first = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == shift.output[0])
    assert float(inits[first.input[1]]) == pytest.approx(0.5 / 127)
    assert float(inits[shift.input[1]]) == pytest.approx(0.5)
    conv0 = next(n for n in model.graph.node if n.op_type == "Conv")
    pad = producer[producer[conv0.input[0]].input[0]]
    assert pad.op_type == "Pad" and int(inits[pad.input[2]]) == -127


def test_cpu_model_has_u8_activations(calibrated):
    model, inits, producer = _graph(calibrated.cpu_qdq_path)
    assert calibrated.cpu_qdq_path == int8_cpu_model_path(calibrated.model_dir)
    zps = [inits[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert zps and all(z.dtype == np.uint8 for z in zps)
    first_conv = next(n for n in model.graph.node if n.op_type == "Conv")
    assert producer[first_conv.input[0]].op_type == "DequantizeLinear"


def test_the_cpu_model_runs_in_onnx_runtimes_fused_kernels_as_written(calibrated, assets_dir):
    """ORT fuses the CPU model into QLinearConv. On an x86 CPU without VNNI its u8×s8 kernel sums
    pairs of products in int16, which saturates for weights beyond ±64 (255·127·2 > 32767): the
    model's weights stay within ±64, and the fused run gives the scores of the Q/DQ arithmetic."""
    from app.builder.int8.report import OrtModel
    from app.imaging.letterbox import letterbox, to_input

    model, inits, _ = _graph(calibrated.cpu_qdq_path)
    weights = [inits[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear"
               and n.input[0] in inits and inits[n.input[0]].ndim == 4]
    assert len(weights) == 57 and max(int(np.abs(w.astype(int)).max()) for w in weights) == 64
    x = to_input([letterbox(cv2.imread(str(assets_dir / name)), 640)[0] for name in ("bus.jpg", "zidane.jpg")])
    fused = OrtModel(calibrated.cpu_qdq_path).run(x)[0][:, 4:]  # class scores of every anchor
    plain = OrtModel(calibrated.cpu_qdq_path, optimize=False).run(x)[0][:, 4:]
    confident = np.maximum(fused, plain) > 0.1
    assert confident.sum() > 30  # enough scores to compare (48 on the sample model)
    assert np.abs(fused - plain)[confident].mean() < 0.01


def test_cpu_placement_on_the_exported_graph(calibrated):
    """No Q/DQ of their own for SiLU and Split (only the fused Conv's output, dequantized), float
    inputs for the layers kept float, and every other Conv one that ORT fuses."""
    model, _, producer = _graph(calibrated.cpu_qdq_path)
    fp32 = onnx.load(str(calibrated.onnx_path))
    floats = set(graph.float_nodes(fp32))
    readers = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    reads_dq = lambda n: any(producer.get(i) is not None and producer[i].op_type == "DequantizeLinear"
                             for i in n.input)
    for n in model.graph.node:
        if n.name in floats:
            assert not reads_dq(n), n.name
        if n.op_type == "Sigmoid":  # read as float by SiLU's Mul
            assert all(r.op_type != "QuantizeLinear" for r in readers.get(n.output[0], [])), n.name
        if n.op_type == "Split":  # reads SiLU's float output; its parts are quantized by the Convs reading them
            assert not reads_dq(n), n.name
    quantized = [n for n in model.graph.node if n.op_type == "Conv" and n.name not in floats]
    assert len(quantized) == 57
    for conv in quantized:  # DQ(x), DQ(w) → Conv → Q: ORT's QLinearConv pattern
        assert reads_dq(conv) and any(r.op_type == "QuantizeLinear" for r in readers[conv.output[0]]), conv.name

    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(calibrated.model_dir / "optimized.onnx")
    ort.InferenceSession(str(calibrated.cpu_qdq_path), opts, providers=["CPUExecutionProvider"])
    optimized = onnx.load(opts.optimized_model_filepath)
    (calibrated.model_dir / "optimized.onnx").unlink()
    fused = [n for n in optimized.graph.node if n.op_type == "QLinearConv"]
    assert len(fused) == len(quantized)
    assert not [n for n in optimized.graph.node if n.op_type in ("QLinearSigmoid", "QLinearMul")]


def test_cpu_preactivations_get_silu_fitted_ranges(calibrated):
    """A Conv output entering SiLU: u8 from about -c (where SiLU is ~0) up to the SiLU output's top,
    not the symmetric [-T, T] its |x| percentile gives."""
    from app.builder.int8.thresholds import silu_floor

    model, inits, _ = _graph(calibrated.cpu_qdq_path)
    pairs = graph.silu_pairs(onnx.load(str(calibrated.onnx_path)))
    assert len(pairs) == 57
    q_of = {n.input[0]: n for n in model.graph.node if n.op_type == "QuantizeLinear"}
    from app.builder.int8.histograms import load_histograms
    from app.builder.int8.thresholds import compute_ranges

    raw = compute_ranges(load_histograms(calibrated.cache_path), calibrated.method)  # before the fit
    assert all(pre in q_of for pre in pairs)  # every SiLU follows a fused Conv
    checked = 0
    for pre, post in pairs.items():
        if post not in q_of:  # read only by a Split (quantized after it) or by a float head Conv
            continue
        def span(tensor):
            q = q_of[tensor]
            scale, zp = float(inits[q.input[1]]), int(inits[q.input[2]])
            return -zp * scale, (255 - zp) * scale
        lo, hi = span(pre)
        post_lo, post_hi = span(post)
        assert hi == pytest.approx(post_hi, rel=0.02, abs=1e-3)
        floor = min(silu_floor((post_hi - post_lo) / 255), -raw[pre][0])  # or the lowest value seen
        assert -lo == pytest.approx(floor, rel=0.05, abs=0.02)
        assert hi - lo < raw[pre][1] - raw[pre][0] + 1e-6
        checked += 1
    assert checked >= 40  # 43 of the 57 on this model


def test_missing_cpu_model_is_a_clear_error(tmp_path):
    with pytest.raises(ArtifactError, match="no INT8 model") as err:
        int8_cpu_model_path(tmp_path)
    assert "yolopipe calibrate" in str(err.value)


def test_split_report_and_saved_payload(calibrated):
    assert len(calibrated.heldout_images) == 10 and len(calibrated.calibration_images) == 10
    assert any("#frame" in name for name in calibrated.calibration_images + calibrated.heldout_images)
    for report in (calibrated.report, calibrated.cpu_report):
        assert report.images == 10 and report.fp32_boxes > 0
        assert report.f1 >= 0.6 and report.mean_iou > 0.8
        assert not report.trustworthy  # 10 images, few boxes: marked
    saved = json.loads(int8_report_path(calibrated.model_dir).read_text())
    assert saved["f1"] == pytest.approx(calibrated.report.f1) and saved["trustworthy"] is False
    assert saved["f1_ci95"] == pytest.approx(list(calibrated.report.f1_ci95))
    assert saved["cpu_variant"]["f1"] == pytest.approx(calibrated.cpu_report.f1)
    assert saved["installed"] is True and saved["passed"] == calibrated.passed


def test_writing_a_model_leaves_the_root_logger_alone(calibrated, tmp_path):
    import logging

    from app.builder.int8.qdq import write_qdq_model

    root = logging.getLogger()
    before = (root.level, list(root.filters), list(root.handlers))
    ranges = Path(json.loads(int8_report_path(calibrated.model_dir).read_text())["ranges"]["cpu"])
    write_qdq_model(calibrated.onnx_path, tmp_path / "m.onnx", ranges, calibrated.method, target="cpu",
                    float_nodes=graph.float_nodes(onnx.load(str(calibrated.onnx_path))))
    assert (root.level, root.filters, root.handlers) == before


def test_rerun_and_other_methods_use_the_histogram_cache(calibrated, image_dir, private_engines, calib_root):
    assert calibrated.cache_path.is_file() and calibrated.cache_path.is_relative_to(calib_root)
    again = run(image_dir, private_engines, calib_root, allow_low_accuracy=True)
    assert again.method == DEFAULT_METHOD == "mse"
    assert again.cache_hit and not calibrated.cache_hit and again.cache_path == calibrated.cache_path
    assert again.timings_s["calibration_s"] < calibrated.timings_s["calibration_s"]


def test_quantizing_the_head_tail_fails_the_gate(calibrated, image_dir, private_engines, calib_root):
    """The known failure: the decode arithmetic and the box/score concat quantized → boxes lost."""
    before = calibrated.tensorrt_qdq_path.stat().st_mtime_ns
    with pytest.raises(CalibrationError, match="below the required 0.50"):
        run(image_dir, private_engines, calib_root, method="max", exclude_head_tail=False)
    assert calibrated.tensorrt_qdq_path.stat().st_mtime_ns == before  # the installed model stays
    assert not list(calibrated.model_dir.glob("*.new.onnx"))
    saved = json.loads(int8_report_path(calibrated.model_dir).read_text())
    assert saved["passed"] is False and saved["installed"] is False
    refused = [r for r in (saved, saved["cpu_variant"]) if r["f1_ci95"][0] < 0.5 or r["lost_all"]]
    assert refused  # what the gate refused: one of the two models
    # and it scores below both models calibrated with the head tail float
    assert min(r["f1"] for r in refused) < min(calibrated.report.f1, calibrated.cpu_report.f1)


# --- clear errors -----------------------------------------------------------------------
def test_too_few_images_says_how_many_are_needed(tmp_path, image_dir):
    for p in sorted(image_dir.glob("*.jpg"))[:5]:
        shutil.copyfile(p, tmp_path / p.name)
    with pytest.raises(CalibrationError, match=r"at least 8 are needed, 64\+ advised") as err:
        calibrate("sample", tmp_path)
    assert "164+ in all" in str(err.value)


def test_unreadable_images_are_not_counted(tmp_path, private_engines, calib_root, image_dir):
    good = min(image_dir.glob("*.jpg"))
    for i in range(14):
        (tmp_path / f"broken{i}.jpg").write_bytes(good.read_bytes()[:200])
    shutil.copyfile(good, tmp_path / "good.jpg")
    with pytest.raises(CalibrationError, match="leave 1 for calibration"):
        calibrate("sample", tmp_path, artifacts_dir=private_engines, calibration_root=calib_root)


def test_unknown_method():
    with pytest.raises(CalibrationError, match="entropy, max, mse, percentile"):
        calibrate("sample", ".", method="kl")


def test_the_gate_hint_names_options_the_command_has():
    import re

    import typer

    from app.builder.int8.report import gate_error
    from app.builder.int8.report import summarize
    from app.cli import cli

    report = summarize("model.int8-cpu.onnx", [], [], [])
    hint = gate_error(report, 0.9).hint
    named = set(re.findall(r"--[a-z][a-z0-9-]+", hint))
    command = typer.main.get_command(cli).commands["calibrate"]
    options = {opt for param in command.params for opt in param.opts}
    assert {"--max-float-layers", "--allow-low-accuracy", "--heldout-images", "--method"} <= named <= options
    assert "_" not in hint.replace("--", "")  # no code parameter names

"""Real INT8 calibration of the sample model on a small generated image set.

The images are bus.jpg and zidane.jpg (shipped with Ultralytics) plus flips, crops, rescales
and brightness changes of them: 12 images, 3 held out, 9 calibrated on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from app.builder import quantize as qz
from app.artifacts.int8 import int8_cpu_model_path, int8_qdq_model_path, int8_report_path
from app.builder.int8_report import compare_models
from app.errors import ArtifactError, CalibrationError

ASSETS = Path(__import__("ultralytics").__file__).parent / "assets"


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
def image_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calib-images")
    for name in ("bus.jpg", "zidane.jpg"):
        for k, img in enumerate(variants(cv2.imread(str(ASSETS / name)))):
            sub = out / ("sub" if k % 2 else "")  # the folder is listed recursively
            sub.mkdir(exist_ok=True)
            cv2.imwrite(str(sub / f"{Path(name).stem}_{k}.{'png' if k == 3 else 'jpg'}"), img)
    return out


@pytest.fixture(scope="module")
def engines_dir(tmp_path_factory) -> Path:
    """A private engines dir holding the existing sample export (no re-export)."""
    from app.builder.export import export_onnx

    exported = export_onnx("sample")
    out = tmp_path_factory.mktemp("engines")
    (out / "sample").mkdir()
    for f in ("model.onnx", "meta.json"):
        shutil.copyfile(exported.onnx_path.parent / f, out / "sample" / f)
    return out


@pytest.fixture(scope="module")
def calib_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("calibration")


@pytest.fixture(scope="module")
def calibrated(image_dir, engines_dir, calib_root) -> qz.CalibrationResult:
    # 3 held-out images hold ~8 boxes: one box more or less moves F1 by ~0.06, so the gate
    # here is looser than the default 0.90 meant for real held-out sets.
    return qz.calibrate("sample", image_dir, num_images=512, method="entropy", holdout=3, min_f1=0.8,
                        engines_dir=engines_dir, calibration_root=calib_root)


def _graph(path: Path):
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    return model, inits, producer


# --- the artifacts ----------------------------------------------------------------------
def test_tensorrt_model_is_symmetric_s8_per_channel_with_float_tail(calibrated):
    model, inits, producer = _graph(calibrated.int8_path)
    assert calibrated.int8_path == int8_qdq_model_path(calibrated.model_dir)
    fp32 = onnx.load(str(calibrated.onnx_path))
    tail = set(qz.head_tail_nodes(fp32))
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq
    for n in qdq:  # symmetric int8: every zero point is an int8 zero
        zp = inits[n.input[2]]
        assert zp.dtype == np.int8 and not zp.any(), n.name
    head_out = set(qz.head_output_convs(fp32))
    convs = [n for n in model.graph.node if n.op_type == "Conv" and n.name not in tail | head_out]
    assert len(convs) == 57  # every Conv but the DFL's fixed one and the head's six last ones
    for conv in (n for n in model.graph.node if n.name in head_out):  # those read float
        assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for i in conv.input)
    for conv in convs:
        x, w = producer[conv.input[0]], producer[conv.input[1]]
        assert x.op_type == "DequantizeLinear" and w.op_type == "DequantizeLinear", conv.name
        scale = inits[w.input[1]]
        out_channels = inits[producer[w.input[0]].input[0]].shape[0]  # float weight → Q → DQ
        assert scale.shape == (out_channels,), conv.name  # per-channel weight scales
        if len(conv.input) > 2:
            assert conv.input[2] in inits and inits[conv.input[2]].dtype == np.float32  # float bias for TensorRT
    for node in model.graph.node:  # nothing in the head tail reads or writes a quantized tensor
        if node.name in tail:
            assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for i in node.input), node.name
    assert producer[model.graph.output[0].name].name == "/model.22/Concat_26"


def test_cpu_model_has_u8_activations(calibrated):
    model, inits, producer = _graph(calibrated.int8_cpu_path)
    assert calibrated.int8_cpu_path == int8_cpu_model_path(calibrated.model_dir)
    activation_zps = [inits[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert activation_zps and all(z.dtype == np.uint8 for z in activation_zps)
    first_conv = next(n for n in model.graph.node if n.op_type == "Conv")
    assert producer[first_conv.input[0]].op_type == "DequantizeLinear"


def test_missing_cpu_model_is_a_clear_error(tmp_path):
    with pytest.raises(ArtifactError, match="no INT8 model") as err:
        int8_cpu_model_path(tmp_path)
    assert "yolopipe calibrate" in str(err.value)


def test_report_agrees_with_fp32_and_is_saved(calibrated, image_dir):
    import json

    assert len(calibrated.heldout_images) == 3 and len(calibrated.calibration_images) == 9
    assert not set(calibrated.heldout_images) & set(calibrated.calibration_images)
    for report in (calibrated.report, calibrated.cpu_report):
        assert report.images == 3 and report.fp32_boxes > 0
        assert report.f1 >= 0.8 and report.lost_all == []
        assert report.mean_iou > 0.85
    saved = json.loads(int8_report_path(calibrated.model_dir).read_text())
    assert saved["passed"] is True and saved["f1"] == pytest.approx(calibrated.report.f1)
    assert saved["cpu_variant"]["f1"] == pytest.approx(calibrated.cpu_report.f1)
    # and on all 12 images, through the real CPU pipeline
    paths = sorted(p for p in image_dir.rglob("*") if p.is_file())
    _, images = qz.read_images(paths)
    meta = __import__("app.types", fromlist=["ModelMeta"]).ModelMeta.load(calibrated.model_dir / "meta.json")
    report, _ = compare_models(calibrated.onnx_path, calibrated.int8_path, meta, images, [p.name for p in paths])
    print("F1 on all 12 images:", report.f1)
    assert report.f1 >= 0.85 and report.lost_all == []


def test_rerun_uses_the_calibration_cache(calibrated, image_dir, engines_dir, calib_root):
    assert calibrated.cache_path.is_file() and calibrated.cache_path.is_relative_to(calib_root / "cache")
    again = qz.calibrate("sample", image_dir, method="entropy", holdout=3, min_f1=0.8, engines_dir=engines_dir,
                         calibration_root=calib_root)
    assert again.cache_hit and not calibrated.cache_hit
    assert again.report.f1 == calibrated.report.f1 and again.report.matched == calibrated.report.matched


def test_quantizing_the_head_tail_fails_the_gate(calibrated, image_dir, engines_dir, calib_root):
    """The known failure: one scale for box pixels and scores → (almost) no detections."""
    before = calibrated.int8_path.stat().st_mtime_ns
    with pytest.raises(CalibrationError, match="below the required 0.80"):
        qz.calibrate("sample", image_dir, method="entropy", holdout=3, min_f1=0.8, engines_dir=engines_dir,
                     calibration_root=calib_root, exclude_head_tail=False)
    assert calibrated.int8_path.stat().st_mtime_ns == before  # the good model stays installed
    assert not list(calibrated.model_dir.glob("*.new.onnx"))
    import json

    saved = json.loads(int8_report_path(calibrated.model_dir).read_text())
    assert saved["passed"] is False and saved["f1"] < 0.5


# --- the pieces -------------------------------------------------------------------------
def test_head_tail_is_everything_after_the_last_convs():
    from app.builder.export import export_onnx

    model = onnx.load(str(export_onnx("sample").onnx_path))
    tail = set(qz.head_tail_nodes(model))
    nodes = {n.name: n for n in model.graph.node}
    out_producer = next(n for n in model.graph.node if model.graph.output[0].name in n.output)
    assert out_producer.name in tail
    assert {n.op_type for n in nodes.values() if n.name in tail} >= {"Softmax", "Sigmoid", "Concat", "Reshape"}
    # The only Conv in the tail is the DFL's fixed 1x1 conv (no bias, 16 input channels).
    tail_convs = [nodes[t] for t in tail if nodes[t].op_type == "Conv"]
    assert len(tail_convs) == 1 and len(tail_convs[0].input) == 2
    # Nothing upstream of the head's last Convs is in it: no SiLU (Sigmoid → Mul) of the body.
    assert not [t for t in tail if nodes[t].op_type == "Mul" and nodes[t].input[1].endswith("Sigmoid_output_0")]


def test_head_output_convs_and_branches_are_found_from_the_structure():
    from app.builder.export import export_onnx

    model = onnx.load(str(export_onnx("sample").onnx_path))
    nodes = {n.name: n for n in model.graph.node}
    out_convs = qz.head_output_convs(model)
    # six 1x1 Convs with a bias: box distribution (4*16 channels) and class logits (2) per level
    assert len(out_convs) == 6 and all(nodes[c].op_type == "Conv" and len(nodes[c].input) == 3 for c in out_convs)
    inits = {i.name: i for i in model.graph.initializer}
    assert sorted(inits[nodes[c].input[1]].dims[0] for c in out_convs) == [2, 2, 2, 64, 64, 64]
    branch = qz.head_branch_nodes(model)
    assert set(out_convs) <= set(branch)
    assert sum(nodes[b].op_type == "Conv" for b in branch) == 18  # 3 levels x (box, class) x 3 Convs
    assert not set(branch) & set(qz.head_tail_nodes(model))


@pytest.mark.parametrize("seed", [0, 1])
def test_entropy_threshold_equals_onnxruntime(seed):
    from onnxruntime.quantization.calibrate import HistogramCollector

    rng = np.random.default_rng(seed)
    values = np.concatenate([rng.laplace(0.3, 1.0, 200_000), rng.normal(8, 0.5, 300)]).astype(np.float32)
    collector = HistogramCollector("entropy", False, 2048, 256, None, None)
    collector.collect_value({"t": values})
    hist = collector.histogram_dict["t"]
    expected = collector.get_entropy_threshold(hist, 256)
    got = qz.entropy_threshold(hist[0], hist[1], hist[2], hist[3], 256)
    assert [float(v) for v in got] == [float(v) for v in expected]
    assert float(got[1]) < float(values.max())  # a real clip, not MinMax


def test_split_is_disjoint_and_deterministic():
    files = [Path(f"img{i:03d}.jpg") for i in range(100)]
    calib, held = qz.split_images(files, num_images=30, holdout=0.2)
    assert len(held) == 20 and len(calib) == 30 and not set(calib) & set(held)
    assert (calib, held) == qz.split_images(files, num_images=30, holdout=0.2)
    assert len(qz.split_images(files * 10, num_images=512, holdout=0.2)[1]) == qz.MAX_HOLDOUT


# --- clear errors -----------------------------------------------------------------------
def test_missing_folder(tmp_path):
    with pytest.raises(CalibrationError, match="not found"):
        qz.calibrate("sample", tmp_path / "nope")


def test_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(CalibrationError, match="no images in") as err:
        qz.calibrate("sample", tmp_path)
    assert "64+" in str(err.value)


def test_too_few_images_says_how_many_are_advised(tmp_path, image_dir):
    for p in sorted(image_dir.glob("*.jpg"))[:5]:
        shutil.copyfile(p, tmp_path / p.name)
    with pytest.raises(CalibrationError, match=r"at least 8 are needed, 64\+ advised"):
        qz.calibrate("sample", tmp_path)


def test_unreadable_images_are_skipped_then_refused(tmp_path, engines_dir, calib_root, image_dir):
    good = min(image_dir.glob("*.jpg"))
    (tmp_path / "broken.jpg").write_bytes(good.read_bytes()[:200])  # truncated JPEG
    (tmp_path / "fake.png").write_bytes(b"definitely not a png")
    paths, images = qz.read_images([good, tmp_path / "broken.jpg", tmp_path / "fake.png"])
    assert paths == [good] and len(images) == 1
    for i in range(12):
        (tmp_path / f"broken{i}.jpg").write_bytes(good.read_bytes()[:200])
    with pytest.raises(CalibrationError, match="could be read"):
        qz.calibrate("sample", tmp_path, engines_dir=engines_dir, calibration_root=calib_root)


def test_unknown_method():
    with pytest.raises(CalibrationError, match="entropy, max, percentile"):
        qz.calibrate("sample", ".", method="kl")


def _ort_histograms(batches, method="entropy"):
    from onnxruntime.quantization.calibrate import HistogramCollector

    collector = HistogramCollector(method, False, 2048, 256, qz.PERCENTILE, None)
    for batch in batches:
        collector.collect_value(batch)
    return collector


def _growing_batches():
    """Three 'images' of two tensors; later ones reach further, so the histograms grow."""
    rng = np.random.default_rng(3)
    return [
        {"a": rng.normal(0, s, (1, 32, 80, 80)).astype(np.float32),
         "b": np.maximum(rng.laplace(0, s, (1, 64, 40, 40)), 0).astype(np.float32)}
        for s in (1.0, 3.0, 0.5)
    ]


def test_activation_histograms_equal_onnxruntime_without_subsampling():
    batches = _growing_batches()
    ours = qz.ActivationHistograms(2048, sample_stride=1)
    for batch in batches:
        for name, values in batch.items():
            ours.add(name, values)
    ort = _ort_histograms(batches).histogram_dict
    for name in ("a", "b"):
        assert len(ours.histograms[name][0]) > 2048  # the range grew: the merge path is exercised
        for got, expected in zip(ours.histograms[name], ort[name]):
            np.testing.assert_array_equal(got, expected)
    # and the percentile cut is ORT's
    expected = _ort_histograms(batches, "percentile").compute_percentile()
    for name in ("a", "b"):
        got = qz.percentile_range(*ours.histograms[name][:4], qz.PERCENTILE)
        assert [float(v) for v in got] == [float(v) for v in expected[name][:2]]


def test_subsampled_histograms_keep_the_exact_range_and_nearly_the_same_thresholds():
    batches = _growing_batches()
    full, sampled = qz.ActivationHistograms(2048, 1), qz.ActivationHistograms(2048, qz.HISTOGRAM_SAMPLE_STRIDE)
    for batch in batches:
        for name, values in batch.items():
            full.add(name, values)
            sampled.add(name, values)
    for name in ("a", "b"):
        f, s = full.histograms[name], sampled.histograms[name]
        np.testing.assert_array_equal(f[1], s[1])  # same bins
        assert (f[2], f[3]) == (s[2], s[3])  # min and max of every value, not of the sample
        assert s[0].sum() == pytest.approx(f[0].sum() / qz.HISTOGRAM_SAMPLE_STRIDE, rel=0.01)
        # Same distribution: the sample's CDF stays within 1 % of the full one everywhere (KS
        # distance). The entropy threshold is NOT that stable (the KL optimum is flat in a
        # sparse tail): on the sample model it moved by median 0 %, 90th percentile 8 %.
        cdf_full, cdf_sampled = np.cumsum(f[0]) / f[0].sum(), np.cumsum(s[0]) / s[0].sum()
        assert np.abs(cdf_full - cdf_sampled).max() < 0.01

"""Real TensorRT on a real GPU: build fp16 and int8 engines from the sample model, run them, compare
with ONNX Runtime (raw head) and with Ultralytics' own predictions (through the Detector), check
CUDA-graph capture of ``forward`` and the refusal of mismatched engines.

Skipped cleanly without NVIDIA TensorRT or a CUDA GPU. Not ``pytest.importorskip("tensorrt")``:
a folder named ``tensorrt`` on ``sys.path`` (or PyPI's placeholder package) can be importable without
being NVIDIA's library, so the guard asks ``import_tensorrt`` for the real one.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from app.errors import BackendUnavailable
from app.gpu.tensorrt_lib import import_tensorrt

try:
    trt = import_tensorrt()
except BackendUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

import cv2  # noqa: E402

from app.artifacts.engines import ENGINE_META_NAME, find_engine, load_engine_meta  # noqa: E402
from app.backends.onnxruntime import OnnxRuntimeBackend  # noqa: E402
from app.backends.tensorrt import TensorRTEngine  # noqa: E402
from app.boxes import f1, match_pairs  # noqa: E402
from app.builder.export import export_onnx  # noqa: E402
from app.builder.trt_build import build_engine  # noqa: E402
from app.errors import ArtifactError, DeviceError, EngineMismatch  # noqa: E402
from app.imaging.letterbox import letterbox, to_input  # noqa: E402
from app.weights import sha256_file  # noqa: E402

PROFILE = dict(min_batch=1, opt_batch=2, max_batch=4)  # small profile: short builds


@pytest.fixture(scope="module")
def trt_dir(tmp_path_factory):
    """Its own engines folder, so engines built here never change backend choice elsewhere."""
    out = tmp_path_factory.mktemp("trt_engines")
    export_onnx("sample", artifacts_dir=out)
    return out


@pytest.fixture(scope="module")
def calib_dir(tmp_path_factory, assets_dir):
    """32 calibration photos made from the two ultralytics assets (flips, crops, scales, exposure)."""
    out = tmp_path_factory.mktemp("calib")
    for name in ("bus.jpg", "zidane.jpg"):
        img = cv2.imread(str(assets_dir / name))
        h, w = img.shape[:2]
        variants = [img, img[:, ::-1], img[: h * 3 // 4], img[h // 4 :], img[:, : w * 3 // 4], img[:, w // 4 :]]
        k = 0
        for v in variants:
            for gain in (0.7, 1.0, 1.3):
                if k >= 16:
                    break
                out_img = np.clip(v.astype(np.float32) * gain, 0, 255).astype(np.uint8)
                scale = (0.5, 0.75, 1.0)[k % 3]
                out_img = cv2.resize(out_img, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
                cv2.imwrite(str(out / f"{name[:-4]}_{k:02d}.jpg"), out_img)
                k += 1
    return out


@pytest.fixture(scope="module")
def fp16_engine(trt_dir):
    try:
        return build_engine("sample", precision="fp16", artifacts_dir=trt_dir, workspace_gib=2, **PROFILE)
    except BackendUnavailable as exc:  # TensorRT 11 without ModelOpt AutoCast
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def int8_engine(trt_dir, calib_dir):
    return build_engine("sample", precision="int8", calib_images=calib_dir, artifacts_dir=trt_dir, workspace_gib=2, **PROFILE)


@pytest.fixture(scope="module")
def model_meta(trt_dir):
    return export_onnx("sample", artifacts_dir=trt_dir).meta


def head_inputs(assets_dir, names=("bus.jpg", "zidane.jpg", "bus.jpg")):
    imgs = [cv2.imread(str(assets_dir / n)) for n in names]
    imgs[2] = imgs[2][:, ::-1].copy()
    return to_input([letterbox(img, 640)[0] for img in imgs])


def ultralytics_predict(model, path):
    r = model.predict(str(path), imgsz=640, rect=False, conf=0.25, iou=0.7, verbose=False)[0]
    return r.boxes.xyxy.numpy(), r.boxes.cls.numpy().astype(int)


def agreement(detector, ultralytics_model, paths):
    results = detector.detect([p.read_bytes() for p in paths], detector.params())
    tp = n_ref = n_pred = 0
    for path, res in zip(paths, results):
        assert res.error is None, path
        ref_boxes, ref_cls = ultralytics_predict(ultralytics_model, path)
        pairs = match_pairs(ref_boxes, ref_cls, res.detections.boxes, res.detections.class_ids)
        tp, n_ref, n_pred = tp + len(pairs), n_ref + len(ref_cls), n_pred + len(res.detections)
    assert n_ref >= 10
    return f1(tp, n_ref, n_pred)


def photo_paths(assets_dir, varied_images):
    from app.predict.folder import list_images

    return [assets_dir / "bus.jpg", assets_dir / "zidane.jpg"] + [img.path for img in list_images(str(varied_images))]


# --- build -------------------------------------------------------------------------------------
def test_build_writes_engine_and_metadata(fp16_engine, trt_dir, model_meta):
    model_dir = export_onnx("sample", artifacts_dir=trt_dir).model_dir
    assert fp16_engine == model_dir / "model.fp16.engine" and fp16_engine.stat().st_size > 100_000
    em = load_engine_meta(model_dir, "fp16")
    major, minor = torch.cuda.get_device_capability(0)
    assert em.trt_version == trt.__version__
    assert em.gpu_name == torch.cuda.get_device_name(0) and em.compute_capability == f"{major}.{minor}"
    assert (em.min_batch, em.opt_batch, em.max_batch, em.imgsz) == (1, 2, 4, 640)
    assert em.onnx_sha256 == sha256_file(model_dir / em.source_onnx)
    assert em.export_onnx_sha256 == model_meta.onnx_sha256 and em.class_names == model_meta.names
    assert (model_dir / "timing.cache").stat().st_size > 0
    assert find_engine(model_dir, "fp16") == fp16_engine


# --- the engine itself -------------------------------------------------------------------------
def test_fp16_head_matches_onnxruntime(fp16_engine, model_meta, trt_dir, assets_dir):
    batch = head_inputs(assets_dir)
    reference = OnnxRuntimeBackend(export_onnx("sample", artifacts_dir=trt_dir).onnx_path).infer(batch)
    with TensorRTEngine(fp16_engine, model_meta) as engine:
        assert (engine.precision, engine.input_dtype, engine.max_batch) == ("fp16", "float32", 4)
        images = torch.from_numpy(batch).cuda()
        out = engine.forward(images)
        assert hasattr(out, "__cuda_array_interface__") and tuple(out.shape) == (3, 6, 8400)
        head = out.float().cpu().numpy()
        single = engine.forward(images[1:2].contiguous()).float().cpu().numpy()
    confident = reference[:, 4:].max(1) > 0.25  # [B, A] anchors that matter after the conf filter
    assert confident.sum() >= 10
    box_err = np.abs(head[:, :4] - reference[:, :4]).transpose(0, 2, 1)[confident]
    score_err = np.abs(head[:, 4:] - reference[:, 4:]).transpose(0, 2, 1)[confident]
    assert box_err.max() < 2.0 and score_err.max() < 0.03  # pixels, probabilities
    np.testing.assert_allclose(single[0], head[1], atol=0.05)  # batch size does not change results


def test_forward_is_capturable_in_a_cuda_graph(fp16_engine, model_meta, assets_dir):
    batch = torch.from_numpy(head_inputs(assets_dir)[:2]).cuda()
    with TensorRTEngine(fp16_engine, model_meta) as engine:
        static_in = batch.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            engine.forward(static_in)  # NVIDIA: one enqueue after a shape change, before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = engine.forward(static_in)
        static_in.copy_(batch.flip(0))  # new data at the same address
        graph.replay()
        replayed = static_out.clone()
        eager = engine.forward(batch.flip(0).contiguous()).clone()
        torch.cuda.synchronize()
    torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)


def test_shape_change_inside_capture_is_refused(fp16_engine, model_meta, assets_dir):
    batch = torch.from_numpy(head_inputs(assets_dir)).cuda()
    with TensorRTEngine(fp16_engine, model_meta) as engine:
        engine.forward(batch)  # bound shape: batch 3
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(DeviceError, match="during CUDA graph capture"):
            with torch.cuda.graph(graph):
                engine.forward(batch[:1])
    torch.cuda.synchronize()


def test_close_is_idempotent_and_final(fp16_engine, model_meta, assets_dir):
    engine = TensorRTEngine(fp16_engine, model_meta)
    engine.close()
    engine.close()
    with pytest.raises(DeviceError, match="closed"):
        engine.forward(torch.zeros((1, 3, 640, 640), device="cuda"))


# --- through the Detector, against Ultralytics ----------------------------------------------------
def test_fp16_detections_match_ultralytics(fp16_engine, trt_dir, ultralytics_model, assets_dir, varied_images):
    from app.contracts import RunShape
    from app.runtime import OpenOptions, open_detector

    options = OpenOptions("sample", backend="tensorrt", precision="fp16", artifacts_dir=trt_dir,
                          shape=RunShape(max_batch=4))
    with open_detector(options) as det:
        assert det.info()["backend"] == "tensorrt" and det.info()["precision"] == "fp16"
        assert agreement(det, ultralytics_model, photo_paths(assets_dir, varied_images)) >= 0.99


def test_int8_detections_match_ultralytics(int8_engine, trt_dir, ultralytics_model, assets_dir, varied_images):
    from app.contracts import RunShape
    from app.runtime import OpenOptions, open_detector

    em = load_engine_meta(export_onnx("sample", artifacts_dir=trt_dir).model_dir, "int8")
    assert em.source_onnx == "model.int8.onnx" and em.builder_options["strongly_typed"]
    options = OpenOptions("sample", backend="tensorrt", precision="int8", artifacts_dir=trt_dir,
                          shape=RunShape(max_batch=4))
    with open_detector(options) as det:
        assert det.info()["precision"] == "int8"
        assert agreement(det, ultralytics_model, photo_paths(assets_dir, varied_images)) >= 0.90


# --- refusal -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [("compute_capability", "1.0"), ("trt_version", "9.9.9.9"), ("gpu_name", "Some Other GPU")],
)
def test_mismatched_engine_is_refused_before_deserializing(fp16_engine, model_meta, tmp_path, field, value):
    shutil.copy(fp16_engine, tmp_path / fp16_engine.name)
    index = json.loads((fp16_engine.parent / ENGINE_META_NAME).read_text())
    index["engines"]["fp16"][field] = value
    (tmp_path / ENGINE_META_NAME).write_text(json.dumps(index))
    with pytest.raises(EngineMismatch, match="does not match this machine") as info:
        TensorRTEngine(tmp_path / fp16_engine.name, model_meta)
    assert "yolopipe build-engine" in info.value.hint
    # the check comes first: a garbage plan with a mismatched description is still a mismatch
    (tmp_path / fp16_engine.name).write_bytes(b"not a plan")
    with pytest.raises(EngineMismatch):
        TensorRTEngine(tmp_path / fp16_engine.name, model_meta)


def test_corrupt_plan_is_a_clear_error(fp16_engine, model_meta, tmp_path):
    (tmp_path / fp16_engine.name).write_bytes(fp16_engine.read_bytes()[:1000])
    shutil.copy(fp16_engine.parent / ENGINE_META_NAME, tmp_path / ENGINE_META_NAME)
    with pytest.raises(ArtifactError, match="could not deserialize"):
        TensorRTEngine(tmp_path / fp16_engine.name, model_meta)

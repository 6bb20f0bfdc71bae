"""The TensorRT logic that needs no TensorRT: engine metadata, compatibility, profiles, buckets,
the per-version build recipe, engine lookup, and the refusals that must come before any
TensorRT work. Runs on any machine; nothing here stands in for TensorRT."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from app.artifacts.engines import (
    ENGINE_META_NAME,
    EngineMeta,
    build_recipe,
    check_engine_meta,
    engine_buckets,
    engine_file_name,
    engine_meta_for,
    load_engine_meta,
    pick_bucket,
    save_engine_meta,
    select_profile,
)
from app.errors import ArtifactError, BackendUnavailable, EngineMismatch, InvalidParameter
from app.types import ModelMeta


def _real_tensorrt_installed() -> bool:
    # pytest's pythonpath puts tests/ on sys.path, where tests/tensorrt is an importable namespace
    # package named "tensorrt" when the real library is absent: a real package has an origin file
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin is not None


HAS_TENSORRT = _real_tensorrt_installed()


def make_meta(precision: str = "fp16", **overrides) -> EngineMeta:
    values = dict(
        precision=precision,
        engine_file=engine_file_name(precision),
        trt_version="10.13.3.9",
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        min_batch=1,
        opt_batch=8,
        max_batch=64,
        imgsz=640,
        source_onnx="model.onnx",
        onnx_sha256="a" * 64,
        export_onnx_sha256="b" * 64,
        class_names=["Normal", "Fall"],
        weights="sample",
        created_at="2025-01-01T00:00:00+00:00",
        builder_options={"strongly_typed": False, "fp16_flag": True},
    )
    values.update(overrides)
    return EngineMeta(**values)


HERE = dict(trt_version="10.13.3.9", gpu_name="NVIDIA H200", compute_capability="9.0")


# --- compatibility -----------------------------------------------------------------------
def test_matching_engine_passes():
    check_engine_meta(make_meta(), **HERE)


@pytest.mark.parametrize(
    "field, here, words",
    [
        ("trt_version", "10.13.2.6", ["TensorRT 10.13.3.9 built it", "10.13.2.6"]),  # patch differs
        ("trt_version", "11.0.0.12", ["TensorRT 10.13.3.9", "11.0.0.12"]),  # major differs
        ("compute_capability", "8.9", ["compute capability 9.0", "8.9"]),
        ("gpu_name", "NVIDIA H100 80GB HBM3", ["'NVIDIA H200'", "'NVIDIA H100 80GB HBM3'"]),  # same sm 9.0
    ],
)
def test_any_mismatch_is_refused_with_a_rebuild_hint(field, here, words):
    with pytest.raises(EngineMismatch) as info:
        check_engine_meta(make_meta("int8"), **{**HERE, field: here})
    text = str(info.value)
    assert all(w in text for w in words), text
    assert "yolopipe build-engine --weights sample --precision int8" in info.value.hint
    assert info.value.code == "engine_mismatch"


def test_every_mismatch_is_listed_at_once():
    with pytest.raises(EngineMismatch) as info:
        check_engine_meta(make_meta(), trt_version="11.0.0.1", gpu_name="NVIDIA L4", compute_capability="8.9")
    assert info.value.message.count(";") == 2


# --- profile and buckets -------------------------------------------------------------------
@pytest.mark.parametrize("profile", [(1, 8, 64), (1, 1, 1), (4, 4, 256), (2, 3, 5)])
def test_valid_profiles(profile):
    assert select_profile(*profile) == profile


@pytest.mark.parametrize("profile", [(0, 1, 1), (2, 1, 4), (1, 8, 4), (1, 1, 257), (1.5, 2, 4), (-1, 1, 2), (True, 1, 2)])
def test_invalid_profiles(profile):
    with pytest.raises(InvalidParameter):
        select_profile(*profile)


@pytest.mark.parametrize(
    "lo, hi, expected",
    [(1, 64, [1, 2, 4, 8, 16, 32, 64]), (3, 20, [3, 4, 8, 16, 20]), (1, 1, [1]), (5, 6, [5, 6]), (1, 48, [1, 2, 4, 8, 16, 32, 48])],
)
def test_buckets(lo, hi, expected):
    assert engine_buckets(lo, hi) == expected


@pytest.mark.parametrize("lo, hi", [(1, 64), (3, 20), (7, 100), (1, 256)])
def test_every_batch_gets_the_smallest_bucket_that_holds_it(lo, hi):
    buckets = engine_buckets(lo, hi)
    assert buckets[0] == lo and buckets[-1] == hi
    for batch in range(lo, hi + 1):
        bucket = pick_bucket(batch, buckets)
        assert bucket == min(b for b in buckets if b >= batch)
        assert bucket < 2 * batch or bucket == lo  # padding at most doubles a batch
    with pytest.raises(InvalidParameter):
        pick_bucket(hi + 1, buckets)


def test_buckets_refuse_a_bad_profile():
    with pytest.raises(InvalidParameter):
        engine_buckets(8, 4)


# --- the recipe per TensorRT version -----------------------------------------------------------
def test_recipe_trt10():
    int8 = build_recipe("int8", trt_version="10.13.3.9", has_fp16_flag=True)
    assert (int8.source, int8.strongly_typed, int8.fp16_flag) == ("int8_qdq", True, False)
    fp16 = build_recipe("fp16", trt_version="10.13.3.9", has_fp16_flag=True)
    assert (fp16.source, fp16.strongly_typed, fp16.fp16_flag) == ("fp32", False, True)
    fp32 = build_recipe("fp32", trt_version="10.0.1.6", has_fp16_flag=True)
    assert (fp32.source, fp32.strongly_typed, fp32.fp16_flag, fp32.disable_tf32) == ("fp32", False, False, True)


def test_recipe_trt11_has_no_weak_typing():
    for has_flag in (False, True):  # even a stray FP16 attribute must not bring weak typing back
        fp16 = build_recipe("fp16", trt_version="11.0.0.12", has_fp16_flag=has_flag)
        assert (fp16.source, fp16.strongly_typed, fp16.fp16_flag) == ("fp16_autocast", True, False)
    int8 = build_recipe("int8", trt_version="11.1.0.4", has_fp16_flag=False)
    assert (int8.source, int8.strongly_typed, int8.fp16_flag) == ("int8_qdq", True, False)
    fp32 = build_recipe("fp32", trt_version="11.1.0.4", has_fp16_flag=False)
    assert (fp32.source, fp32.strongly_typed, fp32.fp16_flag) == ("fp32", True, False)


def test_recipe_refuses_unknown_precision():
    with pytest.raises(InvalidParameter):
        build_recipe("bf16", trt_version="10.13.3.9", has_fp16_flag=True)


# --- engine.json -------------------------------------------------------------------------------
def test_json_round_trip_keeps_each_precision(tmp_path):
    fp16, int8 = make_meta("fp16"), make_meta("int8", source_onnx="model.int8.onnx", min_batch=2)
    save_engine_meta(tmp_path, fp16)
    save_engine_meta(tmp_path, int8)
    assert load_engine_meta(tmp_path, "fp16") == fp16
    assert load_engine_meta(tmp_path, "int8") == int8
    assert load_engine_meta(tmp_path, "fp32") is None
    assert engine_meta_for(tmp_path / "model.int8.engine") == int8
    data = json.loads((tmp_path / ENGINE_META_NAME).read_text())
    assert data["format"] == 1 and sorted(data["engines"]) == ["fp16", "int8"]

    rebuilt = make_meta("fp16", trt_version="10.14.1.48")
    save_engine_meta(tmp_path, rebuilt)  # a rebuild replaces only its own entry
    assert load_engine_meta(tmp_path, "fp16") == rebuilt and load_engine_meta(tmp_path, "int8") == int8


def test_broken_engine_json_is_a_clear_error(tmp_path):
    (tmp_path / ENGINE_META_NAME).write_text("{not json")
    with pytest.raises(ArtifactError, match="unreadable engine metadata"):
        load_engine_meta(tmp_path, "fp16")
    entry = make_meta().to_dict()
    del entry["trt_version"], entry["gpu_name"]
    (tmp_path / ENGINE_META_NAME).write_text(json.dumps({"format": 1, "engines": {"fp16": entry}}))
    with pytest.raises(ArtifactError, match="lacks trt_version, gpu_name"):
        load_engine_meta(tmp_path, "fp16")
    with pytest.raises(ArtifactError, match="no entry for model.fp32.engine"):
        engine_meta_for(tmp_path / "model.fp32.engine")


# --- find_engine: files only ----------------------------------------------------------------------
def make_engine_dir(path, precisions, described=None):
    path.mkdir(parents=True, exist_ok=True)
    for p in precisions:
        (path / engine_file_name(p)).write_bytes(b"plan")
    for p in precisions if described is None else described:
        save_engine_meta(path, make_meta(p))
    return path


def test_find_engine_prefers_int8_then_fp16_then_fp32(tmp_path):
    from app.artifacts.engines import find_engine

    d = make_engine_dir(tmp_path / "all", ["fp32", "fp16", "int8"])
    assert find_engine(d, None) == d / "model.int8.engine"
    assert find_engine(d, "fp32") == d / "model.fp32.engine"
    d2 = make_engine_dir(tmp_path / "two", ["fp32", "fp16"])
    assert find_engine(d2, None) == d2 / "model.fp16.engine"
    assert find_engine(d2, "int8") is None
    d3 = make_engine_dir(tmp_path / "one", ["fp32"])
    assert find_engine(d3, None) == d3 / "model.fp32.engine"
    assert find_engine(tmp_path / "missing", None) is None
    with pytest.raises(InvalidParameter):
        find_engine(d, "int4")


def test_find_engine_needs_both_the_plan_and_its_description(tmp_path):
    from app.artifacts.engines import find_engine

    # int8 plan without an engine.json entry, fp16 entry without a plan: only fp32 is usable
    d = make_engine_dir(tmp_path / "m", ["int8", "fp32"], described=["fp16", "fp32"])
    assert find_engine(d, None) == d / "model.fp32.engine"
    (d / ENGINE_META_NAME).write_text("garbage")
    assert find_engine(d, None) is None


# --- refusals before any TensorRT work ------------------------------------------------------------
@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
@pytest.mark.parametrize("precision", ["int8", "fp16", "fp32"])
def test_build_engine_without_tensorrt_fails_before_exporting(tmp_path, precision):
    from app.builder.trt_build import build_engine

    engines = tmp_path / "engines"
    with pytest.raises(BackendUnavailable) as info:
        build_engine("sample", precision=precision, artifacts_dir=engines)  # int8 without images too
    assert "TensorRT is not installed" in info.value.message
    assert "yolopipe[tensorrt-cu13]" in info.value.hint
    assert not engines.exists()  # nothing exported, calibrated or written


def test_build_engine_checks_arguments_first(tmp_path):
    from app.builder.trt_build import build_engine

    with pytest.raises(InvalidParameter, match="max batch 300"):
        build_engine("sample", precision="fp16", max_batch=300, artifacts_dir=tmp_path)
    with pytest.raises(InvalidParameter, match="unknown precision"):
        build_engine("sample", precision="int4", artifacts_dir=tmp_path)
    with pytest.raises(InvalidParameter, match="workspace"):
        build_engine("sample", precision="fp16", workspace_gib=0, artifacts_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def model_meta(**overrides) -> ModelMeta:
    values = dict(
        name="sample", names=["Normal", "Fall"], imgsz=640, stride=32, input_name="images", output_name="output0",
        input_shape=["batch", 3, 640, 640], output_shape=["batch", 6, 8400], opset=17,
        weights_sha256="c" * 64, onnx_sha256="b" * 64,
    )
    values.update(overrides)
    return ModelMeta(**values)


def test_engine_without_metadata_is_refused(tmp_path):
    from app.backends.tensorrt import TensorRTEngine

    d = make_engine_dir(tmp_path / "m", ["fp16"], described=[])
    with pytest.raises(ArtifactError, match="no entry for model.fp16.engine"):
        TensorRTEngine(d / "model.fp16.engine", model_meta())


def test_engine_from_another_export_is_refused(tmp_path):
    from app.backends.tensorrt import TensorRTEngine

    d = make_engine_dir(tmp_path / "m", ["fp16"])
    with pytest.raises(ArtifactError, match="another export") as info:
        TensorRTEngine(d / "model.fp16.engine", model_meta(onnx_sha256="d" * 64))
    assert "--precision fp16" in info.value.hint
    with pytest.raises(ArtifactError, match="imgsz 640 and 2 classes"):
        TensorRTEngine(d / "model.fp16.engine", model_meta(names=["a", "b", "c"]))


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_engine_without_tensorrt_is_backend_unavailable(tmp_path):
    from app.backends.tensorrt import TensorRTEngine

    d = make_engine_dir(tmp_path / "m", ["fp16"])
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
        TensorRTEngine(d / "model.fp16.engine", model_meta())

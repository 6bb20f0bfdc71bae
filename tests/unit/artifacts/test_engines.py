"""engine.json, the compatibility rules and engine lookup: files only, no TensorRT, any machine."""

from __future__ import annotations

import json

import pytest

from app.artifacts.engines import (
    ENGINE_META_NAME,
    check_engine_meta,
    engine_meta_for,
    load_engine_meta,
    save_engine_meta,
)
from app.errors import ArtifactError, EngineMismatch, InvalidParameter
from tests.engine_files import make_engine_dir, make_meta

HERE = dict(trt_version="10.13.3.9", gpu_name="NVIDIA H200", compute_capability="9.0")


# --- compatibility -----------------------------------------------------------------------
def test_an_engine_described_on_this_machine_passes_after_its_round_trip(tmp_path):
    """What build-engine writes to engine.json, read back as the TensorRT backend reads it, passes
    the check on the same machine, also when the driver's strings carry padding."""
    save_engine_meta(tmp_path, make_meta("int8", **HERE))
    meta = engine_meta_for(tmp_path / "model.int8.engine")
    assert (meta.trt_version, meta.gpu_name, meta.compute_capability) == tuple(HERE.values())
    assert check_engine_meta(meta, **HERE) is None
    assert check_engine_meta(meta, **{fact: f" {value}\n" for fact, value in HERE.items()}) is None


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

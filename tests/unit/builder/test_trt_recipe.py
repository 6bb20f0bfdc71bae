"""How an engine is built, decided without TensorRT (profiles, the per-version recipe), and the
refusals ``build_engine`` makes before any TensorRT work."""

from __future__ import annotations

import pytest

from app.builder.trt_recipe import build_recipe, select_profile, spatial_profile
from app.errors import BackendUnavailable, InvalidParameter
from tests.engine_files import HAS_TENSORRT


# --- profile and buckets -------------------------------------------------------------------
@pytest.mark.parametrize("profile", [(1, 8, 64), (1, 1, 1), (4, 4, 256), (2, 3, 5)])
def test_valid_profiles(profile):
    assert select_profile(*profile) == profile


@pytest.mark.parametrize("profile", [(0, 1, 1), (2, 1, 4), (1, 8, 4), (1, 1, 257), (1.5, 2, 4), (-1, 1, 2), (True, 1, 2)])
def test_invalid_profiles(profile):
    with pytest.raises(InvalidParameter):
        select_profile(*profile)


def test_spatial_profile_spans_rect_inputs_of_a_dynamic_export_and_pins_a_fixed_one(sample_model_dir):
    """The export's input (read as TensorRT's parser reports it: -1 where dynamic) takes every
    multiple of 32 up to imgsz on each side, tuned for the square; the Q/DQ model pinned to the
    square takes that size only."""
    import onnx

    model = onnx.load(str(sample_model_dir / "model.onnx"))
    dims = [d.dim_value or -1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [-1, 3, -1, -1]
    assert spatial_profile(tuple(dims), 640) == ((32, 32), (640, 640), (640, 640))
    assert spatial_profile((-1, 3, 640, 640), 640) == ((640, 640), (640, 640), (640, 640))
    with pytest.raises(InvalidParameter):
        spatial_profile((-1, 3, -1, 640), 640)


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

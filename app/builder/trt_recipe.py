"""How a TensorRT engine is built, decided without TensorRT: the optimization profile and, for
each precision and TensorRT major version, which ONNX model is parsed and which switches are set.
Pure logic, unit tested on any machine; ``app.builder.trt_build`` carries it out."""

from __future__ import annotations

from dataclasses import dataclass

from app.config import ENGINE_PRECISIONS, MAX_BATCH, check_choice
from app.errors import ArtifactError, InvalidParameter


def select_profile(min_batch: int, opt_batch: int, max_batch: int) -> tuple[int, int, int]:
    """Validated ``(min, opt, max)`` batch of the engine's optimization profile."""
    values = (min_batch, opt_batch, max_batch)
    if any(isinstance(v, bool) or int(v) != v for v in values):
        raise InvalidParameter(f"batch sizes must be integers, got min={min_batch} opt={opt_batch} max={max_batch}")
    lo, opt, hi = (int(v) for v in values)
    if not 1 <= lo <= opt <= hi:
        raise InvalidParameter(f"batch profile needs 1 <= min <= opt <= max, got min={lo} opt={opt} max={hi}")
    if hi > MAX_BATCH:
        raise InvalidParameter(f"max batch {hi} is over the limit of {MAX_BATCH}")
    return lo, opt, hi


def spatial_profile(input_dims: tuple[int, ...], imgsz: int, stride: int = 32
                    ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """``(min, opt, max)`` input ``(height, width)`` of the engine's optimization profile, from the
    parsed network's input dims (``-1``: dynamic): a dynamic export takes every rect input, one
    stride up to ``imgsz`` on each side, tuned for the square; a model pinned to the square (the
    INT8 Q/DQ model) takes its own size only."""
    height, width = input_dims[2], input_dims[3]
    if height == width == -1:
        return (stride, stride), (imgsz, imgsz), (imgsz, imgsz)
    if -1 in (height, width):
        raise InvalidParameter(f"input dims {tuple(input_dims)}: height and width are both dynamic or both fixed")
    return (height, width), (height, width), (height, width)


# --- how each TensorRT version builds each precision --------------------------------------
@dataclass(frozen=True)
class BuildRecipe:
    """What ``build_engine`` feeds TensorRT and which switches it sets, per precision and version."""

    source: str  # "fp32" (model.onnx) | "int8_qdq" (model.int8.onnx) | "fp16_autocast" (model.fp16.onnx)
    strongly_typed: bool  # network precision comes from the ONNX types (Q/DQ, fp16 casts)
    fp16_flag: bool  # weak typing: BuilderFlag.FP16 lets TensorRT pick fp16 kernels (10.x only)
    disable_tf32: bool  # fp32 means fp32: clear BuilderFlag.TF32, which TensorRT enables by default


def trt_major(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError as exc:
        raise ArtifactError(f"cannot read the TensorRT version {version!r}") from exc


def build_recipe(precision: str, *, trt_version: str, has_fp16_flag: bool) -> BuildRecipe:
    """The documented route for ``precision`` on this TensorRT.

    * int8, 10.x and 11.x: the calibrated Q/DQ ONNX model, strongly typed network. No
      INT8 flag, no calibrator (deprecated in 10.1, removed in 11.0). The unquantized parts
      (head tail) stay fp32, exactly as in the Q/DQ model checked on the CPU.
    * fp16, 10.x (``BuilderFlag.FP16`` exists): the fp32 ONNX model, weakly typed network,
      ``BuilderFlag.FP16`` (NVIDIA's "Before (TensorRT 10.x)" migration example).
    * fp16, 11.x (the flag is gone): ModelOpt AutoCast converts the ONNX model to fp16 with fp32
      I/O, then a strongly typed build (NVIDIA's "After (TensorRT 11.x)" migration example).
    * fp32: the fp32 ONNX model; no precision flag on 10.x, strong typing on 11.x (the only mode).
    """
    check_choice("precision", precision, ENGINE_PRECISIONS)
    major = trt_major(trt_version)
    weak_typing_available = major < 11
    if precision == "int8":
        return BuildRecipe("int8_qdq", strongly_typed=True, fp16_flag=False, disable_tf32=False)
    if precision == "fp16":
        if weak_typing_available and has_fp16_flag:
            return BuildRecipe("fp32", strongly_typed=False, fp16_flag=True, disable_tf32=False)
        return BuildRecipe("fp16_autocast", strongly_typed=True, fp16_flag=False, disable_tf32=False)
    return BuildRecipe("fp32", strongly_typed=not weak_typing_available, fp16_flag=False, disable_tf32=True)

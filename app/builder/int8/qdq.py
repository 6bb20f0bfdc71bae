"""Writing the Q/DQ models from calibrated ranges (ONNX Runtime's ``quantize_static``).

Why explicit Q/DQ: TensorRT removed its INT8 calibrators in 11.0, so the scales have to be in
the ONNX model, and a strongly typed TensorRT network is built from it (``trt_build.py``).
Two models come from the same ranges:

* ``target="tensorrt"``: s8 symmetric activations and weights (zero point 0), per-channel
  weights, Q/DQ on the inputs (not the outputs) of Conv, Add, Concat, MaxPool and Resize (the
  placement NVIDIA's ModelOpt uses; SiLU stays float), float weights with a Q→DQ pair and a
  float bias: TensorRT's parser refuses a DequantizeLinear fed by an int32 bias
  (onnx-tensorrt#850, onnxruntime#14229). ``calibration.py`` then quantizes its one-sided
  activations shifted (``shift.py``) and corrects its biases (``bias.py``).
* ``target="cpu"``: u8 asymmetric activations (ORT's fast kernels; s8 symmetric Q/DQ runs
  ~1.3x slower than FP32 on a CPU), s8 per-channel weights in 7 bits (``CPU_REDUCE_RANGE``, below),
  Q/DQ on the inputs and outputs of
  the same ops, so that ORT fuses QLinearConv, QLinearAdd and QLinearConcat. Not on SiLU's
  Sigmoid and Mul nor on Split: quantizing them adds roundings, and the Convs kept float read
  float inputs. The Conv outputs (SiLU's pre-activations) get ranges fitted to SiLU
  (``thresholds.silu_preactivation_ranges``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

from app.builder.int8.graph import CPU_OP_TYPES, TENSORRT_OP_TYPES

TARGETS = ("tensorrt", "cpu")
# The CPU model's s8 weights span ±64, not ±127 (ORT's ``reduce_range``): on an x86 CPU without
# VNNI, ORT's u8×s8 kernel sums pairs of products in int16 (VPMADDUBSW) and saturates where
# 255·127·2 overflows it; with ±64 no pair can (255·64·2 < 32767). Measured by hand on an AVX2-only
# CPU, no result file (calibration/README.md, "The CPU model's weights"): one ±127 model's F1 vs
# FP32 0.858 fused, 0.964 unfused; with VNNI both run exact.
CPU_REDUCE_RANGE = True


class _DropPreprocessAdvice(logging.Filter):
    """ORT logs "Please consider (to run) pre-processing" on the root logger for every model;
    its pre-processing would rename the nodes the head analysis found. Only that line is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "consider" not in str(record.msg) or "pre-processing" not in str(record.msg)


@contextlib.contextmanager
def _quiet_ort_advice():
    root = logging.getLogger()
    advice = _DropPreprocessAdvice()
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)


def quantize_options(target: str) -> dict:
    from onnxruntime.quantization import QuantType

    if target == "tensorrt":
        return {
            "reduce_range": False,
            "weight_type": QuantType.QInt8,
            "activation_type": QuantType.QInt8,
            "op_types_to_quantize": list(TENSORRT_OP_TYPES),
            "extra_options": {
                "ActivationSymmetric": True,
                "WeightSymmetric": True,
                "QuantizeBias": False,  # TensorRT cannot parse DQ of an int32 bias
                "AddQDQPairToWeight": True,  # float weights + Q→DQ: TensorRT folds them itself
                # Inputs only, as ModelOpt places them: a Q on a Conv output would quantize the
                # pre-activation (SiLU input) and the head's box and class logits.
                "OpTypesToExcludeOutputQuantization": list(TENSORRT_OP_TYPES),
            },
        }
    if target == "cpu":
        return {
            "reduce_range": CPU_REDUCE_RANGE,
            "weight_type": QuantType.QInt8,
            "activation_type": QuantType.QUInt8,
            "op_types_to_quantize": list(CPU_OP_TYPES),
            "extra_options": {"ActivationSymmetric": False, "WeightSymmetric": True},
        }
    raise ValueError(f"unknown target {target!r}; one of {', '.join(TARGETS)}")


def write_qdq_model(onnx_path: Path, out_path: Path, ranges_path: Path, method: str, *, target: str,
                    float_nodes: Sequence[str] = ()) -> Path:
    """Write the ``target`` Q/DQ model from the ranges in ``ranges_path`` (an ORT calibration cache).

    ``float_nodes`` stay float (the head tail, the head's last Convs, mixed-precision layers).
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    ort_method = {"entropy": CalibrationMethod.Entropy, "max": CalibrationMethod.MinMax, "mse": CalibrationMethod.MinMax,
                  "percentile": CalibrationMethod.Percentile}[method]  # a label: the ranges come from the cache
    with _quiet_ort_advice():
        quantize_static(
            str(onnx_path),
            str(out_path),
            calibration_data_reader=None,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            nodes_to_exclude=list(float_nodes),
            calibrate_method=ort_method,
            calibration_cache_path=str(ranges_path),
            **quantize_options(target),
        )
    return Path(out_path)

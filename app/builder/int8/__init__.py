"""INT8 calibration (build time): images → histograms → ranges → Q/DQ models → report.

``images`` (inputs), ``collect`` and ``histograms`` (the calibration pass), ``thresholds``
(entropy, percentile, mse, max), ``graph`` (what stays float, what to calibrate, FLOPs), ``qdq``
(writing the models), ``shift`` and ``bias`` (the TensorRT model's shifted s8 and bias
correction), ``report`` (agreement with FP32), ``sensitivity`` (mixed precision) and
``calibration`` (the command, ``calibrate``). Importing this package loads none of onnx, onnxruntime or Numba.
"""

from app.builder.int8.calibration import DEFAULT_METHOD, CalibrationResult, calibrate
from app.builder.int8.thresholds import METHODS

__all__ = ["DEFAULT_METHOD", "METHODS", "CalibrationResult", "calibrate"]

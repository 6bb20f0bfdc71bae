"""Where the CLI and ``trt_build`` still import calibration from; it lives in ``app.builder.int8``."""

from app.builder.int8 import DEFAULT_METHOD, METHODS, CalibrationResult, calibrate

__all__ = ["DEFAULT_METHOD", "METHODS", "CalibrationResult", "calibrate"]

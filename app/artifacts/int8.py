"""Where the INT8 build artifacts live, in one place.

A model's artifacts folder (one export, see ``app.artifacts.store``) gains:

* ``model.int8.onnx``: the TensorRT-ready Q/DQ model: symmetric s8 activations and weights
  (zero points 0), per-channel weight scales, the head tail left float.
* ``model.int8-cpu.onnx``: the same calibration written for ONNX Runtime on a CPU: u8
  asymmetric activations, s8 per-channel weights, Q/DQ on every op ORT can fuse.
* ``int8_report.json``: INT8 vs FP32 agreement on held-out images.

Calibration caches live in its ``calibration/`` folder: the activation histograms of one
calibration pass (``.npz``, every method's ranges come from them), keyed by the FP32 model's
sha256, the histogram settings and a hash of the calibration images' contents, and each method's
per-tensor ranges in ONNX Runtime's calibration-cache format (``.json``), which
``quantize_static`` reads, and the layer sensitivities mixed precision measured on each model
(``-sens-<target>.json``), keyed by everything they depend on.
"""

from __future__ import annotations

from pathlib import Path

from app.errors import ArtifactError

INT8_QDQ_NAME = "model.int8.onnx"
INT8_CPU_NAME = "model.int8-cpu.onnx"
INT8_REPORT_NAME = "int8_report.json"


def int8_qdq_model_path(model_dir: Path) -> Path:
    """The TensorRT-ready Q/DQ model (s8 symmetric); not checked for existence."""
    return Path(model_dir) / INT8_QDQ_NAME


def int8_cpu_model_path(model_dir: Path, *, must_exist: bool = True) -> Path:
    """The u8-activation model ONNX Runtime runs for ``--precision int8``.

    With ``must_exist`` (the default, what a backend wants) a missing file is an
    ``ArtifactError`` that says how to make it.
    """
    path = Path(model_dir) / INT8_CPU_NAME
    if must_exist and not path.is_file():
        raise ArtifactError(
            f"no INT8 model in {model_dir}",
            hint="run `yolopipe calibrate --weights ... --images DIR` first",
        )
    return path


def int8_report_path(model_dir: Path) -> Path:
    return Path(model_dir) / INT8_REPORT_NAME


def calibration_cache_dir(model_dir: Path) -> Path:
    """Where the calibration passes of one export are cached: inside its artifacts folder."""
    return Path(model_dir) / "calibration"


def histogram_cache_path(onnx_sha256: str, settings: str, images_sha256: str, root: Path) -> Path:
    """The activation histograms of one (model, settings, image list) calibration pass."""
    return Path(root) / f"{onnx_sha256[:16]}-hist{settings}-{images_sha256[:16]}.npz"


def calibration_cache_path(onnx_sha256: str, method: str, images_sha256: str, root: Path) -> Path:
    """The per-tensor ranges of one (model, method + settings, image list) calibration."""
    return Path(root) / f"{onnx_sha256[:16]}-{method}-{images_sha256[:16]}.json"


def sensitivity_cache_path(key: str, target: str, root: Path) -> Path:
    """The per-layer sensitivities of one ``target`` model (``key``: a hash of what they depend on)."""
    return Path(root) / f"{key[:24]}-sens-{target}.json"

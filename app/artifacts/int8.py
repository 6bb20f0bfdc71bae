"""Where the INT8 build artifacts live, in one place.

A model's artifacts folder (one export, see ``app.artifacts.store``) gains:

* ``model.int8.onnx``: the TensorRT-ready Q/DQ model: symmetric s8 activations and weights
  (zero points 0), per-channel weight scales, the head tail left float.
* ``model.int8-cpu.onnx``: the same calibration written for ONNX Runtime on a CPU: u8
  asymmetric activations, s8 per-channel weights, Q/DQ on every op ORT can fuse.
* ``int8_report.json``: INT8 vs FP32 agreement on held-out images.

The three are installed together (``install_int8``): written beside their final names first, then
a journal naming the moves is committed (one atomic rename) and the moves are made. A calibration
killed before the commit leaves the installed files as they were (its leftovers are removed by
the next calibration); killed after it, the next reader of any of the paths below finishes the
moves. So a reader never sees the new TensorRT model beside the old CPU model or report.

Calibration caches live in its ``calibration/`` folder: the activation histograms of one
calibration pass (``.npz``, every method's ranges come from them), keyed by the FP32 model's
sha256, the histogram settings and a hash of the calibration images' contents, and each method's
per-tensor ranges in ONNX Runtime's calibration-cache format (``.json``), which
``quantize_static`` reads, and the layer sensitivities mixed precision measured on each model
(``-sens-<target>.json``), keyed by everything they depend on.
"""

from __future__ import annotations

import json
from pathlib import Path

from app.errors import ArtifactError

INT8_QDQ_NAME = "model.int8.onnx"
INT8_CPU_NAME = "model.int8-cpu.onnx"
INT8_REPORT_NAME = "int8_report.json"
INSTALL_JOURNAL_NAME = "int8.install.json"
STAGED_SUFFIX = ".new"  # model.int8.new.onnx: written, not installed


def staged_path(final: Path) -> Path:
    """Where a file is written before ``install_int8`` moves it to ``final``."""
    return final.with_name(final.stem + STAGED_SUFFIX + final.suffix)


def install_int8(model_dir: Path, finals: list[Path]) -> None:
    """Move each ``staged_path(final)`` to ``final``, all or none (see the module docstring)."""
    model_dir = Path(model_dir)
    journal = model_dir / INSTALL_JOURNAL_NAME
    tmp = journal.with_name(journal.name + ".tmp")
    tmp.write_text(json.dumps({"moves": [[staged_path(f).name, f.name] for f in finals]}) + "\n")
    tmp.replace(journal)  # the commit: from here the install is finished by whoever comes next
    finish_install(model_dir)


def finish_install(model_dir: Path) -> None:
    """Finish an install whose journal was committed (its process may have been killed)."""
    journal = Path(model_dir) / INSTALL_JOURNAL_NAME
    if not journal.is_file():
        return
    try:
        moves = json.loads(journal.read_text())["moves"]
        for src, dst in moves:
            staged = Path(model_dir) / src
            if staged.is_file():
                staged.replace(Path(model_dir) / dst)
        journal.unlink(missing_ok=True)
    except (OSError, ValueError, KeyError):  # a read-only folder or a torn journal: the files stay as they are
        return


def discard_staged(model_dir: Path) -> None:
    """Remove what a killed calibration staged and never committed (no journal names it)."""
    finish_install(model_dir)
    for final in (int8_qdq_model_path(model_dir), int8_cpu_model_path(model_dir, must_exist=False),
                  int8_report_path(model_dir)):
        staged_path(final).unlink(missing_ok=True)
    (Path(model_dir) / (INSTALL_JOURNAL_NAME + ".tmp")).unlink(missing_ok=True)


def int8_qdq_model_path(model_dir: Path) -> Path:
    """The TensorRT-ready Q/DQ model (s8 symmetric); not checked for existence. An install
    interrupted after its commit is finished first."""
    finish_install(model_dir)
    return Path(model_dir) / INT8_QDQ_NAME


def int8_cpu_model_path(model_dir: Path, *, must_exist: bool = True) -> Path:
    """The u8-activation model ONNX Runtime runs for ``--precision int8``.

    With ``must_exist`` (the default, what a backend wants) a missing file is an
    ``ArtifactError`` that says how to make it.
    """
    finish_install(model_dir)
    path = Path(model_dir) / INT8_CPU_NAME
    if must_exist and not path.is_file():
        raise ArtifactError(
            f"no INT8 model in {model_dir}",
            hint="run `yolopipe calibrate --weights ... --images DIR` first",
        )
    return path


def int8_report_path(model_dir: Path) -> Path:
    finish_install(model_dir)
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

"""An ONNX export and its ``meta.json``: the files the builder writes and every backend reads."""

from __future__ import annotations

from pathlib import Path

from app.errors import ArtifactError
from app.types import ModelMeta

ONNX_NAME = "model.onnx"
META_NAME = "meta.json"
WEIGHTS_COPY_NAME = "weights.pt"  # the torch-cuda backend and fidelity checks load the exact weights


def current_export(model_dir: Path, *, weights_sha256: str, imgsz: int) -> tuple[Path, ModelMeta] | None:
    """The export in ``model_dir`` when it is complete, made from these weights at this size, and
    takes any input height and width (``ModelMeta.dynamic_hw``)."""
    onnx_path, meta_path = Path(model_dir) / ONNX_NAME, Path(model_dir) / META_NAME
    if not (onnx_path.is_file() and meta_path.is_file() and (Path(model_dir) / WEIGHTS_COPY_NAME).is_file()):
        return None
    try:
        meta = ModelMeta.load(meta_path)
    except (OSError, ValueError, TypeError):  # unreadable or from another version: export again
        return None
    # An export pinned to the square (made before rect inputs) cannot take them: exported again.
    if meta.weights_sha256 != weights_sha256 or meta.imgsz != imgsz or not meta.dynamic_hw:
        return None
    return onnx_path, meta


def load_export(model_dir: Path) -> tuple[Path, ModelMeta]:
    """An existing export: ``(model.onnx, ModelMeta)``; a clear error when it is not there."""
    onnx_path, meta_path = Path(model_dir) / ONNX_NAME, Path(model_dir) / META_NAME
    if not onnx_path.is_file() or not meta_path.is_file():
        raise ArtifactError(f"no export in {model_dir}", hint="run `yolopipe export --weights ...` first")
    return onnx_path, ModelMeta.load(meta_path)

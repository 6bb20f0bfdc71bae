"""``.pt`` → ``engines/<name>/model.onnx`` + ``meta.json`` (build time only).

The ONNX model has a dynamic batch and a fixed ``imgsz × imgsz`` input. Ultralytics'
``dynamic=True`` makes height and width dynamic too, so we export that way and then pin
H and W and let onnxslim fold every shape computation that depended on them: the result is
the same graph a static export gives, with only the batch left free.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from app.errors import ArtifactError, WeightsError
from app.types import ModelMeta
from app.versions import package_versions
from app.weights import resolve_weights, sha256_file

DEFAULT_OPSET = 17
ONNX_NAME = "model.onnx"
META_NAME = "meta.json"


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    meta: ModelMeta
    reused: bool  # True when the existing export already matched the weights


def engine_name(weights_spec: str, weights_path: Path) -> str:
    return "sample" if weights_spec == "sample" else weights_path.stem


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def pin_spatial_dims(model, imgsz: int):
    """Fix input H and W to ``imgsz``, keep the batch dynamic, and fold the shapes that follow."""
    import onnxslim

    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_param = "batch"
    for d in dims[2:]:
        d.ClearField("dim_param")
        d.dim_value = imgsz
    for out in model.graph.output:  # let shape inference recompute them from the pinned input
        out.type.tensor_type.shape.ClearField("dim")
    return onnxslim.slim(model)


def export_onnx(
    weights: str = "sample",
    *,
    imgsz: int = 640,
    name: str | None = None,
    engines_dir: Path = Path("engines"),
    opset: int = DEFAULT_OPSET,
    force: bool = False,
) -> ExportResult:
    """Export the weights to ONNX unless ``engines/<name>`` already holds an export of them."""
    import onnx

    if imgsz % 32:
        raise WeightsError(f"imgsz must be a multiple of 32 (the model's largest stride), got {imgsz}")
    weights_path = resolve_weights(weights)
    out_dir = Path(engines_dir) / (name or engine_name(weights, weights_path))
    onnx_path, meta_path = out_dir / ONNX_NAME, out_dir / META_NAME
    weights_sha = sha256_file(weights_path)
    if not force and onnx_path.is_file() and meta_path.is_file():
        meta = ModelMeta.load(meta_path)
        if meta.weights_sha256 == weights_sha and meta.imgsz == imgsz and meta.onnx_sha256 == sha256_file(onnx_path):
            return ExportResult(onnx_path, meta, reused=True)

    # Export needs no network: keep Ultralytics from reaching for it (settings checks, fonts).
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from ultralytics import YOLO

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        local_pt = Path(tmp) / "model.pt"  # Ultralytics writes its export beside the weights
        shutil.copyfile(weights_path, local_pt)
        model = YOLO(str(local_pt))
        if model.task != "detect":
            raise WeightsError(f"{weights_path} is a '{model.task}' model; yolopipe serves detection models")
        names = [model.names[i] for i in sorted(model.names)]
        stride = int(max(model.model.stride))
        exported = Path(
            model.export(format="onnx", imgsz=imgsz, dynamic=True, simplify=True, opset=opset, verbose=False)
        )
        graph = pin_spatial_dims(onnx.load(str(exported)), imgsz)
    onnx.checker.check_model(graph)
    input_shape, output_shape = _dims(graph.graph.input[0]), _dims(graph.graph.output[0])
    if output_shape[1] != 4 + len(names):
        raise ArtifactError(f"unexpected head output {output_shape} for {len(names)} classes")
    tmp_path = onnx_path.with_suffix(".tmp")
    onnx.save(graph, str(tmp_path))
    tmp_path.replace(onnx_path)
    meta = ModelMeta(
        name=out_dir.name,
        names=names,
        imgsz=imgsz,
        stride=stride,
        input_name=graph.graph.input[0].name,
        output_name=graph.graph.output[0].name,
        input_shape=input_shape,
        output_shape=output_shape,
        opset=opset,
        weights_sha256=weights_sha,
        onnx_sha256=sha256_file(onnx_path),
        versions=package_versions(("ultralytics", "torch", "onnx", "onnxslim")),
    )
    meta.save(meta_path)
    shutil.copyfile(weights_path, out_dir / "weights.pt")  # torch-cuda backend and fidelity checks load it
    return ExportResult(onnx_path, meta, reused=False)


def load_export(model_dir: Path) -> tuple[Path, ModelMeta]:
    """An existing export: ``(model.onnx, ModelMeta)``; a clear error when it is not there."""
    onnx_path, meta_path = Path(model_dir) / ONNX_NAME, Path(model_dir) / META_NAME
    if not onnx_path.is_file() or not meta_path.is_file():
        raise ArtifactError(f"no export in {model_dir}", hint="run `yolopipe export --weights ...` first")
    return onnx_path, ModelMeta.load(meta_path)

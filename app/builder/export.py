"""``.pt`` → ``model.onnx`` + ``meta.json`` in the model's artifacts folder (build time only).

The ONNX model has a dynamic batch, height and width (``["batch", 3, "height", "width"]``):
Ultralytics' ``dynamic=True`` export, which computes its anchors from the input's shape, so one
model runs the ``imgsz`` square and every rect input (multiples of the stride, up to ``imgsz``)
alike, with the square's outputs bit-equal to a static export's. Tools that need fixed shapes
(the INT8 calibration) take a copy pinned to the square (``pin_spatial_dims``).

The same weights give the same bytes on every export, in any process (Ultralytics stamps the
export time into the model's metadata, and onnxslim names the intermediate tensors' dynamic
sizes in an order that follows the process's hash seed: both are dropped), so an export's
sha256 identifies it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.artifacts.exports import META_NAME, ONNX_NAME, WEIGHTS_COPY_NAME, current_export
from app.artifacts.store import artifacts_root, model_dir
from app.config import check_imgsz
from app.errors import ArtifactError, WeightsError
from app.types import ModelMeta
from app.versions import package_versions
from app.weights import CHECKPOINT_HINT, ResolvedWeights, resolve_weights, sha256_file

DEFAULT_OPSET = 17
UNSTABLE_METADATA = ("date",)  # differs on every export of the same weights


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    meta: ModelMeta
    reused: bool  # True when the existing export already matched the weights

    @property
    def model_dir(self) -> Path:
        return self.onnx_path.parent


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def pin_spatial_dims(model, imgsz: int):
    """A copy of the export with input H and W fixed to ``imgsz`` and the shapes that followed
    from them folded (onnxslim): the graph a static export gives, the batch left free."""
    import onnx
    import onnxslim

    model, source = onnx.ModelProto(), model
    model.CopyFrom(source)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_param = "batch"
    for d in dims[2:]:
        d.ClearField("dim_param")
        d.dim_value = imgsz
    for out in model.graph.output:  # let shape inference recompute them from the pinned input
        out.type.tensor_type.shape.ClearField("dim")
    return onnxslim.slim(model)


def square_export(export: ExportResult, folder: Path) -> Path:
    """The export pinned to its ``imgsz`` square (``pin_spatial_dims``), for the tools that need
    fixed shapes (the INT8 calibration: its models take the square only); written once into
    ``folder``, named by the export's sha256 (the same export gives the same copy)."""
    import onnx

    meta = export.meta
    path = Path(folder) / f"{meta.onnx_sha256[:16]}-square{meta.imgsz}.onnx"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".square-", suffix=".onnx", dir=path.parent)
        os.close(fd)
        try:
            onnx.save(pin_spatial_dims(onnx.load(str(export.onnx_path)), meta.imgsz), tmp)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def _ultralytics_offline() -> Iterator[None]:
    """Ultralytics without the network or its banners for the length of one export only."""
    saved = {k: os.environ.get(k) for k in ("YOLO_OFFLINE", "YOLO_VERBOSE")}
    os.environ.update(YOLO_OFFLINE="1", YOLO_VERBOSE="False")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _load_detection_model(weights: ResolvedWeights, workdir: Path):
    """The Ultralytics model of a ``.pt``; ``WeightsError`` for anything that is not a detector."""
    local_pt = workdir / "model.pt"  # Ultralytics writes its export beside the weights
    shutil.copyfile(weights.path, local_pt)
    from ultralytics import YOLO

    try:
        model = YOLO(str(local_pt))
    except Exception as exc:  # torch.load and Ultralytics raise many types for a file that is no checkpoint
        # Their messages name our temporary copy and carry banners: the user's file and the type say it.
        raise WeightsError(
            f"{weights.path} is not an Ultralytics YOLO checkpoint: torch could not load it ({type(exc).__name__})",
            hint=CHECKPOINT_HINT,
        ) from None
    if model.task != "detect":
        raise WeightsError(f"{weights.path} is a '{model.task}' model; yolopipe serves detection models")
    return model


def export_onnx(
    weights: str = "sample",
    *,
    imgsz: int = 640,
    artifacts_dir: Path | None = None,
    opset: int = DEFAULT_OPSET,
    force: bool = False,
) -> ExportResult:
    """Export the weights to ONNX unless their artifacts folder already holds that export."""
    check_imgsz(imgsz)
    resolved = resolve_weights(weights)
    out_dir = model_dir(artifacts_root(artifacts_dir), resolved.name, resolved.sha256, imgsz)
    if not force and (found := current_export(out_dir, weights_sha256=resolved.sha256, imgsz=imgsz)):
        return ExportResult(found[0], found[1], reused=True)

    import onnx

    with _ultralytics_offline(), tempfile.TemporaryDirectory() as tmp:
        model = _load_detection_model(resolved, Path(tmp))
        names = [model.names[i] for i in sorted(model.names)]
        strides = [int(s) for s in model.model.stride]
        stride, anchors = max(strides), sum((imgsz // s) ** 2 for s in strides)
        exported = Path(
            model.export(format="onnx", imgsz=imgsz, dynamic=True, simplify=True, opset=opset, verbose=False)
        )
        graph = onnx.load(str(exported))
    for prop in [p for p in graph.metadata_props if p.key in UNSTABLE_METADATA]:
        graph.metadata_props.remove(prop)
    # The shapes onnxslim annotates each intermediate tensor with name its dynamic sizes by sympy
    # expressions, whose printed order follows the process's hash seed: two processes exported
    # the same weights to different bytes. They are hints only (every runtime infers shapes).
    del graph.graph.value_info[:]
    onnx.checker.check_model(graph)
    input_shape, output_shape = _dims(graph.graph.input[0]), _dims(graph.graph.output[0])
    if output_shape[1] != 4 + len(names) or not all(isinstance(d, str) for d in input_shape[2:]):
        raise ArtifactError(f"unexpected export: input {input_shape}, head output {output_shape} "
                            f"for {len(names)} classes")
    output_shape[2] = anchors  # the dynamic graph's count at the square: one per cell of each stride's grid

    # Written into a fresh folder, then moved into place: a failed export leaves nothing behind.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir.parent))
    try:
        onnx.save(graph, str(staging / ONNX_NAME))

        meta = ModelMeta(
            name=resolved.name,
            names=names,
            imgsz=imgsz,
            stride=stride,
            input_name=graph.graph.input[0].name,
            output_name=graph.graph.output[0].name,
            input_shape=input_shape,
            output_shape=output_shape,
            opset=opset,
            weights_sha256=resolved.sha256,
            onnx_sha256=sha256_file(staging / ONNX_NAME),
            versions=package_versions(("ultralytics", "torch", "onnx", "onnxslim")),
        )
        meta.save(staging / META_NAME)
        shutil.copyfile(resolved.path, staging / WEIGHTS_COPY_NAME)
        out_dir.mkdir(exist_ok=True)
        for name in (ONNX_NAME, WEIGHTS_COPY_NAME, META_NAME):  # meta.json last: it marks the export complete
            (staging / name).replace(out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ExportResult(out_dir / ONNX_NAME, meta, reused=False)

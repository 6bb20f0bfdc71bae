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
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import errors
from app.artifacts.exports import META_NAME, ONNX_NAME, WEIGHTS_COPY_NAME, current_export
from app.artifacts.store import artifacts_root, model_dir
from app.builder.child import child_env
from app.config import check_imgsz
from app.errors import ArtifactError, WeightsError, YolopipeError
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


def _head_of(model, imgsz: int) -> tuple[list[str], int, int]:
    """An Ultralytics model's class names, its largest stride, and its head's outputs per image at
    the ``imgsz`` square (one per cell of each stride's grid)."""
    names = [model.names[i] for i in sorted(model.names)]
    strides = [int(s) for s in model.model.stride]
    return names, max(strides), sum((imgsz // s) ** 2 for s in strides)


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
        names, stride, anchors = _head_of(model, imgsz)
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


# ``export_beside``'s child: the export, then one JSON line (its ONNX path, or the error it raised).
EXPORT_CHILD = """
import json, sys
from pathlib import Path
from app.builder.export import export_onnx
from app.errors import YolopipeError
weights, imgsz, opset, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    done = export_onnx(weights, imgsz=imgsz, opset=opset, artifacts_dir=Path(root) if root else None)
except YolopipeError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": exc.message, "hint": exc.hint}))
    sys.exit(3)
print(json.dumps({"onnx": str(done.onnx_path)}))
"""


@dataclass(frozen=True)
class ExportUnderWay:
    """What a build needs of an export before it is written (``export_beside``): the folder it
    goes to, the weights, and the model's meta as the checkpoint gives it (the export's own
    fields, its ONNX names and hash, come with ``ExportBeside.result``)."""

    model_dir: Path
    weights: Path
    meta: ModelMeta


class ExportBeside:
    """An export running in a process of its own, or one already made (``export_beside``)."""

    def __init__(self, under_way: ExportUnderWay, proc: subprocess.Popen | None, done: ExportResult | None,
                 stderr: Any = None) -> None:
        self.under_way, self._proc, self._done, self._stderr = under_way, proc, done, stderr

    def result(self) -> ExportResult:
        """Wait for the export: its result, or the error it raised (the same type and words), and
        an ``ArtifactError`` where its model differs from the one the checkpoint gave."""
        if self._done is None:
            stdout, _ = self._proc.communicate()
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            said = json.loads(lines[-1]) if lines else {}
            if "error" in said:
                kind = getattr(errors, said["error"], None)
                kind = kind if isinstance(kind, type) and issubclass(kind, YolopipeError) else ArtifactError
                raise kind(said["message"], hint=said.get("hint"))
            if self._proc.returncode != 0 or "onnx" not in said:
                self._stderr.seek(0)
                tail = " | ".join(line.strip() for line in self._stderr.read().strip().splitlines()[-8:])
                raise ArtifactError(f"the ONNX export failed (exit code {self._proc.returncode}): {tail}"[:1500])
            meta = ModelMeta.load(Path(said["onnx"]).with_name(META_NAME))
            self._done = ExportResult(Path(said["onnx"]), meta, reused=False)
        mine, theirs = self.under_way.meta, self._done.meta
        if (mine.names, mine.imgsz, mine.num_anchors, mine.weights_sha256) != (
                theirs.names, theirs.imgsz, theirs.num_anchors, theirs.weights_sha256):
            raise ArtifactError(f"the export of {self._done.model_dir} is not the model its checkpoint holds: "
                                f"{theirs.num_classes} classes and {theirs.num_anchors} outputs against "
                                f"{mine.num_classes} and {mine.num_anchors}", hint="re-export it: `yolopipe export --force`")
        return self._done


@contextlib.contextmanager
def export_beside(weights: str = "sample", *, imgsz: int = 640, artifacts_dir: Path | None = None,
                  opset: int = DEFAULT_OPSET) -> Iterator[ExportBeside]:
    """``export_onnx`` in a process of its own while the block builds from the checkpoint: an
    ONNX export is CPU work (seconds of tracing and simplifying) that a GPU build does not wait
    for. The block gets what it needs at once (``ExportBeside.under_way``; the checkpoint is
    loaded here, so a file that is no detector fails here, as the export would) and waits for
    the export with ``ExportBeside.result``. An export already made: no process. A process not
    waited for is killed when the block ends."""
    check_imgsz(imgsz)
    resolved = resolve_weights(weights)
    out_dir = model_dir(artifacts_root(artifacts_dir), resolved.name, resolved.sha256, imgsz)
    if found := current_export(out_dir, weights_sha256=resolved.sha256, imgsz=imgsz):
        yield ExportBeside(ExportUnderWay(out_dir, out_dir / WEIGHTS_COPY_NAME, found[1]), None,
                           ExportResult(found[0], found[1], reused=True))
        return
    env = child_env()
    args = [str(weights), str(imgsz), str(opset), str(artifacts_dir or "")]
    # Its warnings go to a file, not a pipe: a pipe nobody reads until the build ends would stop it
    # once full.
    with tempfile.TemporaryFile("w+") as said:
        proc = subprocess.Popen([sys.executable, "-c", EXPORT_CHILD, *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=said, text=True, env=env)
        try:
            meta = checkpoint_meta(resolved, imgsz, opset)
            yield ExportBeside(ExportUnderWay(out_dir, resolved.path, meta), proc, None, said)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.communicate()


def checkpoint_meta(weights: ResolvedWeights, imgsz: int, opset: int = DEFAULT_OPSET) -> ModelMeta:
    """The meta ``export_onnx`` writes, from the checkpoint alone: its classes and its head's
    outputs at the ``imgsz`` square, with the input and output names Ultralytics' export gives."""
    with _ultralytics_offline(), tempfile.TemporaryDirectory() as tmp:
        names, stride, anchors = _head_of(_load_detection_model(weights, Path(tmp)), imgsz)
    return ModelMeta(name=weights.name, names=names, imgsz=imgsz, stride=stride, input_name="images",
                     output_name="output0", input_shape=["batch", 3, "height", "width"],
                     output_shape=["batch", 4 + len(names), anchors], opset=opset, weights_sha256=weights.sha256)

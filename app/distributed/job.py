"""``predict_with_ray``: folder inference as a Ray Data job over every GPU (or CPU) of a cluster.

    names + paths ─(read tasks: bytes)─▶ detector actors, one per GPU ─(records)─▶ driver ─▶ JSONL | Parquet

The driver lists the source, drops what ``resume`` finds already written, builds the model's
artifacts once (the ONNX export; TensorRT engines are whatever ``yolopipe build-engine`` left
beside it) and hands every actor their folder. Ray Data streams the rest with bounded memory.

Fault tolerance is Ray Data's: read tasks are retried (``max_retries=-1``) and the actors are
restartable with their tasks retried (``max_restarts=-1``, ``max_task_retries=-1``, Ray Data's
defaults for ``map_batches`` actors, relied on here). A dead node costs the batches it held;
the driver writes each image once however often it was run (``app.distributed.output``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.artifacts.exports import load_export
from app.config import BACKENDS, PRECISIONS, check_choice
from app.contracts import make_params
from app.distributed.actor import DetectorActor, read_batch
from app.distributed.output import done_images, open_sink, resolve_format
from app.distributed.sources import open_source
from app.errors import BackendUnavailable, InvalidParameter, YolopipeError
from app.pipeline.folder import FolderSummary
from app.runtime import export_model

ERRORS_KEPT = 1000  # error_files listed in the summary; the output file has them all


@dataclass(frozen=True)
class ActorPlan:
    """How many detector actors, on what, with which backend."""

    actors: int
    gpu: bool
    backend: str


def predict_with_ray(
    source: str,
    out: Path,
    *,
    address: str | None = None,
    weights: str = "sample",
    backend: str = "auto",
    precision: str = "auto",
    imgsz: int = 640,
    artifacts_dir: Path | None = None,
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    classes: Sequence[int] | None = None,
    agnostic: bool = False,
    batch: int = 32,
    num_gpus: int | None = None,
    num_cpu_actors: int | None = None,
    ort_threads: int | None = None,
    resume: bool = False,
    output_format: str | None = None,
    ship_artifacts: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> FolderSummary:
    """Detect objects in every image of ``source`` on a Ray cluster; same records as ``predict``.

    ``address``: a running cluster (``auto``, ``host:port``, ``ray://host:10001``); ``None``
    starts Ray on this machine (or uses the one this process already joined). ``num_gpus``:
    GPU actors, one GPU each (default: every GPU of the cluster); ``num_cpu_actors``: ONNX
    Runtime actors when the cluster has no GPU or ``backend="onnxruntime"`` (default: one per
    node), each using ``ort_threads`` threads (default: ONNX Runtime's choice). ``batch``: images
    per actor call, also the detector's largest batch (its CUDA graphs are captured up to it).
    ``ship_artifacts``: put the model folder in Ray's object store for nodes that do not share
    the driver's disk (default: when joining a running cluster).
    """
    if batch < 1:
        raise InvalidParameter(f"batch must be >= 1, got {batch}")
    check_choice("backend", backend, BACKENDS)
    check_choice("precision", precision, PRECISIONS)
    for name, value in (("num_gpus", num_gpus), ("num_cpu_actors", num_cpu_actors), ("ort_threads", ort_threads)):
        if value is not None and value < 0:
            raise InvalidParameter(f"{name} must be >= 0, got {value}")
    fmt = resolve_format(out, output_format)
    src = open_source(source)
    done = done_images(out, fmt) if resume else set()
    todo = [(name, path) for name, path in src.items if name not in done]
    summary = FolderSummary(skipped=len(src.items) - len(todo))
    model_dir = export_model(weights, imgsz=imgsz, artifacts_dir=artifacts_dir)  # once, here on the driver
    meta = load_export(model_dir)[1]
    params = {"conf": conf, "iou": iou, "max_det": max_det, "classes": classes, "agnostic": agnostic}
    make_params(**params, num_classes=len(meta.names))  # a bad value fails here, not in every actor
    if on_progress:
        on_progress(0, len(todo))
    sink = open_sink(out, fmt, resume=resume)
    try:
        if todo:
            with ray_session(address) as ray:
                plan = plan_actors(ray, backend, num_gpus, num_cpu_actors)
                ship = ship_artifacts if ship_artifacts is not None else address is not None
                bundle = None
                if ship:
                    from app.distributed.shipping import pack_model_dir

                    bundle = [ray.put(pack_model_dir(model_dir))]
                actor_kwargs = {
                    "model_dir": str(model_dir.resolve()),
                    "onnx_sha256": meta.onnx_sha256,
                    "open_kwargs": {"backend": plan.backend, "precision": precision, "max_batch": batch},
                    "params": params,
                    "bundle": bundle,
                    "ort_threads": ort_threads,
                }
                stream = _records(ray, src, todo, plan, batch, actor_kwargs, quiet=on_progress is not None)
                _write(stream, sink, done, summary, len(todo), on_progress)
    finally:
        sink.close()
    return summary


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[Any]:
    """Ray, connected: the session this process already has, else a new one closed afterwards."""
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailable("Ray is not installed", hint="pip install 'yolopipe[ray]'") from exc
    if ray.is_initialized():
        yield ray
        return
    try:
        if address is None:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise BackendUnavailable(f"cannot start or join the Ray cluster at {address or 'this machine'}: {exc}") from exc
    try:
        yield ray
    finally:
        ray.shutdown()


def plan_actors(ray: Any, backend: str, num_gpus: int | None, num_cpu_actors: int | None) -> ActorPlan:
    """One actor per GPU; ONNX Runtime actors on CPUs when there is no GPU or they are asked for."""
    cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
    cpu = backend == "onnxruntime" or (backend == "auto" and (cluster_gpus == 0 or num_gpus == 0))
    if cpu:
        nodes = sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1)
        return ActorPlan(num_cpu_actors or max(1, nodes), gpu=False, backend="onnxruntime")
    if num_gpus == 0:
        raise InvalidParameter(f"backend {backend} runs on GPUs and num_gpus is 0", hint="use --backend onnxruntime")
    if cluster_gpus == 0:
        raise BackendUnavailable(f"backend {backend} needs GPUs and the Ray cluster has none",
                                 hint="use --backend onnxruntime (or auto)")
    gpus = cluster_gpus if num_gpus is None else num_gpus
    if gpus > cluster_gpus:
        raise InvalidParameter(f"{gpus} GPUs asked for; the Ray cluster has {cluster_gpus}")
    return ActorPlan(gpus, gpu=True, backend=backend)


def _records(
    ray: Any, src: Any, todo: list[tuple[str, str]], plan: ActorPlan, batch: int, actor_kwargs: dict, *, quiet: bool
) -> Iterator[Any]:
    """The job's output tables (``image``, ``record``, ``error``, ``detections``) as they finish."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    if quiet:  # the caller shows its own progress
        ctx.enable_progress_bars = False
    blocks = max(1, math.ceil(len(todo) / batch))  # a block is about one actor call
    ds = ray.data.from_items([{"image": n, "path": p} for n, p in todo], override_num_blocks=blocks)
    read_args: dict[str, Any] = {}
    if src.local:  # a local path may exist only on the driver's machine: read it there
        read_args["label_selector"] = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    # Reading is I/O: no CPU reserved (the actors may hold every one), a few tasks per actor.
    ds = ds.map_batches(read_batch, fn_kwargs={"filesystem": src.filesystem}, batch_format="pyarrow",
                        batch_size=None, num_cpus=0, compute=ray.data.TaskPoolStrategy(size=min(blocks, 2 * plan.actors + 2)),
                        **read_args)
    ds = ds.map_batches(
        DetectorActor,
        fn_constructor_kwargs=actor_kwargs,
        batch_format="pyarrow",
        batch_size=batch,
        compute=_actor_pool(ray, plan),
        num_gpus=1 if plan.gpu else None,
        num_cpus=1,
    )
    try:
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")
    except ray.exceptions.RayError as exc:
        raise _job_error(exc) from exc


def _actor_pool(ray: Any, plan: ActorPlan) -> Any:
    """A fixed pool; a GPU actor takes two calls at once so that one call's host work (Arrow
    columns, JSON) overlaps the other's GPU batch (the pipeline runs one batch at a time)."""
    if plan.gpu:
        return ray.data.ActorPoolStrategy(size=plan.actors, max_concurrent_calls_per_actor=2,
                                          enable_true_multi_threading=True)
    return ray.data.ActorPoolStrategy(size=plan.actors)


def _job_error(exc: Exception) -> YolopipeError:
    """A failed job as a yolopipe error: the one an actor raised, else Ray's first line."""
    import app.errors

    # Ray sends a remote error's cause chain as text only (the exception objects stay behind),
    # so a yolopipe error raised in an actor is found by its printed "app.errors.Name: ..." line.
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # Ray colours its messages
    for name, message in re.findall(r"^app\.errors\.(\w+): (.+)$", text, flags=re.MULTILINE):
        cls = getattr(app.errors, name, None)
        if isinstance(cls, type) and issubclass(cls, YolopipeError):
            return cls(message)
    first = text.splitlines()[0] if text else type(exc).__name__
    return YolopipeError(f"the Ray job failed: {first}", hint="the Ray logs (/tmp/ray/session_latest/logs) say more")


def _write(
    tables: Iterator[Any],
    sink: Any,
    seen: set[str],
    summary: FolderSummary,
    total: int,
    on_progress: Callable[[int, int], None] | None,
) -> None:
    """Each image's record once (retried batches come back twice), counted into ``summary``."""
    for table in tables:
        names = table.column("image").to_pylist()
        records = table.column("record").to_pylist()
        errors = table.column("error").to_pylist()
        counts = table.column("detections").to_pylist()
        lines = []
        for name, record, error, count in zip(names, records, errors, counts):
            if name in seen:
                continue
            seen.add(name)
            lines.append(record)
            summary.images += 1
            if error is None:
                summary.detections += count
            else:
                summary.errors += 1
                if len(summary.error_files) < ERRORS_KEPT:
                    summary.error_files.append(f"{name}: {error}")
        if lines:
            sink.write(lines)
            if on_progress:
                on_progress(len(lines), total)

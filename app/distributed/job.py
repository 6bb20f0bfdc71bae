"""``predict_with_ray``: folder inference as a Ray Data job over every GPU (or CPU) of a cluster.

    names + paths ─(read tasks: bytes)─▶ detector actors, one per GPU ─(records)─▶ driver ─▶ JSONL | Parquet

The driver lists the source, drops what ``resume`` finds already written, exports the model
once (TensorRT engines are whatever ``yolopipe build-engine`` left beside it) and hands every
actor its folder and the job's ``OpenOptions``, by value: an actor opens the detector the
driver describes, on the backend the plan gives it, and builds only what runs on its own GPU
(the torch-cuda engine, when missing). Ray Data streams the rest with bounded memory.

What the driver does per image is kept small, so that one driver keeps up with many GPUs:
Ray's costs are per block (a task, an object, a fetch), and a block holds several actor
batches; the actors send finished JSON lines, so the driver only checks each name against
the ones written and writes a block's lines as one buffer (``write_records``).

Fault tolerance is Ray Data's: read tasks are retried (``max_retries=-1``) and the actors are
restartable with their tasks retried (``max_restarts=-1``, ``max_task_retries=-1``, Ray Data's
defaults for ``map_batches`` actors, relied on here). A dead node costs the batches it held;
the driver writes each image once however often it was run (``write_records``). A restarted
actor runs its constructor again with the same arguments: small values, plus the shipped model
folder's object (``app.distributed.actor``), all owned by the driver and kept on its node until
the job ends, so a worker node's death loses none of them.

Ray's own output stays off the user's terminal (``quiet_ray``): its log lines go to the session's
log files (``/tmp/ray/session_latest/logs``), where ``_job_error``'s hint points.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.artifacts.exports import load_export
from app.contracts import RunShape, make_params
from app.distributed.actor import DetectorActor, read_batch
from app.distributed.console import core_log_to, quiet_ray_data
from app.distributed.output import done_images, open_sink, resolve_format
from app.distributed.sources import ImageSource, open_source
from app.errors import BackendUnavailable, InvalidParameter, YolopipeError
from app.records import FolderSummary
from app.runtime import OpenOptions, choose_backend, cpu_shape, export_model

ERRORS_KEPT = 1000  # error_files listed in the summary; the output file has them all
# Ray's cost on the driver is per block, not per image: 8 batches a block keep it to a
# fraction of one core at two GPUs' rate (bench/results/2026-12-01-cpu-2core-ray-plumbing.json).
BATCHES_PER_BLOCK = 8
BLOCKS_PER_ACTOR = 4  # ... unless that leaves an actor fewer blocks than this (balance, short jobs)


@dataclass(frozen=True)
class ActorPlan:
    """How many detector actors, on what, with which backend, and the run shape of each one's
    detector (its ``max_batch``: the images of one actor call; its ``in_flight``: a GPU actor's
    calls at once)."""

    actors: int
    gpu: bool
    backend: str
    shape: RunShape = field(default_factory=lambda: RunShape(in_flight=1))


def predict_with_ray(
    source: str,
    out: Path,
    *,
    options: OpenOptions,
    detect: dict[str, Any] | None = None,
    address: str | None = None,
    gpu_actors: int | None = None,
    cpu_actors: int | None = None,
    resume: bool = False,
    output_format: str | None = None,
    ship_artifacts: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> FolderSummary:
    """Detect objects in every image of ``source`` on a Ray cluster; same records as ``predict``.

    ``options``: the detector every actor opens (``predict``'s, whole: the model, the backend,
    ``ort_threads``, the run shape), each on the plan's backend, device 0 being the GPU Ray gives
    it. Its ``shape.max_batch`` is also the images of one actor call (clamped as the actors'
    detectors clamp it: ONNX Runtime's ``CPU_MAX_BATCH``). ``detect``: ``Detector.params``'
    keywords (conf, iou, max_det, classes, agnostic).

    ``address``: a running cluster (``auto``, ``host:port``, ``ray://host:10001``); ``None``
    starts Ray on this machine (or uses the one this process already joined; never one that
    another process started here, which ``auto`` joins). ``gpu_actors``:
    GPU actors, one GPU each (default: every GPU of the cluster); ``cpu_actors``: ONNX
    Runtime actors when the backend resolves to the CPU (``app.runtime.choose_backend``: no GPU
    in the cluster, ``gpu_actors=0`` or ``backend="onnxruntime"``; default: one per node).
    ``ship_artifacts``: put the model folder in Ray's object store for nodes that do not share
    the driver's disk (default: when joining a running cluster).
    """
    for name, value in (("gpu_actors", gpu_actors), ("cpu_actors", cpu_actors)):
        if value is not None and value < 0:
            raise InvalidParameter(f"{name} must be >= 0, got {value}")
    detect = dict(detect or {})
    fmt = resolve_format(out, output_format)
    src = open_source(source)
    done = done_images(out, fmt) if resume else set()
    todo = [(name, path) for name, path in src.items if name not in done]
    summary = FolderSummary(skipped=len(src.items) - len(todo))
    model_dir = export_model(options)  # once, here on the driver
    meta = load_export(model_dir)[1]
    make_params(**detect, num_classes=len(meta.names))  # a bad value fails here, not in every actor
    if on_progress:
        on_progress(0, len(todo))
    sink = open_sink(out, fmt, resume=resume)
    try:
        if todo:
            with ray_session(address) as ray:
                plan = plan_actors(ray, options, model_dir, gpu_actors, cpu_actors)
                ship = ship_artifacts if ship_artifacts is not None else address is not None
                bundle = None
                if ship:
                    from app.distributed.shipping import pack_model_dir

                    bundle = [ray.put(pack_model_dir(model_dir))]  # owned by the driver: kept until the job ends
                actor_kwargs = {
                    "options": replace(options, backend=plan.backend, device=0),
                    "model_dir": str(model_dir.resolve()),
                    "onnx_sha256": meta.onnx_sha256,
                    "detect": detect,
                    "bundle": bundle,
                }
                tables = detect_tables(ray, src, todo, plan, plan.shape.max_batch, DetectorActor, actor_kwargs,
                                       quiet=on_progress is not None)
                write_records(tables, sink, done, summary, len(todo), on_progress)
    finally:
        sink.close()
    return summary


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[Any]:
    """Ray, connected: the session this process already has (its owner's, output and all), else a
    new one, quiet (``app.distributed.console``), closed afterwards."""
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailable("Ray is not installed", hint="pip install 'yolopipe[ray]'") from exc
    if ray.is_initialized():
        yield ray
        return
    # Ray's Python loggers say only errors, the actors' output stays in their log files.
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
    try:
        if address is None:  # a Ray of its own, never one another process left running here
            context = ray.init(address="local", include_dashboard=False, **quiet)
        else:
            context = ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise BackendUnavailable(f"cannot start or join the Ray cluster at {address or 'this machine'}: {exc}") from exc
    quiet_ray_data()
    with core_log_to(_driver_log(context)):  # ray.shutdown's own lines too
        try:
            yield ray
        finally:
            ray.shutdown()


def _driver_log(context: Any) -> Path | None:
    """Where the driver's share of Ray's own log lines goes: its session's log folder (None for a
    client connection, ``ray://``, whose driver runs on the cluster)."""
    session = getattr(context, "address_info", {}).get("session_dir")
    return Path(session) / "logs" / "yolopipe-driver.err" if session else None


def plan_actors(ray: Any, options: OpenOptions, model_dir: Path, gpu_actors: int | None,
                cpu_actors: int | None) -> ActorPlan:
    """One actor per GPU; ONNX Runtime actors on CPUs when the backend resolves to the CPU.

    ``auto`` is resolved by ``app.runtime.choose_backend`` for the GPUs the job may use; a GPU
    actor gets the backend as asked (``auto`` stays ``auto``), so that it resolves it again
    where it runs, TensorRT fallback included. Each actor's run shape is the one its detector
    opens with (``app.runtime`` clamps it, on the CPU by ``cpu_shape``; a TensorRT profile's
    ceiling, known where the engine loads, may clamp a GPU actor's further)."""
    backend = options.backend
    cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpu_actors == 0 and backend not in ("auto", "onnxruntime"):
        raise InvalidParameter(f"backend {backend} runs on GPUs and gpu_actors is 0", hint="use --backend onnxruntime")
    usable = cluster_gpus if gpu_actors is None else min(gpu_actors, cluster_gpus)
    # a GPU backend on a cluster without GPUs, or an impossible precision, fails here, once
    if choose_backend(backend, options.precision, model_dir, gpus=usable).backend == "onnxruntime":
        nodes = sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1)
        return ActorPlan(cpu_actors or max(1, nodes), gpu=False, backend="onnxruntime", shape=cpu_shape(options.shape))
    gpus = cluster_gpus if gpu_actors is None else gpu_actors
    if gpus > cluster_gpus:
        raise InvalidParameter(f"{gpus} GPU actors asked for; the Ray cluster has {cluster_gpus} GPUs")
    return ActorPlan(gpus, gpu=True, backend=backend, shape=options.shape)


def block_size(images: int, batch: int, actors: int) -> int:
    """Images per block: ``BATCHES_PER_BLOCK`` batches, fewer when that leaves an actor fewer than
    ``BLOCKS_PER_ACTOR`` blocks; always whole batches (only the last block ends in a partial one)."""
    large = math.ceil(images / (batch * BATCHES_PER_BLOCK))
    blocks = max(1, large, min(math.ceil(images / batch), BLOCKS_PER_ACTOR * actors))
    return max(1, math.ceil(images / blocks / batch)) * batch


def detect_tables(
    ray: Any, src: ImageSource, todo: list[tuple[str, str]], plan: ActorPlan, batch: int, actor_cls: type,
    actor_kwargs: dict, *, quiet: bool,
) -> Iterator[Any]:
    """The job's output tables (``app.distributed.actor.RECORD_COLUMNS``) as they finish.

    ``actor_cls``: ``DetectorActor``, or a stand-in with its interface (the plumbing benchmark's)."""
    import pyarrow as pa
    import ray.data

    ctx = ray.data.DataContext.get_current()
    if quiet:  # the caller shows its own progress
        ctx.enable_progress_bars = False
    step = block_size(len(todo), batch, plan.actors)
    names, paths = [n for n, _ in todo], [p for _, p in todo]
    listing = [pa.table({"image": names[i : i + step], "path": paths[i : i + step]}) for i in range(0, len(todo), step)]
    ds = ray.data.from_arrow(listing)  # one table, one block
    read_args: dict[str, Any] = {}
    if src.local:  # a local path may exist only on the driver's machine: read it there
        read_args["label_selector"] = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    # Reading is I/O: no CPU reserved (the actors may hold every one), a few tasks per actor.
    ds = ds.map_batches(read_batch, fn_kwargs={"filesystem": src.filesystem}, batch_format="pyarrow",
                        batch_size=None, num_cpus=0, compute=ray.data.TaskPoolStrategy(size=min(len(listing), 2 * plan.actors + 2)),
                        **read_args)
    ds = ds.map_batches(
        actor_cls,
        fn_constructor_kwargs=actor_kwargs,
        batch_format="pyarrow",
        batch_size=batch,
        compute=_actor_pool(ray, plan),
        num_gpus=1 if plan.gpu else None,
        num_cpus=1,
        # Ray Data spreads a pool's actors over the nodes (its DataContext's "SPREAD"), which
        # "one per node" needs: Ray alone packs them onto the node that asks first.
    )
    try:
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2)
    except ray.exceptions.RayError as exc:
        raise _job_error(exc) from exc


def _actor_pool(ray: Any, plan: ActorPlan) -> Any:
    """A fixed pool; a GPU actor takes its detector's ``RunShape.in_flight`` calls at once, each
    in its own thread, so that its pipeline has as many batches in flight as ``yolopipe predict``
    gives it (one decoding, one on the engine, one being unpacked) and a call's host work (Arrow
    columns, JSON) overlaps the others' GPU work."""
    if plan.gpu:
        return ray.data.ActorPoolStrategy(size=plan.actors, max_concurrent_calls_per_actor=plan.shape.in_flight,
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


def write_records(
    tables: Iterator[Any],
    sink: Any,
    seen: set[str],
    summary: FolderSummary,
    total: int,
    on_progress: Callable[[int, int], None] | None,
) -> None:
    """Each image's line once (retried batches come back twice), counted into ``summary``.

    Per image, only its name is looked at here (against ``seen``); counts come from the
    columns, and a table's lines are written as one buffer."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for table in tables:
        names = table.column("image").to_pylist()
        if seen.isdisjoint(names) and len(set(names)) == len(names):  # the usual case: all new
            seen.update(names)
        else:
            keep = []
            for name in names:
                keep.append(name not in seen)
                seen.add(name)
            table = table.filter(pa.array(keep))
        if not table.num_rows:
            continue
        errors = table.column("error")
        summary.images += table.num_rows
        summary.detections += pc.sum(table.column("detections")).as_py() or 0  # 0 for an error line
        if errors.null_count < table.num_rows:
            failed = table.filter(pc.is_valid(errors))
            summary.errors += failed.num_rows
            room = ERRORS_KEPT - len(summary.error_files)
            for name, error in zip(failed.column("image").to_pylist()[:room], failed.column("error").to_pylist()):
                summary.error_files.append(f"{name}: {error}")
        sink.write_lines(table.column("line"))
        if on_progress:
            on_progress(table.num_rows, total)

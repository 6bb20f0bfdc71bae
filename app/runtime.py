"""The composition root: open a detector from the model's artifacts, for the CLI, the service
and the benchmarks alike.

It exports the weights only when their artifacts are missing or stale, resolves ``auto`` for
the backend and the precision (the one place that does), clamps the run shape (``RunShape``:
batch, batches in flight, decoders, pixel limit, wait) to what the chosen pipeline takes (the
one place that does), and wires a backend into its pipeline. The Detector it returns owns the
pipeline and, through it, every GPU resource, and carries the clamped shape.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from app.artifacts.engines import find_engine
from app.artifacts.exports import load_export
from app.config import BACKENDS, CPU_MAX_BATCH, PRECISIONS, Settings, check_choice
from app.contracts import RunShape
from app.errors import BackendUnavailable, EngineMismatch, InvalidParameter
from app.pipeline.detector import Detector
from app.types import ModelMeta, StartupSteps


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # onnxruntime | torch-cuda | tensorrt
    precision: str  # fp32 | fp16 | int8
    engine_path: Path | None = None  # tensorrt: the engine file


def choose_backend(backend: str, precision: str, model_dir: Path, *, gpus: int) -> BackendChoice:
    """``auto`` → what this machine runs best; explicit choices are checked, never changed.

    backend auto: a TensorRT engine built for this precision (any, fastest first, when
    ``auto``), else torch-cuda on a GPU, else ONNX Runtime. precision auto: the backend's
    fastest exact-enough mode: fp32 on ONNX Runtime (int8 needs ``yolopipe calibrate``), fp16
    on torch-cuda, the best built engine on TensorRT.
    """
    check_choice("backend", backend, BACKENDS)
    check_choice("precision", precision, PRECISIONS)
    wanted = None if precision == "auto" else precision
    if backend == "auto":
        if gpus == 0:
            backend = "onnxruntime"
        elif find_engine(model_dir, wanted) is not None:
            backend = "tensorrt"
        else:
            backend = "torch-cuda"
    if backend == "onnxruntime":
        if precision == "fp16":
            raise InvalidParameter("onnxruntime runs fp32 or int8 on the CPU; fp16 needs a GPU backend")
        return BackendChoice(backend, wanted or "fp32")
    if gpus == 0:
        raise BackendUnavailable(f"backend {backend} needs an NVIDIA GPU and none was found",
                                 hint="use --backend onnxruntime (or auto)")
    if backend == "torch-cuda":
        if precision == "int8":
            raise InvalidParameter("torch-cuda runs fp16 or fp32; int8 needs a TensorRT engine or --backend onnxruntime")
        return BackendChoice(backend, wanted or "fp16")
    engine_path = find_engine(model_dir, wanted)
    if engine_path is None:
        raise BackendUnavailable(f"no TensorRT engine{f' for {wanted}' if wanted else ''} in {model_dir}",
                                 hint="run `yolopipe build-engine` first")
    return BackendChoice(backend, engine_path.name.split(".")[1], engine_path)


def export_model(weights: str = "sample", *, imgsz: int = 640, artifacts_dir: Path | None = None) -> Path:
    """The weights' artifacts folder, exported now only when missing or stale."""
    from app.builder.export import export_onnx

    return export_onnx(weights, imgsz=imgsz, artifacts_dir=artifacts_dir).model_dir


def open_detector(
    weights: str = "sample",
    *,
    backend: str = "auto",
    precision: str = "auto",
    imgsz: int = 640,
    artifacts_dir: Path | None = None,
    device: int = 0,
    compile: bool = True,
    batch_invariant: bool = True,
    ort_threads: int = 0,
    pad_to_captured: bool = False,
    shape: RunShape | None = None,
    max_batch: int | None = None,
    decode: str | None = None,
    video_decode: str | None = None,
    steps: StartupSteps | None = None,
) -> Detector:
    """Export the weights if needed, then ``open_model_dir`` with the same options. ``shape``
    (``RunShape()`` by default) with ``max_batch``, ``decode`` and ``video_decode`` set where given:
    the run shape asked for, its decoder names checked before a slow export."""
    check_choice("backend", backend, BACKENDS)  # before a slow export
    check_choice("precision", precision, PRECISIONS)
    given = {"max_batch": max_batch, "decode": decode, "video_decode": video_decode}
    shape = replace(shape or RunShape(), **{k: v for k, v in given.items() if v is not None})
    steps = steps if steps is not None else StartupSteps()
    with steps.step("checking the model's export (a first run exports it)"):
        model_dir = export_model(weights, imgsz=imgsz, artifacts_dir=artifacts_dir)
    return open_model_dir(model_dir, shape, backend=backend, precision=precision, device=device, compile=compile,
                          batch_invariant=batch_invariant, ort_threads=ort_threads, pad_to_captured=pad_to_captured,
                          steps=steps)


def open_model_dir(
    model_dir: Path,
    shape: RunShape | None = None,
    *,
    backend: str = "auto",
    precision: str = "auto",
    device: int = 0,
    compile: bool = True,
    batch_invariant: bool = True,
    ort_threads: int = 0,
    pad_to_captured: bool = False,
    steps: StartupSteps | None = None,
) -> Detector:
    """A detector on an existing export: pick the backend, clamp the run shape to it, build its
    pipeline. The one place that wires them. ``shape`` (``RunShape()`` by default): the run shape
    asked for; the pipeline and the Detector both get the clamped one.

    ``compile`` (torch-cuda): run the engine built ahead of time (``yolopipe build-engine``),
    building it now when it is missing or stale; without it, the eager model. ``batch_invariant``
    (torch-cuda): that engine's kernels give an image the same answer in any batch (a slower
    build, ``app.builder.torch_build``); off: cuDNN's, per batch size. ``pad_to_captured``
    (GPU): a batch runs in a larger bucket already captured rather than capturing its own (a
    run that needs a bucket once, a service capturing the rest in the background). ``steps``
    records each start-up step with its time.

    A step that fails releases what the steps before it took (the engine, the pipeline): each
    goes on ``cleanup`` as it is made, and is handed to the Detector only once that exists."""
    from app.gpu.probe import cuda_device_count

    steps = steps if steps is not None else StartupSteps()
    shape = shape or RunShape()
    onnx_path, meta = load_export(model_dir)
    choice = choose_backend(backend, precision, model_dir, gpus=cuda_device_count())
    with contextlib.ExitStack() as cleanup:
        if choice.backend == "onnxruntime":
            # ONNX Runtime: one batch at a time (its own threads use every core), at most CPU_MAX_BATCH.
            shape = replace(shape, max_batch=min(shape.max_batch, CPU_MAX_BATCH), in_flight=1)
            with steps.step("opening ONNX Runtime"):
                pipeline = _cpu_pipeline(onnx_path, meta, choice.precision, shape, ort_threads)
            cleanup.callback(pipeline.close)
        else:
            engine = _device_engine(choice, backend, model_dir, meta, shape.max_batch, device, compile,
                                    batch_invariant, steps)
            cleanup.callback(engine.close)
            from app.pipeline.gpu import GpuPipeline

            shape = replace(shape, max_batch=min(shape.max_batch, engine.max_batch))  # a TensorRT profile's ceiling
            with steps.step("setting up the GPU pipeline (buffers, decoder, kernels)"):
                pipeline = GpuPipeline(engine, meta, shape, device=device, pad_to_captured=pad_to_captured)
            cleanup.pop_all()  # the pipeline owns the engine now
            cleanup.callback(pipeline.close)
        detector = Detector(pipeline, shape)
        cleanup.pop_all()  # the Detector owns it all now
    return detector


def _device_engine(choice: BackendChoice, backend: str, model_dir: Path, meta: ModelMeta, max_batch: int,
                   device: int, compile: bool, batch_invariant: bool, steps: StartupSteps):
    """The GPU engine of ``choice``: its TensorRT engine, or torch-cuda's (also when ``backend``
    is ``auto`` and the TensorRT engine does not run here)."""
    if choice.backend == "tensorrt":
        from app.backends.tensorrt import TensorRTEngine

        try:
            with steps.step("loading the TensorRT engine"):
                return TensorRTEngine(choice.engine_path, meta, device=device)
        except (EngineMismatch, BackendUnavailable) as exc:
            if backend != "auto":
                raise
            # auto: an engine built for another GPU/TensorRT must not stop the service from starting
            warnings.warn(f"TensorRT engine unusable here ({exc}); falling back to torch-cuda", stacklevel=3)
            choice = BackendChoice("torch-cuda", "fp16" if choice.precision == "int8" else choice.precision)
    return _torch_cuda_engine(model_dir, meta, choice.precision, max_batch, device, compile, batch_invariant, steps)


def shape_from(settings: Settings) -> RunShape:
    """The run shape the service's settings ask for (``open_model_dir`` clamps it)."""
    return RunShape(max_batch=settings.max_batch, decode=settings.decode, max_pixels=settings.max_pixels,
                    max_wait_ms=settings.max_wait_ms)


def _torch_cuda_engine(model_dir: Path, meta: ModelMeta, precision: str, max_batch: int, device: int,
                       compile: bool, batch_invariant: bool, steps: StartupSteps):
    """The torch-cuda engine: its package built ahead of time (built now when missing or stale),
    or the eager model in CUDA graphs (``compile`` off, or no package that runs here)."""
    from app.backends.torch_cuda import TorchCudaEngine

    packages = ()
    if compile:
        from app.builder.torch_build import ensure_torch_engine

        with steps.step("finding the torch-cuda engine (a first run builds it)"):
            found = ensure_torch_engine(model_dir, meta, precision=precision, max_batch=max_batch, device=device,
                                        batch_invariant=batch_invariant, say=steps.say)
        packages = (found,) if found is not None else ()
    with steps.step("loading the torch-cuda engine"):
        # No package (not asked for, or none runs here): the eager model, in CUDA graphs.
        return TorchCudaEngine(model_dir, meta, precision=precision, max_batch=max_batch, device=device,
                               compile=bool(packages), packages=packages)


def open_detector_from(settings: Settings, steps: StartupSteps | None = None) -> Detector:
    """The service's detector, from its settings."""
    return open_detector(
        settings.weights, backend=settings.backend, precision=settings.precision, imgsz=settings.imgsz,
        artifacts_dir=settings.artifacts_dir, device=settings.device, compile=settings.compile,
        batch_invariant=settings.batch_invariant,
        ort_threads=settings.ort_threads, shape=shape_from(settings), steps=steps,
        pad_to_captured=True,  # the worker captures the largest bucket, then the others while it serves
    )


def _cpu_pipeline(onnx_path: Path, meta: ModelMeta, precision: str, shape: RunShape, ort_threads: int):
    from app.artifacts.int8 import int8_cpu_model_path
    from app.backends.onnxruntime import OnnxRuntimeBackend
    from app.pipeline.cpu import CpuPipeline

    if precision == "int8":
        onnx_path = int8_cpu_model_path(onnx_path.parent)
    host = OnnxRuntimeBackend(onnx_path, precision=precision, threads=ort_threads or None)
    return CpuPipeline(host, meta, shape)  # it only keeps the backend: nothing after it can fail


def inference_devices(settings: Settings) -> list[str | None]:
    """The service's inference workers: one per chosen GPU (its ``CUDA_VISIBLE_DEVICES`` entry),
    or ``cpu_workers`` CPU workers (``None``) when the backend resolves to the CPU."""
    from app.gpu.probe import cuda_device_count  # ctypes only: no torch here

    check_choice("backend", settings.backend, BACKENDS)
    count = 0 if settings.backend == "onnxruntime" else cuda_device_count()
    if count == 0:
        if settings.backend not in ("auto", "onnxruntime"):
            raise BackendUnavailable(f"backend {settings.backend} needs an NVIDIA GPU and none was found",
                                     hint="use --backend onnxruntime")
        return [None] * settings.cpu_workers
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [v.strip() for v in env.split(",") if v.strip()] if env else []
    visible = visible or [str(i) for i in range(count)]
    if settings.gpus.strip().lower() == "all":
        return list(visible)
    try:
        chosen = [int(g) for g in settings.gpus.split(",") if g.strip()]
    except ValueError:
        raise InvalidParameter(f"gpus must be 'all' or CUDA indices like '0,1', got {settings.gpus!r}") from None
    bad = [g for g in chosen if not 0 <= g < len(visible)]
    if bad or not chosen:
        raise InvalidParameter(f"gpus {settings.gpus!r}: this machine shows {len(visible)} GPU(s), 0..{len(visible) - 1}")
    return [visible[g] for g in dict.fromkeys(chosen)]


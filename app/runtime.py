"""The composition root: what opens a detector, for the CLI, the service, Ray and the benchmarks
alike, kept apart from what builds its artifacts.

Every caller describes the detector it wants as one ``OpenOptions`` value (``predict`` from its
options, the service from its settings, ``predict --ray`` ships the driver's to its actors) and
passes it whole. Building and opening are two steps, as in NVIDIA Polygraphy's loaders:

* ``ensure_artifacts`` may take minutes: it exports the weights when their export is missing or
  stale, and builds the torch-cuda engine the run needs, naming each step as it begins. Only the
  front ends that may build call it (``predict``, ``serve``, ``bench``, a Ray actor on its GPU);
* ``open_detector`` (``open_model_dir`` on a folder at hand) never builds: it finds the
  artifacts, or raises an ``ArtifactError`` naming the command that builds them. It resolves
  ``auto`` for the backend and the precision (the one place that does), clamps the run shape
  (``RunShape``: batch, batches in flight, decoders, pixel limit, wait, letterbox) to what the
  chosen pipeline takes (the one place that does: a GPU pipeline, or a model pinned to the
  square, runs square), and wires a backend into its pipeline. The Detector
  it returns owns the pipeline and, through it, every GPU resource, and carries the clamped shape.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from app.artifacts.engines import find_engine
from app.artifacts.exports import load_export
from app.config import (
    BACKENDS,
    CPU_MAX_BATCH,
    ENGINE_MAX_BATCH,
    PRECISIONS,
    check_choice,
    check_imgsz,
    decoder_name,
    gpu_host_threads,
)
from app.contracts import RunShape
from app.errors import ArtifactError, BackendUnavailable, EngineMismatch, InvalidParameter
from app.gpu.device import CudaDevice, configure_process
from app.pipeline.detector import Detector
from app.types import ModelMeta, StartupSteps

if TYPE_CHECKING:
    from app.settings import Settings


@dataclass(frozen=True)
class OpenOptions:
    """The detector a caller wants, whole: which model, on what, and how it runs. Small and
    picklable (Ray ships it to its actors by value); checked when made, before any slow step."""

    weights: str = "sample"  # a weights spec (``app.weights``)
    imgsz: int = 640
    artifacts_dir: Path | None = None  # None: ``app.artifacts.store.artifacts_root()``
    backend: str = "auto"  # ``app.config.BACKENDS``; auto: resolved where it opens (``choose_backend``)
    precision: str = "auto"
    device: int = 0  # the CUDA device (GPU backends)
    # torch-cuda: run the engine built ahead of time (``ensure_artifacts`` builds it); off: the eager model
    compile: bool = True
    # torch-cuda: that engine's kernels give an image the same answer in any batch (a slower build,
    # ``app.builder.torch_build``); off: cuDNN's, per batch size
    batch_invariant: bool = True
    ort_threads: int = 0  # ONNX Runtime's threads; 0: its own choice
    # GPU: a batch runs in a larger bucket already captured rather than capturing its own (a run
    # that needs a bucket once; a service capturing the rest in the background)
    pad_to_captured: bool = False
    shape: RunShape = field(default_factory=RunShape)  # the run shape asked for; opening clamps it

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, BACKENDS)
        check_choice("precision", self.precision, PRECISIONS)
        check_imgsz(self.imgsz)
        if self.ort_threads < 0 or self.device < 0:
            raise InvalidParameter(f"ort_threads and device must be >= 0, got {self.ort_threads} and {self.device}")


def options_from(settings: Settings) -> OpenOptions:
    """The service's detector, as its settings describe it: the one place they become options."""
    return OpenOptions(
        weights=settings.weights, imgsz=settings.imgsz, artifacts_dir=settings.artifacts_dir,
        backend=settings.backend, precision=settings.precision, device=settings.device, compile=settings.compile,
        batch_invariant=settings.batch_invariant, ort_threads=settings.ort_threads,
        pad_to_captured=True,  # the worker captures the largest bucket, then the others while it serves
        shape=RunShape(max_batch=settings.max_batch, decode=settings.decode, max_pixels=settings.max_pixels,
                       max_wait_ms=settings.max_wait_ms, letterbox=settings.letterbox),
    )


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


# --- building: may take minutes --------------------------------------------------------------
def ensure_artifacts(options: OpenOptions, steps: StartupSteps | None = None) -> Path:
    """The model's artifacts folder, with what ``options`` need built now when missing or stale:
    the ONNX export, then the torch-cuda engine (``ensure_engine``). Each step is named in
    ``steps`` as it begins (a first run exports and builds: minutes, with progress)."""
    steps = steps if steps is not None else StartupSteps()
    start_decoder_early(options)
    with steps.step("checking the model's export (a first run exports it)"):
        model_dir = export_model(options)
    ensure_engine(model_dir, options, steps)
    return model_dir


def start_decoder_early(options: OpenOptions) -> None:
    """Where ``options`` may run on a GPU and decode JPEGs with nvImageCodec, start its decoders
    now, on a thread of their own (``app.gpu.early_decoder``): their start-up then runs beside
    ``import torch`` and the engine's load, and the pipeline ``open_model_dir`` builds takes
    them. Where nvImageCodec is missing or no GPU answers, that thread finds out and ends."""
    if options.backend == "onnxruntime" or decoder_name(options.shape.decode) not in ("gpu", "nvimgcodec"):
        return
    from app.gpu import early_decoder

    configure_process()  # before that thread makes the process's CUDA context
    early_decoder.start(options.device, gpu_host_threads())


def export_model(options: OpenOptions) -> Path:
    """The weights' artifacts folder, exported now only when missing or stale."""
    from app.builder.export import export_onnx

    return export_onnx(options.weights, imgsz=options.imgsz, artifacts_dir=options.artifacts_dir).model_dir


def ensure_engine(model_dir: Path, options: OpenOptions, steps: StartupSteps | None = None) -> None:
    """What a GPU run of ``options`` needs beside the export in ``model_dir``: the torch-cuda
    engine, built now when missing or stale (``compile`` on). TensorRT engines are built by
    ``yolopipe build-engine`` alone (calibration images, minutes of tactic choices)."""
    from app.gpu.probe import cuda_device_count

    configure_process()  # before the build makes a CUDA context
    steps = steps if steps is not None else StartupSteps()
    choice = choose_backend(options.backend, options.precision, model_dir, gpus=cuda_device_count())
    if choice.backend != "torch-cuda" or not options.compile:
        return
    from app.builder.torch_build import ensure_torch_engine

    meta = load_export(model_dir)[1]
    with steps.step("finding the torch-cuda engine (a first run builds it)"):
        ensure_torch_engine(model_dir, meta, precision=choice.precision, max_batch=options.shape.max_batch,
                            device=options.device, batch_invariant=options.batch_invariant, say=steps.say)


# --- opening: never builds ---------------------------------------------------------------------
def open_detector(options: OpenOptions, steps: StartupSteps | None = None) -> Detector:
    """The detector ``options`` describe, on artifacts already built (``find_export``,
    ``open_model_dir``)."""
    return open_model_dir(find_export(options), options, steps)


def find_export(options: OpenOptions) -> Path:
    """The folder of the weights' current export; an ``ArtifactError`` naming the command that
    exports it when there is none (this never exports)."""
    from app.artifacts.exports import current_export
    from app.artifacts.store import artifacts_root, model_dir
    from app.weights import resolve_weights

    resolved = resolve_weights(options.weights)
    folder = model_dir(artifacts_root(options.artifacts_dir), resolved.name, resolved.sha256, options.imgsz)
    if current_export(folder, weights_sha256=resolved.sha256, imgsz=options.imgsz) is None:
        raise ArtifactError(f"no export of {options.weights} at imgsz {options.imgsz} in {folder}",
                            hint=f"run `{command('export', options)}` first")
    return folder


def open_model_dir(model_dir: Path, options: OpenOptions | None = None, steps: StartupSteps | None = None) -> Detector:
    """The detector ``options`` describe (``OpenOptions()`` by default), on the export in
    ``model_dir`` and the engines beside it: pick the backend, clamp the run shape to it, build
    its pipeline. The one place that wires them; it builds nothing. ``steps`` records each
    start-up step with its time.

    A step that fails releases what the steps before it took (the engine, the pipeline): each
    goes on ``cleanup`` as it is made, and is handed to the Detector only once that exists."""
    options = options if options is not None else OpenOptions()
    configure_process()  # before anything here makes a CUDA context (the engine, its build)
    steps = steps if steps is not None else StartupSteps()
    try:
        return _open_model_dir(model_dir, options, steps)
    finally:
        from app.gpu import early_decoder

        early_decoder.release()  # decoders started early that this pipeline did not take


def _open_model_dir(model_dir: Path, options: OpenOptions, steps: StartupSteps) -> Detector:
    from app.gpu.probe import cuda_device_count

    onnx_path, meta = load_export(model_dir)
    choice = choose_backend(options.backend, options.precision, model_dir, gpus=cuda_device_count())
    with contextlib.ExitStack() as cleanup:
        if choice.backend == "onnxruntime":
            from app.pipeline.cpu import CpuPipeline

            with steps.step("opening ONNX Runtime"):
                host = _host_backend(onnx_path, choice.precision, options.ort_threads)
                cleanup.callback(host.close)
                shape = cpu_shape(options.shape, rect=host.takes_rect)  # a model pinned to the square runs square
                pipeline = CpuPipeline(host, meta, shape)
            cleanup.pop_all()  # the pipeline owns the backend now
            cleanup.callback(pipeline.close)
        else:
            engine = _device_engine(choice, model_dir, meta, options, steps)
            cleanup.callback(engine.close)
            from app.pipeline.gpu import GpuPipeline

            # a TensorRT profile's ceiling; the GPU pipeline letterboxes to the square (GpuPipeline.letterbox:
            # rect inputs are issue 47's GPU part)
            shape = replace(options.shape, max_batch=min(options.shape.max_batch, engine.max_batch), letterbox="square")
            with steps.step("setting up the GPU pipeline (buffers, decoder, kernels)"):
                pipeline = GpuPipeline(engine, meta, shape, cuda_device(options.device),
                                       pad_to_captured=options.pad_to_captured)
            cleanup.pop_all()  # the pipeline owns the engine now
            cleanup.callback(pipeline.close)
        detector = Detector(pipeline, shape)
        cleanup.pop_all()  # the Detector owns it all now
    return detector


def cpu_shape(shape: RunShape, *, rect: bool = True) -> RunShape:
    """``shape`` as ONNX Runtime runs it: one batch at a time (its own threads use every core),
    of at most ``CPU_MAX_BATCH`` images; letterboxed to the square where its model takes no
    rect input (``rect`` False: the INT8 model, pinned to the square)."""
    return replace(shape, max_batch=min(shape.max_batch, CPU_MAX_BATCH), in_flight=1,
                   letterbox=shape.letterbox if rect else "square")


def command(name: str, options: OpenOptions, *more: str) -> str:
    """The ``yolopipe`` command line that builds an artifact of ``options`` (for a hint)."""
    words = ["yolopipe", name]
    if options.weights != "sample":
        words += ["--weights", shlex.quote(options.weights)]
    if options.imgsz != 640:
        words += ["--imgsz", str(options.imgsz)]
    if options.artifacts_dir is not None:
        words += ["--artifacts-dir", shlex.quote(str(options.artifacts_dir))]
    return " ".join([*words, *more])


def _device_engine(choice: BackendChoice, model_dir: Path, meta: ModelMeta, options: OpenOptions,
                   steps: StartupSteps):
    """The GPU engine of ``choice``: its TensorRT engine, or torch-cuda's (also when the backend
    is ``auto`` and the TensorRT engine does not run here)."""
    if choice.backend == "tensorrt":
        from app.backends.tensorrt import TensorRTEngine

        try:
            with steps.step("loading the TensorRT engine"):
                return TensorRTEngine(choice.engine_path, meta, device=options.device)
        except (EngineMismatch, BackendUnavailable) as exc:
            if options.backend != "auto":
                raise
            # auto: an engine built for another GPU/TensorRT must not stop the service from starting
            warnings.warn(f"TensorRT engine unusable here ({exc}); falling back to torch-cuda", stacklevel=3)
            fallback = BackendChoice("torch-cuda", "fp16" if choice.precision == "int8" else choice.precision)
            return _torch_cuda_engine(model_dir, meta, fallback.precision, options, steps, fallback=True)
    return _torch_cuda_engine(model_dir, meta, choice.precision, options, steps)


_CUDA_DEVICES: dict[int, CudaDevice] = {}
_CUDA_DEVICES_LOCK = threading.Lock()


def cuda_device(index: int) -> CudaDevice:
    """The process's one ``CudaDevice`` of CUDA device ``index``: a capture must exclude every
    CUDA call on its device from every thread of the process, so every pipeline and NVDEC
    reader on the device shares its gate."""
    with _CUDA_DEVICES_LOCK:
        if index not in _CUDA_DEVICES:
            _CUDA_DEVICES[index] = CudaDevice(index)
        return _CUDA_DEVICES[index]


def _torch_cuda_engine(model_dir: Path, meta: ModelMeta, precision: str, options: OpenOptions, steps: StartupSteps,
                       *, fallback: bool = False):
    """The torch-cuda engine: its package built ahead of time, or the eager model in CUDA graphs
    (``compile`` off, or an earlier build failed here). A missing package is an ``ArtifactError``
    naming the command that builds it, except as the fallback of ``auto`` from an unusable
    TensorRT engine (nobody asked for torch-cuda: the eager model runs, with a warning)."""
    from app.backends.torch_cuda import TorchCudaEngine

    max_batch = options.shape.max_batch
    packages = ()
    if options.compile:
        from app.builder.torch_build import built_torch_engine

        with steps.step("finding the torch-cuda engine"):
            found = built_torch_engine(model_dir, meta, precision=precision, max_batch=max_batch,
                                       device=options.device, batch_invariant=options.batch_invariant)
        if found.package is not None:
            packages = (found.package,)
        elif found.refusal is not None:
            steps.say(f"no torch-cuda engine: {found.refusal} (an earlier build; `yolopipe build-engine` tries "
                      "again); the eager model runs")
        else:
            build = command("build-engine", options, "--backend torch-cuda", f"--precision {precision}",
                            *([f"--max-batch {max_batch}"] if max_batch > ENGINE_MAX_BATCH else []),
                            *([] if options.batch_invariant else ["--no-batch-invariant"]))
            why = f"no torch-cuda engine ({precision}, batches up to {max_batch}) built for this GPU and torch in " \
                  f"{model_dir}" + "".join(f"; {reason}" for reason in found.stale)
            if not fallback:
                raise ArtifactError(why, hint=f"run `{build}` first (predict and serve build it themselves)")
            warnings.warn(f"{why}: the eager model runs (`{build}` builds it)", RuntimeWarning, stacklevel=3)
    with steps.step("loading the torch-cuda engine"):
        return TorchCudaEngine(model_dir, meta, precision=precision, max_batch=max_batch, device=options.device,
                               compile=bool(packages), packages=packages)


def _host_backend(onnx_path: Path, precision: str, ort_threads: int):
    from app.artifacts.int8 import int8_cpu_model_path
    from app.backends.onnxruntime import OnnxRuntimeBackend

    if precision == "int8":
        onnx_path = int8_cpu_model_path(onnx_path.parent)
    return OnnxRuntimeBackend(onnx_path, precision=precision, threads=ort_threads or None)


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


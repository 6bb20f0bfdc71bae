"""ONNX → TensorRT engine (build time only): ``model.<precision>.engine`` + ``engine.json`` in the model's
artifacts folder.

One function, ``build_engine``, for TensorRT 10.x and 11.x. What differs between them is only how
a precision is expressed (``app.builder.trt_recipe.build_recipe`` decides, and is unit tested):

* 10.x has weak typing: fp16 is ``BuilderFlag.FP16`` on a network made by ``create_network(0)``.
* 11.x is strongly typed only: the precision flags and INT8 calibrators are gone, fp16 comes
  from an fp16 ONNX model made by NVIDIA ModelOpt AutoCast (fp32 I/O kept).
* int8 is the same on both: the calibrated Q/DQ ONNX model (``app.builder.int8``; percentile by default, entropy on request) and a
  network created with ``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` (required on 10.x,
  accepted and ignored on 11.x, where every network is strongly typed).

Everything else is the same API on both: ``OnnxParser.parse_from_file``, one optimization
profile on the batch axis and, for a dynamic export, on height and width (``spatial_profile``:
rect inputs up to the square), ``MemoryPoolType.WORKSPACE``, the timing cache
(``create_timing_cache`` / ``set_timing_cache`` / ``get_timing_cache().serialize()``), an
``IProgressMonitor`` (10.0+) driving a rich progress bar, and ``build_serialized_network``.
The runtime side lives in ``app.backends.tensorrt``; build and run never share a module.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

from app.artifacts.engines import EngineMeta, engine_file_name, now_iso, save_engine_meta
from app.artifacts.store import write_atomically
from app.builder.trt_recipe import BuildRecipe, build_recipe, select_profile, spatial_profile
from app.config import ENGINE_MAX_BATCH, ENGINE_OPT_BATCH, ENGINE_PRECISIONS, check_choice
from app.errors import ArtifactError, BackendUnavailable, CalibrationError, InvalidParameter
from app.weights import sha256_file


def esc(text: str) -> str:
    """Paths and GPU names printed through rich must not be read as markup (``[...]``)."""
    from rich.markup import escape

    return escape(text)


FP16_ONNX_NAME = "model.fp16.onnx"
TIMING_CACHE_NAME = "timing.cache"
MODELOPT_HINT = "pip install 'nvidia-modelopt[onnx]' (TensorRT 11 builds fp16 from an fp16 ONNX model made by ModelOpt AutoCast)"


def build_engine(
    weights: str = "sample",
    *,
    precision: str = "int8",
    calib_images: Path | None = None,
    min_batch: int = 1,
    opt_batch: int = ENGINE_OPT_BATCH,
    max_batch: int = ENGINE_MAX_BATCH,
    imgsz: int = 640,
    artifacts_dir: Path | None = None,
    workspace_gib: float = 4.0,
    timing_cache: Path | None = None,
    console: Any = None,
) -> Path:
    """Export (if needed), calibrate (int8, if needed) and build; returns the engine path.

    Cheap checks come first (arguments, the tensorrt import, a GPU, ModelOpt for 11.x fp16,
    calibration images for int8), so a machine that cannot build says so before any export.
    """
    # 1. arguments and the machine: nothing is written before these pass
    check_choice("precision", precision, ENGINE_PRECISIONS)
    min_batch, opt_batch, max_batch = select_profile(min_batch, opt_batch, max_batch)
    if not 0 < workspace_gib <= 1024:
        raise InvalidParameter(f"workspace must be within (0, 1024] GiB, got {workspace_gib}")

    from app.gpu.probe import gpu_identity
    from app.gpu.tensorrt_lib import import_tensorrt, trt_logger

    trt = import_tensorrt()  # BackendUnavailable with the install hint
    from app.gpu.probe import cuda_device_count

    if cuda_device_count() == 0:
        raise BackendUnavailable("building a TensorRT engine needs an NVIDIA GPU and none was found")
    recipe = build_recipe(precision, trt_version=trt.__version__, has_fp16_flag=hasattr(trt.BuilderFlag, "FP16"))
    if recipe.source == "fp16_autocast" and importlib.util.find_spec("modelopt") is None:
        raise BackendUnavailable(f"TensorRT {trt.__version__} builds fp16 only from an fp16 ONNX model", hint=MODELOPT_HINT)

    from app.artifacts.store import artifacts_root
    from app.artifacts.store import model_dir as model_dir_of
    from app.weights import resolve_weights

    resolved = resolve_weights(weights)
    model_dir = model_dir_of(artifacts_root(artifacts_dir), resolved.name, resolved.sha256, imgsz)
    if recipe.source == "int8_qdq":
        _check_calibration_inputs(model_dir, calib_images)

    from rich.console import Console

    console = console or Console(stderr=True)

    # 2. the ONNX model TensorRT will parse
    from app.builder.export import export_onnx

    exported = export_onnx(weights, imgsz=imgsz, artifacts_dir=artifacts_dir)
    model_dir, meta = exported.model_dir, exported.meta
    source_onnx = _source_model(recipe, exported.onnx_path, weights, calib_images, imgsz, artifacts_dir, console)

    # 3. the build
    gpu_name, capability = gpu_identity(0)
    cache_path = Path(timing_cache) if timing_cache else model_dir / TIMING_CACHE_NAME
    console.print(
        f"[bold]TensorRT {trt.__version__}[/bold] on {esc(gpu_name)} (sm {capability}): "
        f"{precision} from {esc(source_onnx.name)}, {_describe(recipe)}, batch {min_batch}/{opt_batch}/{max_batch}"
    )
    serialized = _build_serialized(
        trt, trt_logger(), recipe, source_onnx,
        profile=(min_batch, opt_batch, max_batch), imgsz=meta.imgsz,
        workspace_bytes=int(workspace_gib * (1 << 30)), cache_path=cache_path, console=console,
    )

    # 4. the artifacts: engine first, then its description (an entry never points at a missing file)
    engine_path = model_dir / engine_file_name(precision)
    write_atomically(engine_path, serialized)  # a killed build leaves the old engine or none, never a part
    save_engine_meta(
        model_dir,
        EngineMeta(
            precision=precision,
            engine_file=engine_path.name,
            trt_version=trt.__version__,
            gpu_name=gpu_name,
            compute_capability=capability,
            min_batch=min_batch,
            opt_batch=opt_batch,
            max_batch=max_batch,
            imgsz=meta.imgsz,
            source_onnx=source_onnx.name,
            onnx_sha256=sha256_file(source_onnx),
            export_onnx_sha256=meta.onnx_sha256,
            class_names=list(meta.names),
            input_name=meta.input_name,
            output_name=meta.output_name,
            weights=str(weights),
            created_at=now_iso(),
            builder_options={
                "strongly_typed": recipe.strongly_typed,
                "fp16_flag": recipe.fp16_flag,
                "tf32": not recipe.disable_tf32,
                "source": recipe.source,
                "workspace_gib": workspace_gib,
                "timing_cache": str(cache_path),
            },
        ),
    )
    console.print(f"built {esc(engine_path.name)} ({engine_path.stat().st_size / 2**20:.1f} MiB), described in {esc(str(model_dir / 'engine.json'))}")
    return engine_path


def _describe(recipe: BuildRecipe) -> str:
    if recipe.fp16_flag:
        return "weakly typed network + BuilderFlag.FP16"
    if recipe.strongly_typed:
        return "strongly typed network"
    return "network without precision flags" + (" (TF32 off)" if recipe.disable_tf32 else "")


# --- inputs -------------------------------------------------------------------------------------
def _check_calibration_inputs(model_dir: Path, calib_images: Path | None) -> None:
    """int8 needs the Q/DQ model or images to make it; say so before exporting anything."""
    from app.artifacts.int8 import int8_qdq_model_path

    if int8_qdq_model_path(model_dir).is_file():
        return
    if calib_images is None:
        raise CalibrationError(
            f"an int8 engine needs a calibrated Q/DQ model and {int8_qdq_model_path(model_dir)} does not exist",
            hint="pass --calib-images DIR (representative photos), or run `yolopipe calibrate` first",
        )
    if not Path(calib_images).is_dir():
        raise CalibrationError(f"calibration image folder not found: {calib_images}")


def _source_model(
    recipe: BuildRecipe,
    onnx_path: Path,
    weights: str,
    calib_images: Path | None,
    imgsz: int,
    artifacts_dir: Path | None,
    console: Any,
) -> Path:
    model_dir = onnx_path.parent
    if recipe.source == "fp32":
        return onnx_path
    if recipe.source == "fp16_autocast":
        return _autocast_fp16(onnx_path, model_dir / FP16_ONNX_NAME, console)

    from app.artifacts.int8 import int8_qdq_model_path

    qdq_path = int8_qdq_model_path(model_dir)
    # a Q/DQ model older than the export was calibrated from other weights
    stale = qdq_path.is_file() and qdq_path.stat().st_mtime < onnx_path.stat().st_mtime
    if qdq_path.is_file() and not stale:
        return qdq_path
    if calib_images is None:
        raise CalibrationError(
            f"{qdq_path} is older than the export it should quantize",
            hint="pass --calib-images DIR to recalibrate",
        )
    from app.builder.int8 import calibrate

    console.print(f"calibrating int8 from {esc(str(calib_images))} ...")
    calibrate(weights, Path(calib_images), imgsz=imgsz, artifacts_dir=artifacts_dir)
    if not qdq_path.is_file():
        raise ArtifactError(f"calibration finished but {qdq_path} was not written")
    return qdq_path


def _autocast_fp16(onnx_path: Path, out_path: Path, console: Any) -> Path:
    """NVIDIA's documented 11.x fp16 route: ModelOpt AutoCast, fp32 inputs and outputs kept."""
    if out_path.is_file() and out_path.stat().st_mtime >= onnx_path.stat().st_mtime:
        return out_path
    import onnx
    from modelopt.onnx.autocast import convert_to_mixed_precision

    console.print(f"converting {esc(onnx_path.name)} to fp16 with ModelOpt AutoCast ...")
    model = convert_to_mixed_precision(onnx_path=str(onnx_path), low_precision_type="fp16", keep_io_types=True)
    tmp = out_path.with_suffix(".onnx.tmp")
    onnx.save(model, str(tmp))
    tmp.replace(out_path)
    return out_path


# --- TensorRT -----------------------------------------------------------------------------------
def _build_serialized(
    trt: Any,
    logger: Any,
    recipe: BuildRecipe,
    source_onnx: Path,
    *,
    profile: tuple[int, int, int],
    imgsz: int,
    workspace_bytes: int,
    cache_path: Path,
    console: Any,
) -> Any:
    builder = trt.Builder(logger)
    if builder is None:
        raise BackendUnavailable("TensorRT could not create a builder (is the GPU usable?)")

    # 10.x: 0 is explicit batch, the only mode left; STRONGLY_TYPED opts into strong typing.
    # 11.x: every network is strongly typed; the flag, where the enum still has it, is ignored.
    flags = 0
    if recipe.strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    if network is None:
        raise ArtifactError("TensorRT could not create a network definition")

    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(source_onnx)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise ArtifactError(
            f"TensorRT could not parse {source_onnx.name}: {errors[0] if errors else 'unknown error'}"
            + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
            hint="re-export with `yolopipe export --force`",
        )
    if network.num_inputs != 1:
        raise ArtifactError(f"expected one network input, {source_onnx.name} has {network.num_inputs}")
    input_name = network.get_input(0).name

    config = builder.create_builder_config()
    if config is None:
        raise ArtifactError("TensorRT could not create a builder config")
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if recipe.fp16_flag:  # 10.x only: build_recipe never asks for it where the flag is gone
        config.set_flag(trt.BuilderFlag.FP16)
    if recipe.disable_tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)

    lo, opt, hi = profile
    (min_h, min_w), (opt_h, opt_w), (max_h, max_w) = spatial_profile(tuple(network.get_input(0).shape), imgsz)
    opt_profile = builder.create_optimization_profile()
    opt_profile.set_shape(input_name, (lo, 3, min_h, min_w), (opt, 3, opt_h, opt_w), (hi, 3, max_h, max_w))
    if config.add_optimization_profile(opt_profile) < 0:
        raise ArtifactError(f"TensorRT rejected the profile: batch {lo}/{opt}/{hi}, height and width "
                            f"{min_h}x{min_w}/{opt_h}x{opt_w}/{max_h}x{max_w}, for input {input_name}")

    cache = _load_timing_cache(config, cache_path, console)

    monitor = None
    if hasattr(trt, "IProgressMonitor"):  # 10.0+
        monitor = _make_progress_monitor(trt, console)
        config.progress_monitor = monitor
    try:
        if monitor is not None:
            monitor.progress.start()
        serialized = builder.build_serialized_network(network, config)
    finally:
        if monitor is not None:
            monitor.progress.stop()
    if serialized is None:
        raise ArtifactError(f"TensorRT failed to build an engine from {source_onnx.name} (see the TensorRT log above)")

    updated = config.get_timing_cache()
    if updated is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(updated.serialize())
        tmp.replace(cache_path)
    # Free the TensorRT objects before what they point at: the config refers to the timing cache
    # and the progress monitor, which must outlive it (IProgressMonitor docs).
    del updated, parser, network, config, builder
    del cache, monitor
    return serialized


def _load_timing_cache(config: Any, cache_path: Path, console: Any) -> Any:
    """Reuse tactic timings from earlier builds; a cache from another GPU/version starts over."""
    data = cache_path.read_bytes() if cache_path.is_file() else b""
    cache = config.create_timing_cache(data)
    if cache is None and data:  # unreadable (another TensorRT version): start empty
        console.print(f"[yellow]ignoring unreadable timing cache {esc(str(cache_path))}[/yellow]")
        cache = config.create_timing_cache(b"")
    if cache is None:
        raise ArtifactError("TensorRT could not create a timing cache")
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        console.print(f"[yellow]timing cache {esc(str(cache_path))} was made on another device; starting a new one[/yellow]")
        cache = config.create_timing_cache(b"")
        if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
            raise ArtifactError("TensorRT could not use a fresh timing cache")
    return cache


def _make_progress_monitor(trt: Any, console: Any) -> Any:
    """A ``trt.IProgressMonitor`` that shows each builder phase as a rich progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    class RichProgressMonitor(trt.IProgressMonitor):
        # TensorRT calls these from its own threads; never let an exception escape into it.
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console, transient=True,
            )
            self._tasks: dict[str, Any] = {}
            self._depth: dict[str, int] = {}
            self._lock = threading.Lock()

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            try:
                with self._lock:
                    depth = self._depth.get(parent_phase, -1) + 1 if parent_phase else 0
                    self._depth[phase_name] = depth
                    self._tasks[phase_name] = self.progress.add_task("  " * depth + phase_name, total=max(num_steps, 1))
            except Exception:
                pass

        def step_complete(self, phase_name: str, step: int) -> bool:
            try:
                with self._lock:
                    task = self._tasks.get(phase_name)
                    if task is not None:
                        self.progress.update(task, completed=step + 1)
            except Exception:
                pass
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            try:
                with self._lock:
                    task = self._tasks.pop(phase_name, None)
                    self._depth.pop(phase_name, None)
                    if task is not None:
                        self.progress.remove_task(task)
            except Exception:
                pass

    return RichProgressMonitor()

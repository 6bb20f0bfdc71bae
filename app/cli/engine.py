"""``build-engine``: which engine this machine gets (TensorRT, else torch-cuda on a GPU), built
with its progress on the terminal. Imported by the command when it runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rich.markup import escape

from app.cli.terminal import console
from app.config import BACKENDS, ENGINE_PRECISIONS, check_choice
from app.errors import BackendUnavailable, InvalidParameter

BUILD_BACKENDS = ("auto", "tensorrt", "torch-cuda")


def build_backend(backend: str) -> str:
    """``auto`` → TensorRT where it is installed, else torch-cuda on a GPU; a CPU has no engine to build."""
    from app.gpu.probe import cuda_device_count

    check_choice("backend", backend, BACKENDS)
    if backend == "onnxruntime":
        raise InvalidParameter("ONNX Runtime runs the exported model.onnx: `yolopipe export` (and `calibrate` "
                               "for int8) is all it needs")
    if backend != "auto":
        return backend
    if importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt"
    if cuda_device_count() == 0:
        raise BackendUnavailable("build-engine builds a GPU engine (TensorRT, else torch-cuda) and this machine has "
                                 "no NVIDIA GPU", hint="on a CPU, ONNX Runtime runs the model `yolopipe export` writes")
    return "torch-cuda"


def build_engine_command(weights: str, *, backend: str, precision: str, calib_images: Path | None, min_batch: int,
                         opt_batch: int, max_batch: int, imgsz: int, artifacts_dir: Path | None,
                         workspace_gib: float, batch_invariant: bool = True, tuning_cache: Path | None = None) -> None:
    check_choice("precision", precision, ("auto", *ENGINE_PRECISIONS))
    backend = build_backend(backend)
    if tuning_cache is not None:  # on the backend auto resolves to: TensorRT reads no tuning cache
        check_tuning_cache(tuning_cache, backend=backend, batch_invariant=batch_invariant)
    if backend == "tensorrt":
        from app.builder.trt_build import build_engine

        path = build_engine(weights, precision="int8" if precision == "auto" else precision,
                            calib_images=calib_images, min_batch=min_batch, opt_batch=opt_batch, max_batch=max_batch,
                            imgsz=imgsz, artifacts_dir=artifacts_dir, workspace_gib=workspace_gib, console=console)
        console.print(f"wrote {path}", highlight=False)
        return
    from app.builder.torch_build import build_for_weights

    with console.status("torch-cuda engine: loading the model (its ONNX export runs beside the build)…") as status:
        def say(text: str) -> None:
            status.update(escape(text))
            console.print(escape(text), highlight=False)

        path, built = build_for_weights(weights, precision="fp16" if precision == "auto" else precision,
                                        max_batch=max_batch, imgsz=imgsz, artifacts_dir=artifacts_dir,
                                        batch_invariant=batch_invariant, tuning_cache=tuning_cache, say=say)
    console.print(f"{'wrote' if built else 'up to date'}: {path}", highlight=False)
    console.print(torch_engine_summary(path), highlight=False)


def check_tuning_cache(path: Path, *, backend: str, batch_invariant: bool) -> None:
    """``--tuning-cache``: a usage error, before any work, where no build would read it or the
    file named is not one (a missing file is fine: the build writes it)."""
    from app.artifacts.tuning_cache import read_tuning_cache

    if backend == "tensorrt" or not batch_invariant:
        raise InvalidParameter("--tuning-cache holds the kernel tunings of the torch-cuda engine's batch-invariant "
                               "build; " + ("TensorRT keeps its own timing cache" if backend == "tensorrt"
                                            else "--no-batch-invariant runs cuDNN's kernels, which are not tuned"))
    if Path(path).is_dir():
        raise InvalidParameter(f"--tuning-cache {path} is a folder: name a file")
    read_tuning_cache(path)  # an ArtifactError saying why, for a file that is not a tuning cache


def torch_engine_summary(path: Path) -> str:
    """One line on a torch-cuda package: what it runs, its build, and how long a fresh process
    takes to load it (measured by the build's fresh-process check)."""
    from app.artifacts.torch_engines import manifest_of

    manifest = manifest_of(path)
    if manifest is None:
        return "  (no manifest beside it)"
    key, fresh = manifest.key, manifest.builder.get("fresh_process", {})
    batches = str(key.min_batch) if key.min_batch == key.max_batch else f"{key.min_batch}-{key.max_batch}"
    line = (f"  {key.precision}, batches {batches}, {key.kernels} kernels, {key.gpu_name}, torch {key.torch_version}; "
            f"built in {manifest.build_seconds:.0f} s")
    if "load_s" in fresh:
        line += f"; a fresh process loads it in {fresh['load_s']:.2f} s"
        if "first_run_s" in fresh:
            line += f" and runs its first batch in {fresh['first_run_s']:.2f} s"
    tuning = manifest.builder.get("tuning")
    if isinstance(tuning, dict):
        line += (f"; {tuning.get('tunings')} kernel tunings, "
                 + ("read from " if tuning.get("tuning_cache") == "hit" else "saved to ") + str(tuning.get("cache")))
    return line

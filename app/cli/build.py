"""The build commands: ``export``, ``calibrate`` and ``build-engine``. Each imports its builder
when it runs, so listing the commands loads none of them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.options import BATCH_INVARIANT_HELP, ArtifactsDir, Imgsz, Weights
from app.cli.terminal import console
from app.config import ENGINE_MAX_BATCH, ENGINE_OPT_BATCH


def export(
    weights: Weights = "sample",
    imgsz: Imgsz = 640,
    artifacts_dir: ArtifactsDir = None,
    force: Annotated[bool, typer.Option(help="Export again even if the weights did not change.")] = False,
) -> None:
    """Export weights to ONNX, with meta.json.

    The model gets a dynamic batch and a fixed imgsz; it is kept in the artifacts folder.
    """
    from app.builder.export import export_onnx

    with console.status("exporting to ONNX…"):
        result = export_onnx(weights, imgsz=imgsz, artifacts_dir=artifacts_dir, force=force)
    verb = "up to date" if result.reused else "exported"
    console.print(f"{verb}: {result.onnx_path} ({len(result.meta.names)} classes, output {result.meta.output_shape})",
                  highlight=False)


def calibrate(
    images: Annotated[Path, typer.Option(help="Images and videos like the ones you will serve (a folder, recursive; "
                                              "videos give --frames-per-video frames each). 64+ advised, 8 at least.")],
    weights: Weights = "sample",
    num_images: Annotated[int, typer.Option(help="Calibration images to use at most.")] = 512,
    method: Annotated[str | None, typer.Option(help="entropy (TensorRT's) | max | mse | percentile [default: mse, "
                                                       "the one that held up best: calibration/README.md].")] = None,
    heldout_images: Annotated[Path | None, typer.Option(help="A separate folder for the accuracy report, of other "
                                                                "scenes or cameras: the trustworthy figure [default: "
                                                                "hold out images of --images, which overestimates].")] = None,
    holdout: Annotated[int, typer.Option(help="Images of --images held out for the report (never calibrated on).")] = 100,
    frames_per_video: Annotated[int, typer.Option(help="Frames sampled from each video.")] = 32,
    max_float_layers: Annotated[int, typer.Option(help="Mixed precision, per model: layers reverted to float (most "
                                                       "sensitive first, measured on that model) while it is below "
                                                       "--min-f1 or --target-f1; 0: off.")] = 6,
    target_f1: Annotated[float, typer.Option(help="Accuracy control: mixed precision reverts layers while the "
                                                  "lower bound of the held-out F1's 95 % interval is below this.")] = 0.97,
    imgsz: Imgsz = 640,
    artifacts_dir: ArtifactsDir = None,
    min_f1: Annotated[float, typer.Option(help="Accuracy gate: the lower bound of INT8-vs-FP32 F1's 95 % interval "
                                               "(IoU 0.5) on the held-out images.")] = 0.90,
    allow_low_accuracy: Annotated[bool, typer.Option(help="Install the models even below --min-f1.")] = False,
    distill: Annotated[str, typer.Option(help="Quantization-aware distillation after PTQ: each model's weights "
                                              "fine-tuned against FP32's outputs on the calibration images, kept "
                                              "only if the held-out agreement is better. auto: on a CUDA GPU | "
                                              "on (a CPU takes long) | off.")] = "auto",
    distill_minutes: Annotated[float, typer.Option(help="Distillation's time limit, both models together.")] = 4.0,
) -> None:
    """Calibrate INT8, with an accuracy report.

    Writes the Q/DQ models (TensorRT and CPU) and the report; below the gate the report is
    written and the models are not installed (exit status 1). The models and the report are
    installed together: a calibration stopped midway installs nothing.
    """
    from app.builder.int8 import DEFAULT_METHOD, METHODS
    from app.builder.int8 import calibrate as run_calibration
    from app.builder.int8.distill import DistillSettings
    from app.builder.int8.distill_plan import MODES
    from app.config import check_choice

    check_choice("calibration method", method or DEFAULT_METHOD, METHODS)  # usage errors, before any work
    check_choice("--distill", distill, MODES)
    if not distill_minutes > 0:
        from app.errors import InvalidParameter

        raise InvalidParameter(f"--distill-minutes must be positive, got {distill_minutes}")
    result = run_calibration(
        weights, images, num_images=num_images, method=method or DEFAULT_METHOD, imgsz=imgsz,
        artifacts_dir=artifacts_dir, min_f1=min_f1, allow_low_accuracy=allow_low_accuracy, console=console,
        heldout_images=heldout_images, holdout=holdout, frames_per_video=frames_per_video,
        max_float_layers=max_float_layers, target_f1=target_f1, distill=distill,
        distill_settings=DistillSettings(time_limit_s=distill_minutes * 60),
    )
    for path in (result.tensorrt_qdq_path, result.cpu_qdq_path, result.report_path):
        console.print(f"wrote {path}", highlight=False)


def build_engine(
    weights: Weights = "sample",
    backend: Annotated[str, typer.Option(help="auto | tensorrt | torch-cuda. auto: TensorRT where it is installed, "
                                              "else the torch-cuda engine (an AOTInductor package) on a GPU.")] = "auto",
    precision: Annotated[str, typer.Option(help="auto | int8 | fp16 | fp32. auto: int8 on TensorRT, fp16 on "
                                                "torch-cuda (which runs fp16 or fp32).")] = "auto",
    calib_images: Annotated[Path | None, typer.Option(help="TensorRT: calibration images (int8, first build).")] = None,
    min_batch: Annotated[int, typer.Option(help="TensorRT optimization profile: smallest batch.")] = 1,
    opt_batch: Annotated[int, typer.Option(help="TensorRT optimization profile: batch tuned for.")] = ENGINE_OPT_BATCH,
    max_batch: Annotated[int, typer.Option(help="Largest batch the engine takes (torch-cuda: every batch from 1 "
                                                "to it, in one package).")] = ENGINE_MAX_BATCH,
    imgsz: Imgsz = 640,
    artifacts_dir: ArtifactsDir = None,
    workspace_gib: Annotated[float, typer.Option(help="TensorRT builder workspace limit in GiB.")] = 4.0,
    batch_invariant: Annotated[bool, typer.Option("--batch-invariant/--no-batch-invariant",
                                                  help=BATCH_INVARIANT_HELP)] = True,
    tuning_cache: Annotated[Path | None, typer.Option(
        help="torch-cuda, batch-invariant: the tuning cache to read (where it fits this GPU, software and model "
             "graph) and to write this build's kernel tunings to; copy it to machines with the same GPU and "
             "software. Default: $YOLOPIPE_TUNING_CACHE, else tuning.json in the model's torch-cache folder.")] = None,
) -> None:
    """Build the engine for this machine's GPU, ahead of time.

    TensorRT where it is installed: export (if needed) → calibrate (int8) → engine + engine.json.
    Else, on an NVIDIA GPU, the torch-cuda engine: the model traced by torch.export and compiled
    by AOTInductor into one package for batches 1 to --max-batch, so predict and serve start
    without compiling anything. A build that fits this GPU and torch already is kept.
    """
    from app.cli.engine import build_engine_command

    build_engine_command(weights, backend=backend, precision=precision, calib_images=calib_images, min_batch=min_batch,
                         opt_batch=opt_batch, max_batch=max_batch, imgsz=imgsz, artifacts_dir=artifacts_dir,
                         workspace_gib=workspace_gib, batch_invariant=batch_invariant, tuning_cache=tuning_cache)

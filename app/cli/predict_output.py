"""``predict``'s outputs that are not a folder's: the streams' JSON lines, the progress bar, and
``--video-decode`` checked before any work. Imported by ``predict`` when it runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from app.cli import ExitCode, console
from app.errors import YolopipeError


def check_video_decode(detector: Any) -> None:
    """The detector's ``--video-decode``: one this backend cannot use fails now, before any work."""
    from app.pipeline.sources import video_decoder

    try:
        video_decoder(detector)
    except YolopipeError:
        detector.close()
        raise


def predict_streams_command(source: str, out: Path, *, detect: dict, vid_stride: int, track: bool, **model) -> None:
    """``predict`` on a URL or a ``.streams``/``.txt`` list: every source at once, one JSON line per
    processed frame on ``--out`` (``-``: stdout), flushed per frame, until every source has ended."""
    import sys

    from app.pipeline.streams import predict_streams, read_source_list
    from app.runtime import open_detector

    sources = read_source_list(source)
    with console.status("loading model…"):
        detector = open_detector(max_batch=model.pop("batch"), **model)
    check_video_decode(detector)
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

        summary = predict_streams(detector, sources, write, detector.params(**detect), vid_stride=vid_stride,
                                  track=track)
    for line in summary.failed[:20]:
        console.print(f"[yellow]failed[/] {escape(line)}", highlight=False)
    console.print(f"{summary.streams} streams, {summary.frames} frames, {summary.detections} detections, "
                  f"{summary.dropped} dropped, {len(summary.failed)} failed → {out}", highlight=False)
    if summary.failed:
        raise typer.Exit(ExitCode.INCOMPLETE)


@contextlib.contextmanager
def progress_bar() -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr; yields its ``on_progress(advance, total)``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("predict"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("predict", total=None)
        yield lambda advance, total: progress.update(task, total=total, advance=advance)

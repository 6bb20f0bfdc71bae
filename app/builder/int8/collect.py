"""The calibration pass: every activation of the FP32 model, image by image, into histograms."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.builder.int8.histograms import AbsHistogram, ActivationHistograms
from app.builder.int8.images import CalibrationItem, letterboxed
from app.imaging.letterbox import to_input


def with_progress(iterable: Iterable, total: int, label: str, console=None):
    """The items one by one under one progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task(label, total=total)
        for item in iterable:
            yield item
            progress.advance(task)


def collect_histograms(onnx_path: Path, items: Sequence[CalibrationItem], tensors: Sequence[str], *, imgsz: int,
                       console=None) -> tuple[dict[str, AbsHistogram], list[CalibrationItem]]:
    """Run the model with ``tensors`` as outputs over the items, one image at a time (all
    activations of one 640 image are ~0.4 GB); returns the histograms and the items read."""
    import onnx

    from app.builder.int8.graph import augmented_model
    from app.builder.int8.report import OrtModel

    model = augmented_model(onnx.load(str(onnx_path)), list(tensors))
    session = OrtModel(model.SerializeToString(), spin=False)
    del model
    collector = ActivationHistograms()
    used: list[CalibrationItem] = []

    def histogram(outputs: list) -> None:
        for name, values in zip(tensors, outputs):
            collector.add(name, values)

    # One image's histograms (compiled, GIL released) while ORT runs the next: two images'
    # activations in memory at most.
    with ThreadPoolExecutor(max_workers=1) as worker:
        pending = None
        for item, image, _ in with_progress(letterboxed(items, imgsz, console), len(items), "calibrating", console):
            outputs = session.run(to_input([image]))
            if pending is not None:
                pending.result()
            pending = worker.submit(histogram, outputs)
            del outputs
            used.append(item)
        if pending is not None:
            pending.result()
    return collector.finish(), used

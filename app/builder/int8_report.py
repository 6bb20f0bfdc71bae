"""INT8 vs FP32 agreement on held-out images, run through the real CPU request path.

Both models run in ``CpuPipeline`` + ``OnnxRuntimeBackend`` with the serving defaults
(conf 0.25, IoU 0.7), so what is measured is what a user of ``--precision int8`` gets. The
FP32 detections are the reference: an INT8 box counts when it has the same class and IoU
>= 0.5 with an FP32 box, matched one-to-one by ``app.boxes`` (greedy, highest IoU
first), the matching every other agreement figure in the project uses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.boxes import f1, match_pairs
from app.types import Detections, DetectParams, ModelMeta

MATCH_IOU = 0.5
REPORT_PARAMS = DetectParams(conf=0.25, iou=0.7)


@dataclass
class ImageAgreement:
    image: str
    fp32_boxes: int
    int8_boxes: int
    matched: int


@dataclass
class Int8Report:
    """One INT8 model against its FP32 model on the same images."""

    int8_model: str
    images: int
    fp32_boxes: int
    int8_boxes: int
    matched: int
    precision: float  # matched / int8 boxes
    recall: float  # matched / fp32 boxes
    f1: float
    mean_iou: float  # over matched pairs
    mean_score_drift: float  # mean |score_int8 - score_fp32| over matched pairs
    max_score_drift: float
    lost_all: list[str] = field(default_factory=list)  # images where FP32 found boxes and INT8 none
    per_image: list[ImageAgreement] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def match_detections(ref: Detections, test: Detections, iou_threshold: float = MATCH_IOU) -> list[tuple[int, int, float]]:
    """``(ref index, test index, IoU)`` per matched pair: ``agreement.match_pairs`` on two Detections."""
    return match_pairs(ref.boxes, ref.class_ids, test.boxes, test.class_ids, iou_threshold)


def summarize(
    int8_model: str, names: Sequence[str], fp32: Sequence[Detections], int8: Sequence[Detections]
) -> Int8Report:
    """The agreement figures of per-image detection lists (same order, same images)."""
    per_image, ious, drifts, lost = [], [], [], []
    for name, ref, test in zip(names, fp32, int8):
        pairs = match_detections(ref, test)
        per_image.append(ImageAgreement(name, len(ref), len(test), len(pairs)))
        ious += [p[2] for p in pairs]
        drifts += [abs(float(test.scores[j]) - float(ref.scores[i])) for i, j, _ in pairs]
        if len(ref) and not len(test):
            lost.append(name)
    n_ref = sum(a.fp32_boxes for a in per_image)
    n_test = sum(a.int8_boxes for a in per_image)
    matched = sum(a.matched for a in per_image)
    return Int8Report(
        int8_model=int8_model,
        images=len(per_image),
        fp32_boxes=n_ref,
        int8_boxes=n_test,
        matched=matched,
        precision=matched / n_test if n_test else 1.0,
        recall=matched / n_ref if n_ref else 1.0,
        f1=f1(matched, n_ref, n_test),  # no boxes on either side: 1.0, perfect agreement
        mean_iou=float(np.mean(ious)) if ious else 0.0,
        mean_score_drift=float(np.mean(drifts)) if drifts else 0.0,
        max_score_drift=float(np.max(drifts)) if drifts else 0.0,
        lost_all=lost,
        per_image=per_image,
    )


def detect_all(onnx_path: Path, meta: ModelMeta, images: Sequence[np.ndarray], *, precision: str, batch: int = 4) -> list[Detections]:
    """Detections in original pixels for decoded BGR images, through the CPU request path."""
    from app.backends.onnxruntime import OnnxRuntimeBackend
    from app.pipeline.cpu import CpuPipeline
    from app.boxes import rows_to_detections

    pipeline = CpuPipeline(OnnxRuntimeBackend(onnx_path, precision=precision), meta, max_batch=batch)
    try:
        out: list[Detections] = []
        for start in range(0, len(images), batch):
            for result in pipeline.run(images[start : start + batch], REPORT_PARAMS):
                rows, lb = result  # decoded arrays never come back as per-image errors
                out.append(rows_to_detections(rows, lb))
        return out
    finally:
        pipeline.close()


def compare_models(
    fp32_onnx: Path,
    int8_onnx: Path,
    meta: ModelMeta,
    images: Sequence[np.ndarray],
    names: Sequence[str],
    *,
    fp32_detections: Sequence[Detections] | None = None,
) -> tuple[Int8Report, list[Detections]]:
    """Run both models on the images; returns the report and the FP32 detections (to reuse)."""
    if fp32_detections is None:
        fp32_detections = detect_all(fp32_onnx, meta, images, precision="fp32")
    int8_detections = detect_all(int8_onnx, meta, images, precision="int8")
    return summarize(Path(int8_onnx).name, names, fp32_detections, int8_detections), list(fp32_detections)


def print_report(reports: Sequence[Int8Report], console=None, *, title: str = "INT8 vs FP32 (held-out images)") -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title)
    table.add_column("INT8 model", no_wrap=True)
    for col in ("images", "FP32 boxes", "INT8 boxes", "F1@.5", "IoU", "|Δscore| mean/max", "lost all"):
        table.add_column(col, justify="right")
    for r in reports:
        table.add_row(
            r.int8_model,
            str(r.images),
            str(r.fp32_boxes),
            str(r.int8_boxes),
            f"{r.f1:.3f}",
            f"{r.mean_iou:.3f}",
            f"{r.mean_score_drift:.3f} / {r.max_score_drift:.3f}",
            ", ".join(r.lost_all) if r.lost_all else "none",
        )
    console.print(table)


def save_report(path: Path, payload: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)

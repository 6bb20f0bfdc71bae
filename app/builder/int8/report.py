"""INT8 vs FP32 agreement on held-out images, with ONNX Runtime run here at build time.

Both models see what a request sees (``app.imaging`` letterbox and model input, the NumPy NMS
of ``app.boxes``, boxes scaled back to the original pixels). The FP32 detections are the
reference: an INT8 box counts when it has the same class and IoU ≥ 0.5 with an FP32 box, matched
one-to-one by ``app.boxes.match_pairs``. Each model runs once per image with NMS at conf 0.001;
the serving threshold (0.25) and the low one (0.1) are filters of that (greedy NMS only lets a
higher score suppress a box, so filtering after NMS keeps the same boxes as NMS at that conf).

Figures: F1 and its bootstrap 95 % interval over images (the accuracy gate uses the lower
bound), precision, recall, IoU, score drift, images that lost every box, the worst images,
F1 at conf 0.1, and mAP50 of the INT8 detections with the FP32 boxes as ground truth (COCO's
evaluator, pycocotools).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.boxes import f1, match_pairs, nms_numpy, rows_to_detections
from app.contracts import DetectParams
from app.errors import AccuracyGateFailed
from app.imaging.letterbox import to_input
from app.types import Detections, Letterbox

MATCH_IOU = 0.5
SERVE_CONF = 0.25
LOW_CONF = 0.1
MAP_PARAMS = DetectParams(conf=0.001, iou=0.7, max_det=300)
BOOTSTRAP_SAMPLES = 2000
WORST_IMAGES = 5


@dataclass
class HeldOut:
    """The held-out images as the model sees them: letterboxed pixels and their placement."""

    names: list[str] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)  # [S, S, 3] BGR uint8
    placements: list[Letterbox] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)

    def subset(self, count: int) -> HeldOut:
        """``count`` images spread evenly over the set (neighbours are often alike)."""
        picks = sorted({int(i) for i in np.linspace(0, len(self) - 1, min(count, len(self)))}) if len(self) else []
        return HeldOut([self.names[i] for i in picks], [self.images[i] for i in picks],
                       [self.placements[i] for i in picks])


class OrtModel:
    """One ONNX Runtime CPU session (the builder's own: build time never imports the backends)."""

    def __init__(self, model: Path | bytes, *, threads: int | None = None, optimize: bool = True,
                 spin: bool = True) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                         else ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.log_severity_level = 3  # the quantized graphs' "could not fold" notes are not news
        if not spin:  # idle threads sleep: another thread of ours needs the cores between runs
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        source = model if isinstance(model, bytes) else str(model)
        self.session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def run(self, batch: np.ndarray, outputs: list[str] | None = None) -> list[np.ndarray]:
        return self.session.run(outputs, {self.input_name: batch})


def detect(model: Path | bytes | OrtModel, heldout: HeldOut, *, batch: int = 4) -> list[Detections]:
    """Detections (conf 0.001, original pixels) of every held-out image."""
    session = model if isinstance(model, OrtModel) else OrtModel(model)
    out: list[Detections] = []
    for start in range(0, len(heldout), batch):
        head = session.run(to_input(heldout.images[start : start + batch]))[0]
        for pred, lb in zip(head, heldout.placements[start : start + batch]):
            out.append(rows_to_detections(nms_numpy(pred, MAP_PARAMS), lb))
    return out


def above(det: Detections, conf: float) -> Detections:
    keep = det.scores > np.float32(conf)
    return Detections(det.boxes[keep], det.scores[keep], det.class_ids[keep])


@dataclass
class ImageAgreement:
    image: str
    fp32_boxes: int
    int8_boxes: int
    matched: int

    @property
    def f1(self) -> float:
        return f1(self.matched, self.fp32_boxes, self.int8_boxes)


@dataclass
class Int8Report:
    """One INT8 model against its FP32 model on the same images (conf 0.25 unless named)."""

    int8_model: str
    images: int
    fp32_boxes: int
    int8_boxes: int
    matched: int
    precision: float  # matched / int8 boxes
    recall: float  # matched / fp32 boxes
    f1: float
    f1_ci95: tuple[float, float]  # bootstrap over images
    f1_conf01: float  # the same agreement at conf 0.1
    fp32_boxes_conf01: int
    map50: float | None  # INT8 (conf 0.001) against the FP32 boxes as ground truth
    mean_iou: float  # over matched pairs
    mean_score_drift: float  # mean |score_int8 - score_fp32| over matched pairs
    max_score_drift: float
    lost_all: list[str] = field(default_factory=list)  # images where FP32 found boxes and INT8 none
    worst_images: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # why the figures may not be trusted
    per_image: list[ImageAgreement] = field(default_factory=list)

    @property
    def trustworthy(self) -> bool:
        return not self.warnings

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["trustworthy"] = self.trustworthy
        out["per_image"] = [{**asdict(a), "f1": round(a.f1, 4)} for a in self.per_image]
        return out


def agreement(names: Sequence[str], fp32: Sequence[Detections], int8: Sequence[Detections]):
    """Per-image agreement, matched IoUs and score drifts of two detection lists."""
    per_image, ious, drifts = [], [], []
    for name, ref, test in zip(names, fp32, int8):
        pairs = match_pairs(ref.boxes, ref.class_ids, test.boxes, test.class_ids, MATCH_IOU)
        per_image.append(ImageAgreement(name, len(ref), len(test), len(pairs)))
        ious += [p[2] for p in pairs]
        drifts += [abs(float(test.scores[j]) - float(ref.scores[i])) for i, j, _ in pairs]
    return per_image, ious, drifts


def bootstrap_f1(per_image: Sequence[ImageAgreement], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0):
    """95 % percentile interval of the pooled F1 over images drawn with replacement."""
    if not per_image:
        return 1.0, 1.0
    counts = np.array([(a.matched, a.fp32_boxes + a.int8_boxes) for a in per_image], np.float64)
    draws = np.random.default_rng(seed).integers(0, len(per_image), (samples, len(per_image)))
    matched, boxes = counts[draws, 0].sum(axis=1), counts[draws, 1].sum(axis=1)
    scores = np.where(boxes > 0, 2 * matched / np.maximum(boxes, 1), 1.0)
    lo, hi = np.percentile(scores, [2.5, 97.5])
    return float(lo), float(hi)


def map50(fp32: Sequence[Detections], int8: Sequence[Detections]) -> float | None:
    """COCO AP at IoU 0.5 of ``int8`` with ``fp32`` as the ground truth (pycocotools)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    classes = sorted({int(c) for d in [*fp32, *int8] for c in d.class_ids})
    annotations, results = [], []
    for image_id, (ref, test) in enumerate(zip(fp32, int8)):
        for box, cid in zip(ref.boxes, ref.class_ids):
            w, h = float(box[2] - box[0]), float(box[3] - box[1])
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": int(cid),
                                "bbox": [float(box[0]), float(box[1]), w, h], "area": w * h, "iscrowd": 0})
        for box, score, cid in zip(test.boxes, test.scores, test.class_ids):
            results.append({"image_id": image_id, "category_id": int(cid), "score": float(score),
                            "bbox": [float(box[0]), float(box[1]), float(box[2] - box[0]), float(box[3] - box[1])]})
    if not annotations:
        return None
    if not results:
        return 0.0
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        truth = COCO()
        truth.dataset = {"info": {}, "licenses": [], "images": [{"id": i} for i in range(len(fp32))],
                         "annotations": annotations, "categories": [{"id": c} for c in classes]}
        truth.createIndex()
        evaluator = COCOeval(truth, truth.loadRes(results), "bbox")
        evaluator.params.maxDets = [1, 10, MAP_PARAMS.max_det]
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return float(evaluator.stats[1])


def summarize(int8_model: str, names: Sequence[str], fp32: Sequence[Detections], int8: Sequence[Detections], *,
              min_images: int = 100, min_boxes: int = 200) -> Int8Report:
    """The report of two per-image detection lists at conf 0.001 (same order, same images)."""
    served_ref = [above(d, SERVE_CONF) for d in fp32]
    served = [above(d, SERVE_CONF) for d in int8]
    per_image, ious, drifts = agreement(names, served_ref, served)
    low, _, _ = agreement(names, [above(d, LOW_CONF) for d in fp32], [above(d, LOW_CONF) for d in int8])
    n_ref, n_test = sum(a.fp32_boxes for a in per_image), sum(a.int8_boxes for a in per_image)
    matched = sum(a.matched for a in per_image)
    low_ref = sum(a.fp32_boxes for a in low)
    warnings = []
    if len(per_image) < min_images:
        warnings.append(f"only {len(per_image)} held-out images (want {min_images}+)")
    if n_ref < min_boxes:
        warnings.append(f"only {n_ref} FP32 boxes on the held-out images (want {min_boxes}+): one box moves F1 "
                        f"by ~{2 / max(2 * n_ref, 1):.3f}")
    worst = sorted(per_image, key=lambda a: (a.f1, -a.fp32_boxes))[:WORST_IMAGES]
    return Int8Report(
        int8_model=int8_model,
        images=len(per_image),
        fp32_boxes=n_ref,
        int8_boxes=n_test,
        matched=matched,
        precision=matched / n_test if n_test else 1.0,
        recall=matched / n_ref if n_ref else 1.0,
        f1=f1(matched, n_ref, n_test),  # no boxes on either side: 1.0, perfect agreement
        f1_ci95=bootstrap_f1(per_image),
        f1_conf01=f1(sum(a.matched for a in low), low_ref, sum(a.int8_boxes for a in low)),
        fp32_boxes_conf01=low_ref,
        map50=map50(served_ref, int8),
        mean_iou=float(np.mean(ious)) if ious else 0.0,
        mean_score_drift=float(np.mean(drifts)) if drifts else 0.0,
        max_score_drift=float(np.max(drifts)) if drifts else 0.0,
        lost_all=[a.image for a in per_image if a.fp32_boxes and not a.int8_boxes],
        worst_images=[{**asdict(a), "f1": round(a.f1, 4)} for a in worst if a.f1 < 1.0],
        warnings=warnings,
        per_image=per_image,
    )


def print_report(reports: Sequence[Int8Report], console=None, *, title: str = "INT8 vs FP32 (held-out images)") -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title)
    table.add_column("INT8 model", no_wrap=True)
    for col in ("images", "FP32 boxes", "F1@.5 [95% CI]", "F1 conf .1", "mAP50", "IoU", "|Δscore| mean/max",
                "lost all"):
        table.add_column(col, justify="right")
    for r in reports:
        table.add_row(
            r.int8_model, str(r.images), str(r.fp32_boxes),
            f"{r.f1:.3f} [{r.f1_ci95[0]:.3f}, {r.f1_ci95[1]:.3f}]", f"{r.f1_conf01:.3f}",
            "-" if r.map50 is None else f"{r.map50:.3f}", f"{r.mean_iou:.3f}",
            f"{r.mean_score_drift:.3f} / {r.max_score_drift:.3f}", ", ".join(r.lost_all) if r.lost_all else "none",
        )
    console.print(table)
    if reports and reports[0].worst_images:
        worst = ", ".join(f"{w['image']} ({w['matched']}/{w['fp32_boxes']} FP32 boxes kept, {w['int8_boxes']} INT8)"
                          for w in reports[0].worst_images)
        console.print(f"worst held-out images ({reports[0].int8_model}): {worst}")
    for warning in reports[0].warnings if reports else []:
        console.print(f"[bold yellow]warning: the report is not trustworthy:[/bold yellow] {warning}")


def save_report(path: Path, payload: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


# --- the accuracy gate -------------------------------------------------------------------
def passes(report: Int8Report, min_f1: float) -> bool:
    return report.f1_ci95[0] >= min_f1 and not report.lost_all


def good_enough(report: Int8Report, min_f1: float, target_f1: float) -> bool:
    """Accuracy control's aim: the F1 interval's lower bound at ``target_f1`` (the same confidence
    the gate asks of ``min_f1``: held-out images of the calibration's scenes flatter the point F1)."""
    return passes(report, max(min_f1, target_f1))


def gate_error(report: Int8Report, min_f1: float) -> AccuracyGateFailed:
    lost = f"; INT8 found nothing on {len(report.lost_all)} of them" if report.lost_all else ""
    return AccuracyGateFailed(
        f"{report.int8_model} agrees with FP32 at F1 {report.f1:.3f} (95 % interval {report.f1_ci95[0]:.3f}–"
        f"{report.f1_ci95[1]:.3f}) on {report.images} held-out images, below the required {min_f1:.2f}{lost}; "
        "the INT8 models were not installed",
        hint="use more images like the ones you serve (--images), raise --max-float-layers, try another --method, "
        "or install them anyway with --allow-low-accuracy (the ranges and layer sensitivities are cached: it does "
        "not measure them again); --heldout-images DIR gives a figure for other scenes and cameras",
    )

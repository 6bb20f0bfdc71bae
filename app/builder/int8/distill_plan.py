"""``calibrate``'s distillation step: when it runs, and which model each target keeps.

``--distill auto`` (the default) distils where torch sees a CUDA GPU and not on a CPU: there a
step of the sample model takes seconds, and the 5 minutes a default may cost give too few of them
to gain anything (calibration/README.md, "Quantization-aware distillation"). ``on`` distils
anywhere, ``off`` never.

Each written model is distilled (``distill.py``), scored on the same held-out images as the PTQ
model, and kept only if it agrees better with FP32: a higher F1, or the same F1 with a smaller mean
score drift, and no more images that lose every box. Otherwise the PTQ model stays. The report
keeps both models' figures and says which one was installed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.builder.int8.report import Int8Report
from app.errors import CalibrationError

MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class DistillPlan:
    run: bool
    device: str  # "cuda" | "cpu" | "" when it does not run
    why: str


@dataclass
class DistillOutcome:
    ptq: Int8Report
    distilled: Int8Report
    kept: str  # "distilled" | "ptq"
    training: dict  # DistillResult.to_json()

    def to_json(self) -> dict:
        return {"kept": self.kept, "ptq": _figures(self.ptq), "distilled": _figures(self.distilled),
                "training": self.training}


def plan(mode: str, calibration_images: int) -> DistillPlan:
    """What ``--distill mode`` does on this machine with ``calibration_images`` to train on."""
    from app.builder.int8.distill import MIN_IMAGES

    if mode not in MODES:
        raise CalibrationError(f"unknown --distill {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "off":
        return DistillPlan(False, "", "off (--distill off)")
    import torch

    gpu = torch.cuda.is_available()
    if mode == "auto" and not gpu:
        return DistillPlan(False, "", "off: no CUDA GPU (--distill on runs it on the CPU, slowly)")
    if calibration_images < MIN_IMAGES:
        if mode == "on":
            raise CalibrationError(f"distillation needs at least {MIN_IMAGES} calibration images; "
                                   f"{calibration_images} are left besides the held-out ones",
                                   hint="add images like the ones you serve, or pass --distill off")
        return DistillPlan(False, "", f"off: {calibration_images} calibration images, fewer than {MIN_IMAGES}")
    device = "cuda" if gpu else "cpu"
    return DistillPlan(True, device, f"on ({'auto: ' if mode == 'auto' else ''}{device})")


def better(distilled: Int8Report, ptq: Int8Report) -> bool:
    """Whether the distilled model agrees better with FP32 than the PTQ one (ties keep PTQ)."""
    if len(distilled.lost_all) > len(ptq.lost_all):
        return False
    if round(distilled.f1, 6) != round(ptq.f1, 6):
        return distilled.f1 > ptq.f1
    return distilled.mean_score_drift < ptq.mean_score_drift


def distill_and_keep_better(paths: dict[str, Path], fp32_model, train: Sequence[np.ndarray], reports: dict[str, Int8Report],
                            evaluate: Callable[[str, Path], Int8Report], settings, console=None, *,
                            required: bool = False) -> dict[str, DistillOutcome]:
    """Distil each staged model (``{target: path}``, the time limit shared evenly) and keep, in
    ``paths``, whichever of it and the PTQ model ``reports`` scored agrees better with FP32;
    ``reports`` is updated to the kept model's figures. A model distillation cannot run (an ONNX op
    it lacks) keeps its PTQ weights with a warning, or raises when ``required`` (``--distill on``)."""
    import dataclasses

    import onnx

    from app.builder.int8.distill import distill, float_weights

    share = dataclasses.replace(settings, time_limit_s=settings.time_limit_s / len(paths)
                                if settings.time_limit_s else None)
    weights = float_weights(fp32_model)
    outcomes = {}
    for target, path in paths.items():
        t0 = time.perf_counter()
        try:
            trained, result = distill(onnx.load(str(path)), fp32_model, train, share, console=console, label=target,
                                      fp32_weights=weights)
        except CalibrationError as e:
            if required:
                raise
            if console is not None:
                console.print(f"[bold yellow]warning:[/bold yellow] {target} model not distilled: {e}", highlight=False)
            continue
        keep, scored = False, reports[target]
        if result.kept_step > 0:  # else no check beat the start: the PTQ weights, bit for bit
            candidate = path.with_name(path.name + ".distilled")
            onnx.save(trained, str(candidate))
            scored = evaluate(target, candidate)
            keep = better(scored, reports[target])
            if keep:
                candidate.replace(path)
            else:
                candidate.unlink()
        del trained
        outcomes[target] = DistillOutcome(ptq=reports[target], distilled=scored, kept="distilled" if keep else "ptq",
                                          training={**result.to_json(), "wall_s": round(time.perf_counter() - t0, 2)})
        if keep:
            reports[target] = scored
        if console is not None:
            console.print(f"{target} model: distilled {result.steps} steps in {result.seconds:.0f} s "
                          f"({result.stopped_by}, kept step {result.kept_step}); held-out F1 {scored.f1:.3f} against "
                          f"PTQ's {outcomes[target].ptq.f1:.3f}: installing the "
                          f"{'distilled' if keep else 'PTQ'} model", highlight=False)
    return outcomes


def _figures(report: Int8Report) -> dict:
    return {"f1": round(report.f1, 4), "f1_ci95": [round(v, 4) for v in report.f1_ci95],
            "f1_conf01": round(report.f1_conf01, 4), "map50": report.map50,
            "mean_score_drift": round(report.mean_score_drift, 5), "int8_boxes": report.int8_boxes,
            "lost_all": list(report.lost_all)}

"""``calibrate``'s distillation step (``app/builder/int8/distill_plan.py``): when it runs, and which model it keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.builder.int8.distill import MIN_IMAGES
from app.builder.int8.distill_plan import better, plan
from app.builder.int8.report import Int8Report
from app.errors import CalibrationError


def report(f1: float, drift: float, lost: int = 0) -> Int8Report:
    return Int8Report(int8_model="m", images=10, fp32_boxes=100, int8_boxes=100, matched=int(100 * f1), precision=f1,
                      recall=f1, f1=f1, f1_ci95=(f1 - 0.01, f1 + 0.01), f1_conf01=f1, fp32_boxes_conf01=120, map50=None,
                      mean_iou=0.9, mean_score_drift=drift, max_score_drift=drift * 4,
                      lost_all=[f"img{k}" for k in range(lost)])


def test_the_distilled_model_is_kept_only_when_it_agrees_better():
    ptq = report(0.95, 0.02)
    assert better(report(0.96, 0.03), ptq)  # a higher F1 wins, whatever the drift
    assert not better(report(0.94, 0.01), ptq)
    assert better(report(0.95, 0.01), ptq)  # the same F1: the smaller drift
    assert not better(report(0.95, 0.02), ptq)  # a tie keeps PTQ
    assert not better(report(0.99, 0.01, lost=1), ptq)  # an image that lost every box more: never


def test_auto_runs_on_a_cuda_gpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan("auto", 100) == dataclasses.replace(plan("auto", 100), run=False)
    assert "no CUDA GPU" in plan("auto", 100).why
    assert plan("on", 100).run and plan("on", 100).device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plan("auto", 100).run and plan("auto", 100).device == "cuda"
    assert not plan("auto", MIN_IMAGES - 1).run  # too few to train on: auto passes, with the reason
    assert f"fewer than {MIN_IMAGES}" in plan("auto", MIN_IMAGES - 1).why
    assert not plan("off", 100).run


def test_on_with_too_few_images_or_an_unknown_mode_is_refused():
    with pytest.raises(CalibrationError, match=f"at least {MIN_IMAGES} calibration images; 5 are left"):
        plan("on", 5)
    with pytest.raises(CalibrationError, match="unknown --distill 'maybe'"):
        plan("maybe", 100)

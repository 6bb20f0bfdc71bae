"""Quantization-aware distillation: fine-tune a written Q/DQ model against its FP32 model's own outputs.

No labels: the teacher is the FP32 model, so the user's unlabeled calibration images suffice.
The student is the Q/DQ model itself run in torch (``torchgraph.py``: the fake quantization is
the model's own Q/DQ nodes, with the PTQ scales, zero points and shifts); its Conv weights and
biases are trained, the scales stay as calibrated. Then the learned values are written back into
the same ONNX model, which is scored by the report like any other.

* **Outputs compared**: the head's last Convs, before the tail (``graph.head_output_convs``): for
  each pyramid level the class logits and the box distributions (DFL: 4 sides × ``reg_max`` bins).
  They run at any input size, so a step can train on crops.
* **Loss**: the class scores' Bernoulli KL divergence from the teacher's (binary cross-entropy
  with the teacher's sigmoid as the target, less the teacher's own entropy: 0 when they agree),
  over all anchors and classes, divided by the teacher's total score; plus the squared error of
  the decoded box sides (the DFL expectation, in grid cells) weighted by the teacher's best class
  score per anchor, divided by the weights' sum. Scores near the threshold are what flips boxes.
* **Data**: the calibration images (letterboxed as for calibration), each step a batch with a
  random horizontal flip, brightness/contrast change, at times grayscale, and (``crop`` below the
  image size) a random crop: the teacher answers for any image, so augmenting is free and keeps
  the student from fitting only the few images it sees.
* **Schedule**: Adam, each tensor's rate ``lr`` times its mean magnitude (folded BatchNorms leave
  layers' weights orders of magnitude apart), a linear warm-up over the first 5 %, then cosine
  decay over the run's progress: the larger of steps done
  over ``steps`` and time spent over ``time_limit_s``, so a time-limited run still ends its
  schedule. Weights are kept within ±127 quantization steps after every update.
* **Checks**: the loss on a few training images (unaugmented) is measured 10 times over the run;
  the best weights are kept, and a check well above the best goes back to them at half the rate.
  A rate too high for a model then costs time, not the PTQ model's accuracy.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from dataclasses import replace as dataclasses_replace

import numpy as np

from app.builder.int8 import graph
from app.builder.int8.distill_batches import TrainingBatches
from app.errors import CalibrationError

MIN_IMAGES = 16  # distillation on fewer overfits them: refused with this number named
EVAL_IMAGES = 8  # training images (unaugmented) whose loss is checked over the run; half on the CPU
WARMUP = 0.05  # the share of the run over which the rate rises from 0
CHECKS = 10  # the eval images' loss is measured this many times over a run (4 on the CPU, where it is dear)
BACKOFF = 1.25  # a check this far above the best: back to the best weights at half the rate


@dataclass
class DistillSettings:
    steps: int = 3000
    batch: int | None = None  # None: 16 on a GPU, 4 on the CPU
    crop: int | None = None  # random crops of this side (a multiple of 32); None: whole images on a GPU, half on the CPU
    lr: float = 1e-4  # Adam's step relative to each tensor's mean magnitude (1e-3 diverged on the sample model)
    time_limit_s: float | None = 240.0  # both models of ``calibrate`` share it (the CLI's --distill-minutes)
    device: str = "auto"  # auto: CUDA when torch sees a GPU, else the CPU
    augment: bool = True
    seed: int = 0

    def for_device(self, device: str, imgsz: int) -> DistillSettings:
        """The batch and crop left open, chosen for ``device``: a CPU step on whole 640 images
        of a batch of 16 takes minutes, so there it learns from quarter-size crops of 4."""
        gpu = device != "cpu"
        batch = self.batch or (16 if gpu else 4)
        crop = self.crop or (None if gpu else max(32, imgsz // 2 // 32 * 32))
        return dataclasses_replace(self, batch=batch, crop=crop, device=device)


@dataclass
class DistillResult:
    device: str
    steps: int
    seconds: float
    stopped_by: str  # "steps" | "time limit"
    images: int
    batch: int
    crop: int
    eval_loss_before: float  # the loss on EVAL_IMAGES training images (centres at the crop), before and after
    eval_loss_after: float
    train_loss: list[float] = field(default_factory=list)  # mean per tenth of the run
    checks: list = field(default_factory=list)  # [step, eval loss] over the run
    kept_step: int = 0  # the step whose weights were kept (the best eval loss)
    backoffs: int = 0  # times the rate was halved after a check went up

    def to_json(self) -> dict:
        out = {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["train_loss"] = [round(v, 6) for v in self.train_loss]
        out["checks"] = [[int(step), round(loss, 6)] for step, loss in self.checks]
        return out


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        from app.errors import DeviceError

        raise DeviceError("distillation asked for a CUDA GPU and torch sees none")
    return device


def head_pairs(fp32_model, tail: list[str] | None = None) -> list[tuple[str, str]]:
    """``(box distributions, class logits)`` output tensors per pyramid level, from the head's last
    Convs: a Conv whose output reaches the tail's Softmax (DFL) is a box one, one that reaches a
    Sigmoid a class one; levels pair up in the graph's order of each kind. ``tail``: the head
    tail's nodes, when the caller has them (``graph.head_tail_nodes`` runs shape inference)."""
    tail = graph.head_tail_nodes(fp32_model) if tail is None else tail
    convs = graph.head_output_convs(fp32_model, tail)
    nodes = {n.name: n for n in fp32_model.graph.node}
    consumers: dict[str, list] = {}
    for n in fp32_model.graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    boxes, classes = [], []
    for name in convs:
        out = nodes[name].output[0]
        pending, seen, kind = [out], set(), None
        while pending and kind is None:
            tensor = pending.pop(0)
            for c in consumers.get(tensor, []):
                if c.op_type in ("Softmax", "Sigmoid"):
                    kind = c.op_type
                    break
                if c.name not in seen:
                    seen.add(c.name)
                    pending.extend(c.output)
        (boxes if kind == "Softmax" else classes if kind == "Sigmoid" else []).append(out)
    if not boxes or len(boxes) != len(classes):
        raise CalibrationError("distillation cannot find the detection head's box and class outputs in this model")
    return list(zip(boxes, classes))


def distill_loss(student: Sequence, teacher: Sequence, levels: int):
    """The loss of the module docstring; ``student``/``teacher``: [box, cls] × levels, in order."""
    import torch
    import torch.nn.functional as F

    kl, box, mass, weights = 0.0, 0.0, 0.0, 0.0
    for k in range(levels):
        sb, sc, tb, tc = student[2 * k], student[2 * k + 1], teacher[2 * k], teacher[2 * k + 1]
        target = torch.sigmoid(tc)
        kl = kl + (F.binary_cross_entropy_with_logits(sc, target, reduction="sum")
                   - F.binary_cross_entropy_with_logits(tc, target, reduction="sum"))
        mass = mass + target.sum()
        n, c, h, w = sb.shape
        bins = torch.arange(c // 4, device=sb.device, dtype=sb.dtype).view(1, 1, -1, 1, 1)
        ds = (sb.view(n, 4, c // 4, h, w).softmax(2) * bins).sum(2)
        dt = (tb.view(n, 4, c // 4, h, w).softmax(2) * bins).sum(2)
        weight = target.amax(1, keepdim=True)
        box = box + (weight * (ds - dt) ** 2).sum()
        weights = weights + weight.sum()
    return kl / mass.clamp(min=1.0) + box / weights.clamp(min=1e-6)


def eval_images(count: int, device: str) -> list[int]:
    """The training images whose loss the checks measure (unaugmented, centred at the crop): spread
    evenly, ``EVAL_IMAGES`` of them, half on the CPU, where each costs seconds."""
    wanted = EVAL_IMAGES if device != "cpu" else EVAL_IMAGES // 2
    return sorted({int(i) for i in np.linspace(0, count - 1, min(wanted, count))})


def _check_crop(crop: int | None, imgsz: int) -> None:
    if crop is not None and (crop % 32 or not 32 <= crop <= imgsz):
        raise CalibrationError(f"the distillation crop must be a multiple of 32 up to {imgsz}, got {crop}")


def distill(qdq_model, fp32_model, images: Sequence[np.ndarray], settings: DistillSettings | None = None, *,
            console=None, label: str = "model", fp32_weights: dict | None = None):
    """Fine-tune ``qdq_model`` (an ONNX Q/DQ model) against ``fp32_model`` on ``images``
    (letterboxed BGR uint8); returns the model with the learned weights and a ``DistillResult``."""
    import torch

    from app.builder.int8.torchgraph import QdqGraph

    settings = settings or DistillSettings()
    if len(images) < MIN_IMAGES:
        raise CalibrationError(f"distillation needs at least {MIN_IMAGES} calibration images, "
                               f"{len(images)} were given", hint="add images like the ones you serve, or pass --distill off")
    imgsz = int(images[0].shape[0])
    device = resolve_device(settings.device)
    settings = settings.for_device(device, imgsz)
    _check_crop(settings.crop, imgsz)
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)  # every core, unless told
    else:
        torch.backends.cudnn.benchmark = True  # fixed shapes: the fastest kernels, found once
        # FP32 convolutions, not TF32: the student's roundings are then those of the file run in FP32.
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(settings.seed)
    tail = graph.head_tail_nodes(fp32_model)
    pairs = head_pairs(fp32_model, tail)
    outputs = [name for pair in pairs for name in pair]
    trainable = [n.name for n in qdq_model.graph.node if n.op_type == "Conv" and n.name not in set(tail)]
    teacher = QdqGraph(fp32_model, outputs, device=device)
    student = QdqGraph(qdq_model, outputs, trainable=trainable, init_weights=fp32_weights or float_weights(fp32_model),
                       device=device)
    student.clip_weights()
    batches = TrainingBatches(images, settings, device, imgsz)
    eval_picks = eval_images(len(images), device)

    def eval_loss() -> float:
        with torch.no_grad():
            total = 0.0
            for k in eval_picks:
                x = batches.centre([k])
                total += float(distill_loss(student(x), teacher(x), len(pairs)))
            return total / len(eval_picks)

    before = eval_loss()
    loop = _Loop(student, teacher, batches, settings, len(pairs), eval_loss, before)
    progress = _Progress(console, f"distilling ({label})", settings.steps)
    try:
        loop.run(progress, label)
    finally:
        progress.close()
    after = loop.finish()
    losses = loop.losses
    tenths = [float(np.mean(chunk)) for chunk in np.array_split(np.array(losses), min(10, len(losses))) if len(chunk)]
    result = DistillResult(device=device, steps=loop.step, seconds=loop.seconds, stopped_by=loop.stopped_by,
                           images=len(images), batch=settings.batch, crop=batches.crop, eval_loss_before=before,
                           eval_loss_after=after, train_loss=tenths, checks=loop.checks, kept_step=loop.best_step,
                           backoffs=loop.backoffs)
    return student.write_back(), result


class _Loop:
    """The training steps, with the loss on the eval images measured ``CHECKS`` times over the run:
    the best weights seen are kept (restored at the end), and a check ``BACKOFF`` times above the
    best goes back to them at half the rate (Adam restarted), so a rate too high for a model costs
    time, not the PTQ model's accuracy."""

    def __init__(self, student, teacher, batches, settings: DistillSettings, levels: int, eval_loss, before: float):
        import torch

        self.torch, self.student, self.teacher, self.batches = torch, student, teacher, batches
        self.settings, self.levels, self.eval_loss = settings, levels, eval_loss
        # Each tensor's rate relative to its own magnitude: a folded BatchNorm leaves the layers'
        # weights orders of magnitude apart, and one absolute rate moves some by many rounding steps.
        self.groups = [{"params": [p], "scale": max(float(p.detach().abs().mean()), 1e-8)}
                       for p in student.parameters()]
        self.optimizer = torch.optim.Adam(self.groups, lr=settings.lr)
        self.best, self.best_step, self.best_state = before, 0, self._snapshot()
        self.checks: list[list[float]] = [[0, before]]
        self.losses: list[float] = []
        self.step, self.backoffs, self.rate_scale = 0, 0, 1.0
        self.checks_per_run = CHECKS if settings.device != "cpu" else 4
        self.stopped_by, self.seconds = "steps", 0.0

    def _snapshot(self) -> list:
        return [p.detach().clone() for p in self.student.parameters()]

    def _restore(self) -> None:
        with self.torch.no_grad():
            for p, saved in zip(self.student.parameters(), self.best_state):
                p.copy_(saved)

    def check(self) -> None:
        loss = self.eval_loss()
        self.checks.append([self.step, loss])
        if loss < self.best:
            self.best, self.best_step, self.best_state = loss, self.step, self._snapshot()
        elif loss > BACKOFF * self.best:
            self._restore()
            self.rate_scale *= 0.5
            self.backoffs += 1
            self.optimizer = self.torch.optim.Adam(self.groups, lr=self.settings.lr)

    def run(self, progress, label: str) -> None:
        settings, limit = self.settings, self.settings.time_limit_s
        t0 = time.perf_counter()
        checks = self.checks_per_run
        next_check, said = 1.0 / checks, False
        while True:
            done = max(self.step / settings.steps, (time.perf_counter() - t0) / limit if limit else 0.0)
            if done >= next_check:
                self.check()
                next_check = (math.floor(done * checks) + 1) / checks
            if done >= 1.0:
                self.stopped_by = "time limit" if self.step < settings.steps else "steps"
                break
            at = max(done, (self.step + 1) / settings.steps)
            rate = self.rate_scale * settings.lr * min(1.0, at / WARMUP) * 0.5 * (1.0 + math.cos(math.pi * at))
            for group in self.optimizer.param_groups:
                group["lr"] = rate * group["scale"]
            x = self.batches.next()
            with self.torch.no_grad():
                target = self.teacher(x)
            loss = distill_loss(self.student(x), target, self.levels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.student.clip_weights()
            self.losses.append(float(loss.detach()))
            self.step += 1
            if self.step == min(10, settings.steps) and not said:  # past the first steps (cuDNN tunes the first): how long
                per_step = (time.perf_counter() - t0) / self.step
                expected = min(settings.steps * per_step, limit or math.inf)
                progress.total = max(self.step, min(settings.steps, int(expected / per_step)))
                progress.say(f"{label} model: {progress.total} distillation steps of {self.batches.crop}-pixel "
                             f"batches of {settings.batch} on {settings.device}, about {expected / 60:.1f} min"
                             + (f" (time limit {limit / 60:.1f} min)" if limit else ""))
                said = True
            progress.advance(self.step)
        self.seconds = time.perf_counter() - t0

    def finish(self) -> float:
        """Restore the best weights seen; their eval loss."""
        if self.checks[-1][1] > self.best:
            self._restore()
        return self.best


def float_weights(fp32_model) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """Every Conv's FP32 weight and bias by node name (the quantized models keep the node names)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in fp32_model.graph.initializer}
    out = {}
    for node in fp32_model.graph.node:
        if node.op_type == "Conv" and node.input[1] in inits:
            bias = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] in inits else None
            out[node.name] = (numpy_helper.to_array(inits[node.input[1]]), bias)
    return out


class _Progress:
    """A progress bar with a time estimate (rich), or nothing without a console."""

    def __init__(self, console, label: str, total: int) -> None:
        self.total, self._bar, self._task = total, None, None
        if console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 console=console, transient=False)
            self._bar.start()
            self._task = self._bar.add_task(label, total=total)

    def say(self, message: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)
            self._bar.console.print(message, highlight=False)

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=min(step, self.total))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

"""Quantization-aware distillation on small real YOLOv8 exports: the loss, the head it reads, what a
training run of the sample model (at 128 pixels, on real photos) guarantees, and the images it refuses."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from app.builder.int8.distill import MIN_IMAGES, DistillSettings, distill, distill_loss, eval_images, head_pairs
from app.builder.int8.torchgraph import QdqGraph
from app.errors import CalibrationError
from app.imaging.letterbox import to_input
from tests.int8_models import IMGSZ, SAMPLE_IMGSZ, photos, qdq_models, tiny_export


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    fp32_path = tiny_export(root / "artifacts")
    return onnx.load(str(fp32_path)), qdq_models(fp32_path, root)


@pytest.fixture(scope="module")
def sample(tmp_path_factory, assets_dir):
    """The sample model at 128 pixels, calibrated on 8 views of the two photos; 20 others to train on."""
    root = tmp_path_factory.mktemp("sample128")
    fp32_path = tiny_export(root / "artifacts", "sample", SAMPLE_IMGSZ)
    views = photos(assets_dir, SAMPLE_IMGSZ, 28)
    return onnx.load(str(fp32_path)), qdq_models(fp32_path, root, [to_input([v]) for v in views[:8]]), views[8:]


def images(count: int, seed: int = 0) -> list[np.ndarray]:
    """Letterboxed-size BGR images with shapes in them (blobs on a grey pad, like a letterbox)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        img = np.full((IMGSZ, IMGSZ, 3), 114, np.uint8)
        for _ in range(3):
            y, x = rng.integers(0, IMGSZ - 16, 2)
            h, w = rng.integers(8, 24, 2)
            img[y : y + h, x : x + w] = rng.integers(0, 256, 3)
        out.append(img + rng.integers(0, 20, img.shape, dtype=np.uint8))
    return out


def test_the_head_pairs_are_the_box_and_class_convs_of_each_level(tiny):
    fp32, _ = tiny
    pairs = head_pairs(fp32)
    assert len(pairs) == 3
    for box, cls in pairs:
        assert "/cv2." in box and "/cv3." in cls  # Ultralytics' names: cv2 boxes, cv3 classes
        assert box.split("/")[2][-1] == cls.split("/")[2][-1]  # the same level


def test_the_loss_is_zero_for_the_teacher_and_grows_with_the_difference(tiny):
    fp32, _ = tiny
    outputs = [name for pair in head_pairs(fp32) for name in pair]
    x = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        teacher = QdqGraph(fp32, outputs)(x)
    assert float(distill_loss(teacher, teacher, 3)) == pytest.approx(0.0, abs=1e-5)
    losses = [float(distill_loss([t + e * torch.randn_like(t) for t in teacher], teacher, 3)) for e in (0.1, 0.5)]
    assert 0 < losses[0] < losses[1]


STEPS = 12


def torch_loss(model, fp32, x: np.ndarray) -> float:
    """The distillation loss of ``model``'s head against FP32's, the file run afresh in torch as
    the checks run the student (one image at a time); ``test_torchgraph`` holds that ONNX Runtime
    runs each node of it alike."""
    outputs = [name for pair in head_pairs(fp32) for name in pair]
    student, teacher = QdqGraph(model, outputs), QdqGraph(fp32, outputs)
    with torch.no_grad():
        return float(np.mean([float(distill_loss(student(torch.from_numpy(x[k : k + 1])),
                                                 teacher(torch.from_numpy(x[k : k + 1])), len(outputs) // 2))
                              for k in range(len(x))]))


def conv_initializers(model) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    names = {name for n in model.graph.node if n.op_type == "Conv" for name in n.input[1:]}
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in names or
            i.name.endswith(("_quantized", "weight", "bias"))}


@pytest.mark.parametrize("target", ["cpu", "tensorrt"])
def test_the_kept_weights_are_the_best_check_and_the_written_file_runs_them(sample, target):
    """What the method guarantees, whichever way a run goes: the weights kept are those of the best
    check seen (the PTQ weights, step 0, are the first check), and the written file, run afresh,
    gives that check's loss: it holds what was trained, not what was rounded or dropped on the way
    out. The PTQ file run the same way gives the first check's loss."""
    fp32, models, train = sample
    trained, result = distill(models[target], fp32, train, DistillSettings(
        steps=STEPS, batch=4, crop=SAMPLE_IMGSZ, lr=1e-4, device="cpu", augment=False, time_limit_s=None))
    assert result.steps == STEPS and result.stopped_by == "steps" and result.device == "cpu"
    assert result.eval_loss_before > 1e-3  # real scores to learn from
    assert result.checks[0] == [0, result.eval_loss_before] and len(result.checks) >= 3
    best = min(loss for _, loss in result.checks)
    assert result.eval_loss_after == best <= result.eval_loss_before
    assert [result.kept_step, best] in result.checks  # the kept step is the check that scored it
    x = to_input([train[k] for k in eval_images(len(train), "cpu")])
    assert torch_loss(trained, fp32, x) == pytest.approx(best, rel=1e-5)
    assert torch_loss(models[target], fp32, x) == pytest.approx(result.eval_loss_before, rel=1e-5)
    before, after = conv_initializers(models[target]), conv_initializers(trained)
    changed = [name for name in before if not np.array_equal(before[name], after[name])]
    if result.kept_step == 0:  # no check beat the start: the PTQ weights, bit for bit
        assert not changed
    else:
        assert changed


def test_a_time_limit_ends_the_run_and_says_so(tiny):
    fp32, models = tiny
    _, result = distill(models["tensorrt"], fp32, images(16),
                        DistillSettings(steps=10**6, batch=2, crop=IMGSZ, time_limit_s=3.0, device="cpu"))
    # No wall-clock bound here: on a loaded CPU one step and the loss checks alone outlast 3 s.
    assert result.stopped_by == "time limit" and 0 < result.steps < 10**6 and result.seconds >= 3.0


def test_too_few_images_or_a_bad_crop_are_refused_with_the_number(tiny):
    fp32, models = tiny
    with pytest.raises(CalibrationError, match=f"at least {MIN_IMAGES} calibration images, 5 were given"):
        distill(models["cpu"], fp32, images(5))
    with pytest.raises(CalibrationError, match="multiple of 32"):
        distill(models["cpu"], fp32, images(16), DistillSettings(crop=48, device="cpu"))

"""The stem's space-to-depth rewrite (``app.builder.stem_rewrite``) against torch's own
convolution: the same function, exactly in float64, on the real model's head in float32, and
traced by ``torch.export`` with the package's dynamic batch."""

from __future__ import annotations

import pytest
import torch

from app.builder.stem_rewrite import STEM_CHANNELS, fits, rewrite_stem, space_to_depth_stem


@pytest.mark.parametrize("size", [(32, 32), (64, 96), (2, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_it_is_the_same_convolution(size, bias):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=bias).double()
    x = torch.randn(3, 3, *size, dtype=torch.float64)
    stem = space_to_depth_stem(conv)
    got, want = stem(x), conv(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert stem.weight.shape == (8, STEM_CHANNELS, 2, 2)


@pytest.mark.parametrize("conv, imgsz", [
    (torch.nn.Conv2d(3, 8, 3, stride=1, padding=1), 640),   # not strided
    (torch.nn.Conv2d(3, 8, 1, stride=2), 640),              # not 3x3
    (torch.nn.Conv2d(3, 8, 3, stride=2, padding=0), 640),   # unpadded
    (torch.nn.Conv2d(6, 8, 3, stride=2, padding=1), 640),   # 24 channels of space-to-depth: over 16
    (torch.nn.Conv2d(3, 9, 3, stride=2, padding=1, padding_mode="reflect"), 640),
    (torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), 641),   # odd input
])
def test_other_convolutions_are_left_alone(conv, imgsz):
    assert not fits(conv, imgsz)
    assert fits(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), 640)


@pytest.mark.slow
def test_the_rewritten_model_gives_the_same_head_and_exports_with_a_dynamic_batch(traced_sample, export_dynamic):
    model, x, want = traced_sample
    assert rewrite_stem(model, 320)
    assert not rewrite_stem(model, 320)  # the rewritten stem is no longer a 3x3 stride-2 convolution
    with torch.inference_mode():
        got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # boxes in pixels; summed in another order
    program = export_dynamic(model, x)
    convs = [n for n in program.graph.nodes if n.op == "call_function" and "conv2d" in str(n.target)]
    assert convs[0].args[0].meta["val"].shape[1] == STEM_CHANNELS
    with torch.inference_mode():
        torch.testing.assert_close(program.module()(x[:1]), want[:1], rtol=1e-4, atol=1e-3)

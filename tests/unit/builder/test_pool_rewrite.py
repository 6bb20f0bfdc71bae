"""SPPF's max pools rewritten as separable maxima (``app.builder.pool_rewrite``) against torch's
own ``max_pool2d``: the same bits in every float dtype (minus infinity and NaN included), other
pools left alone, and on the real model the same head, traced by ``torch.export`` with the
package's dynamic batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.builder.pool_rewrite import fits, rewrite_pools, separable_max_pool


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
@pytest.mark.parametrize("size", [(1, 1), (2, 9), (11, 13), (20, 20)])
def test_it_is_the_same_pool_bit_for_bit(dtype, kernel, size):
    g = torch.Generator().manual_seed(kernel * 100 + size[0])
    x = torch.randn(2, 3, *size, generator=g).to(dtype)
    x[0, 0].view(-1)[0] = float("-inf")
    x[1, 2].view(-1)[-1] = float("nan")
    x[1, 1].fill_(float("-inf"))  # a plane of -inf: its maxima are -inf, not the padding's anything
    want = F.max_pool2d(x, kernel, stride=1, padding=kernel // 2)
    got = separable_max_pool(kernel)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5))


@pytest.mark.parametrize("pool", [
    torch.nn.MaxPool2d(5, stride=2, padding=2),             # strided
    torch.nn.MaxPool2d(5, stride=1, padding=1),             # not half the window
    torch.nn.MaxPool2d(4, stride=1, padding=2),             # even window
    torch.nn.MaxPool2d((5, 3), stride=1, padding=(2, 1)),   # not square
    torch.nn.MaxPool2d(5, stride=1, padding=2, dilation=2),
    torch.nn.MaxPool2d(5, stride=1, padding=2, ceil_mode=True),
    torch.nn.MaxPool2d(5, stride=1, padding=2, return_indices=True),
    torch.nn.AvgPool2d(5, stride=1, padding=2),
])
def test_other_pools_are_left_alone(pool):
    assert not fits(pool)
    model = torch.nn.Sequential(pool)
    assert rewrite_pools(model) == 0 and model[0] is pool
    assert fits(torch.nn.MaxPool2d(5, stride=1, padding=2)) and fits(torch.nn.MaxPool2d((3, 3), 1, (1, 1)))


@pytest.mark.slow
def test_the_rewritten_model_gives_the_same_head_and_exports_with_a_dynamic_batch(traced_sample, export_dynamic):
    model, x, want = traced_sample
    assert rewrite_pools(model) == 1  # YOLOv8's one SPPF block, its pool applied three times
    assert rewrite_pools(model) == 0
    with torch.inference_mode():
        got = model(x)
    assert torch.equal(got, want)  # maxima are exact: the same bits
    program = export_dynamic(model, x)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("max_pool" in t for t in targets) and any("maximum" in t for t in targets)
    with torch.inference_mode():
        torch.testing.assert_close(program.module()(x[:1]), want[:1], rtol=1e-4, atol=1e-3)  # another batch: other sums

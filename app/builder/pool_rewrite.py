"""SPPF's max pools of a batch-invariant build, rewritten as separable maxima (build time only):
the same maximum of the same values, as pointwise kernels instead of inductor's window reduction.

YOLOv8's SPPF block pools its input three times in a row with a 5x5 window (stride 1, padding 2).
Inductor lowers ``max_pool2d`` as a persistent reduction over the window: on the H100, at batch
64, its three pools took 0.93 ms of the batch's 10.0 ms, against a few microseconds of memory
traffic each (bench/results/2026-12-07-nvidia-h100-stem-rewrite-kernel-ab.json). Rewritten, the
batch's device time fell from 9.96 to 9.48 ms, its reductions from 0.69 to 0.06 ms, with the same
bits (bench/results/2026-12-07-nvidia-h100-pools-fusion-kernel-ab.json). A window's
maximum is the maximum over its rows of each row's maximum, so the pool is ``k`` shifted maxima
along the width, then ``k`` along the height, each over the input padded with minus infinity
(what ``max_pool2d``'s padding means). Maxima are exact in every dtype and propagate NaN as
``max_pool2d`` does: the rewritten pool gives the same bits.
"""

from __future__ import annotations

from typing import Any


def separable_max_pool(kernel: int) -> Any:
    """A module computing ``nn.MaxPool2d(kernel, stride=1, padding=kernel // 2)`` (odd ``kernel``)
    as shifted maxima, as described in the module docstring."""
    import torch
    import torch.nn.functional as F

    class SeparableMaxPool(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kernel = kernel

        def forward(self, x: Any) -> Any:
            k, pad = self.kernel, self.kernel // 2
            h, w = x.shape[-2:]
            padded = F.pad(x, (pad, pad, 0, 0), value=float("-inf"))
            rows = padded[..., 0:w]
            for i in range(1, k):
                rows = torch.maximum(rows, padded[..., i:i + w])
            padded = F.pad(rows, (0, 0, pad, pad), value=float("-inf"))
            out = padded[..., 0:h, :]
            for i in range(1, k):
                out = torch.maximum(out, padded[..., i:i + h, :])
            return out

    return SeparableMaxPool()


def fits(pool: Any) -> bool:
    """Whether ``pool`` is a max pool this rewrite computes exactly: square, odd, stride 1,
    padding half the window, no dilation, floor mode, no indices."""
    import torch

    if not isinstance(pool, torch.nn.MaxPool2d):
        return False

    def pair(v: Any) -> tuple:
        return tuple(v) if isinstance(v, (tuple, list)) else (v, v)

    k = pair(pool.kernel_size)
    return (k[0] == k[1] and k[0] % 2 == 1 and pair(pool.stride) == (1, 1) and pair(pool.padding) == (k[0] // 2,) * 2
            and pair(pool.dilation) == (1, 1) and not pool.ceil_mode and not pool.return_indices)


def rewrite_pools(model: Any) -> int:
    """Replace, in place, every max pool of the model that ``fits``; how many it replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if fits(child):
                k = child.kernel_size
                setattr(module, name, separable_max_pool(k if isinstance(k, int) else k[0]))
                replaced += 1
    return replaced

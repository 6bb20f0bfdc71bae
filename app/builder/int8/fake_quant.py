"""The fake quantization a Q/DQ model's nodes compute, differentiable (``torchgraph.py``): the
straight-through rounding, QuantizeLinear's integers as floats, per-channel parameters broadcast."""

from __future__ import annotations


def round_ste(x):
    """Round half to even forwards, identity backwards."""
    return x + (x.round() - x).detach()


def fake_int(x, scale, zero, lo: float, hi: float):
    """QuantizeLinear's integers (as floats): ``clamp(round(x / scale) + zero, lo, hi)``."""
    import torch

    return torch.clamp(round_ste(x / scale) + zero, lo, hi)


def per_axis(value, axis: int, ndim: int):
    """A per-channel scale or zero point shaped to broadcast along ``axis`` of an ``ndim`` tensor."""
    if value.ndim == 0:
        return value
    shape = [1] * ndim
    shape[axis % ndim] = value.shape[0]
    return value.reshape(shape)

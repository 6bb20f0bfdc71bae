"""The stem convolution of a batch-invariant build, rewritten for inductor's Triton template
(build time only): the same sum of the same products, laid out so that the template's loads and
matrix-multiply steps are full.

YOLOv8's first layer convolves the 3-channel image (3x3, stride 2). Inductor's convolution
template loops over the kernel's 9 positions and, at each, over the input channels in steps of at
least 16: 3 of 16 lanes useful, each pixel 6 bytes apart. On the H100 it was the graph's slowest
template at batch 64, 0.69 ms of the batch's 10.3; rewritten, the stem takes 0.59 ms with its
copy, and the package runs 1.048x as many images a second at batch 64, 1.039x at 16, 1.010x at 1
(bench/results/2026-12-07-nvidia-h100-stem-rewrite-kernel-ab.json).

A 3x3 stride-2 convolution with padding 1 equals a 2x2 stride-1 convolution, unpadded, of the
padded image's space-to-depth by 2 (each 2x2 block of pixels one pixel of 4 x 3 channels), its
kernel the 3x3 one padded to 4x4 with zeros and rearranged the same way: y[i, j] sums
w[u, v] x[2i + u - 1, 2j + v - 1] over u, v in 0..2; with u = 2a + p and v = 2b + q that is
w4[2a + p, 2b + q] z[p, q][i + a, j + b]. The channels are padded with zeros to ``STEM_CHANNELS``,
so each pixel is 32 aligned bytes and one template step.
"""

from __future__ import annotations

from typing import Any

STEM_CHANNELS = 16  # 12 channels of space-to-depth, zero-padded to one 16-wide template step


def space_to_depth_stem(conv: Any, channels: int = STEM_CHANNELS) -> Any:
    """A module computing ``conv`` (3x3, stride 2, padding 1, an even input size) as described
    in the module docstring; its weights in ``conv``'s dtype, device and memory format."""
    import torch
    import torch.nn.functional as F

    class SpaceToDepthStem(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = conv.weight.detach()
            out, cin = w.shape[:2]
            w4 = torch.zeros(out, cin, 4, 4, dtype=w.dtype, device=w.device)
            w4[:, :, :3, :3] = w
            # (o, c, a, p, b, q) → (o, c, p, q, a, b): the kernel's (u, v) = (2a + p, 2b + q)
            w2 = w4.view(out, cin, 2, 2, 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(out, 4 * cin, 2, 2)
            w2 = F.pad(w2, (0, 0, 0, 0, 0, channels - 4 * cin))
            self.register_buffer("weight", w2.contiguous(memory_format=torch.channels_last))
            self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().clone())

        def forward(self, x: Any) -> Any:
            b, c, h, w = x.shape
            padded = F.pad(x, (1, 1, 1, 1))  # (h + 2, w + 2): even, so it splits into 2x2 blocks
            z = padded.view(b, c, (h + 2) // 2, 2, (w + 2) // 2, 2).permute(0, 1, 3, 5, 2, 4)
            z = F.pad(z.reshape(b, 4 * c, (h + 2) // 2, (w + 2) // 2), (0, 0, 0, 0, 0, channels - 4 * c))
            return F.conv2d(z.contiguous(memory_format=torch.channels_last), self.weight, self.bias)

    return SpaceToDepthStem()


def fits(conv: Any, imgsz: int, channels: int = STEM_CHANNELS) -> bool:
    """Whether ``conv`` is a stem this rewrite computes exactly."""
    import torch

    return (isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == (3, 3) and conv.stride == (2, 2)
            and conv.padding == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros" and 4 * conv.in_channels <= channels and imgsz % 2 == 0)


def rewrite_stem(model: Any, imgsz: int) -> bool:
    """Replace the Ultralytics model's first convolution in place where it ``fits``; whether it did."""
    layers = getattr(model, "model", None)
    first = layers[0] if layers is not None and len(layers) else None
    conv = getattr(first, "conv", None)
    if conv is None or not fits(conv, imgsz):
        return False
    first.conv = space_to_depth_stem(conv)
    return True

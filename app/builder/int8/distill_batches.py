"""Distillation's training batches (``distill.py``): the calibration images, letterboxed BGR uint8,
on the device as augmented RGB float batches: a random crop, a flip, gain and bias, sometimes gray."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class TrainingBatches:
    """Augmented training batches on the device, from letterboxed BGR uint8 images (``settings``: a
    ``distill.DistillSettings``: batch, crop, augment, seed)."""

    def __init__(self, images: Sequence[np.ndarray], settings: Any, device, imgsz: int) -> None:
        import torch

        self.torch = torch
        self.stack = torch.from_numpy(np.stack(images)).to(device)  # [N, S, S, 3] uint8
        self.settings, self.imgsz = settings, imgsz
        self.crop = settings.crop or imgsz
        self.gen = torch.Generator(device="cpu").manual_seed(settings.seed)
        self.order: list[int] = []

    def _rand(self, *shape):
        return self.torch.rand(*shape, generator=self.gen)

    def whole(self, indices: Sequence[int]):
        # BGR→RGB, NCHW, [0, 1], contiguous as the model input is: a strided view picks other conv
        # kernels, whose last-bit differences flip roundings at Q nodes (the loss moved 27 % at 128 px).
        return (self.stack[list(indices)].flip(-1).permute(0, 3, 1, 2).float() / 255.0).contiguous()

    def centre(self, indices: Sequence[int]):
        """The images' centres at the training crop (whole images when it is the image size)."""
        x, top = self.whole(indices), (self.imgsz - self.crop) // 2
        return x[:, :, top : top + self.crop, top : top + self.crop]

    def next(self):
        torch = self.torch
        n = min(self.settings.batch, len(self.stack))
        if len(self.order) < n:
            self.order += torch.randperm(len(self.stack), generator=self.gen).tolist()
        picks, self.order = self.order[:n], self.order[n:]
        x = self.whole(picks)
        if self.crop < self.imgsz:
            rows = []
            for k in range(n):
                top, left = (int(v * (self.imgsz - self.crop + 1)) for v in self._rand(2))
                rows.append(x[k, :, top : top + self.crop, left : left + self.crop])
            x = torch.stack(rows)
        if not self.settings.augment:
            return x
        flip = self._rand(n) < 0.5
        x = torch.where(flip.to(x.device).view(-1, 1, 1, 1), x.flip(-1), x)
        gain = (0.6 + 0.8 * self._rand(n, 1, 1, 1)).to(x.device)
        bias = (0.2 * self._rand(n, 1, 1, 1) - 0.1).to(x.device)
        x = x * gain + bias
        gray = (self._rand(n) < 0.15).to(x.device).view(-1, 1, 1, 1)
        luma = (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]).expand_as(x)
        return torch.where(gray, luma, x).clamp(0.0, 1.0)

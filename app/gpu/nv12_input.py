"""A GPU pipeline batch of device NV12 frames (``app.contracts.DeviceNv12``, NVDEC's output).

The frames take the place of images in a batch slot's staging (``app.gpu.memory.Staging``)::

    [ image params header | NV12 params | frames: NV12, each at its own pitch ]
      \\___ one H2D copy per batch ___/    \\_ device-to-device, never on the host _/

Each frame is one device-to-device copy of its bytes (rows at the decoder's pitch) on the
pipeline's copy stream, after which the slot's ``decoded`` event is recorded; the bucket's
NV12 graph (``app.gpu.capture``) waits for it, then runs the NV12 letterbox kernel
(``app.gpu.nv12``) into the same engine input as images, and the same engine and NMS. The
params travel in the batch's one H2D copy, as images' do. The frames stay the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.contracts import DeviceNv12
from app.errors import InvalidImage
from app.gpu.memory import align_up
from app.gpu.nv12 import NV12_PARAMS, fill_nv12_params, launch_nv12_letterbox
from app.imaging.letterbox import letterbox_params
from app.imaging.yuv import YuvConstants, swscale_constants
from app.types import Letterbox

FRAME_ALIGN = 256  # start of each frame in the staging: copies of aligned ranges are the fast ones


@dataclass(frozen=True)
class Nv12Layout:
    """Where a frame's bytes are: ``rows`` rows of ``pitch`` bytes (``cols`` of them used)."""

    rows: int
    cols: int
    pitch: int

    @property
    def luma_rows(self) -> int:
        return self.rows * 2 // 3

    @property
    def span(self) -> int:
        """Bytes from the first byte to the last one used (the last row's padding is not copied)."""
        return (self.rows - 1) * self.pitch + self.cols


@dataclass
class Nv12Plan:
    """Batch position ``j`` is ``placed[j]`` = (result index, letterbox, staging offset, layout)."""

    placed: list[tuple[int, Letterbox, int, Nv12Layout]] = field(default_factory=list)
    sources: list[Any] = field(default_factory=list)  # each placed frame's planes tensor
    colours: list[YuvConstants] = field(default_factory=list)  # each placed frame's conversion constants
    host_end: int = 0  # bytes [0, host_end) travel in the H2D copy: both params headers
    end: int = 0  # bytes of the staging buffer in use

    def __len__(self) -> int:
        return len(self.placed)


def params_offset(header_bytes: int) -> int:
    """Where the NV12 params start: right after the image params header."""
    return header_bytes


def frames_offset(header_bytes: int, max_batch: int) -> int:
    return align_up(header_bytes + max_batch * NV12_PARAMS * 8, FRAME_ALIGN)


def staging_for(header_bytes: int, max_batch: int, frames: int, height: int, width: int) -> int:
    """Staging bytes past the image params header (of a slot of ``max_batch``) that a batch of
    ``frames`` frames of a ``height`` x ``width`` picture takes, as NVDEC's frames come
    (``app.gpu.nvdec.NvdecReader.own_copies``: rows without padding, the coded height: the picture's
    rounded up to 16 rows)."""
    rows, cols = -(-height // 16) * 16 * 3 // 2, width + width % 2
    return frames_offset(header_bytes, max_batch) - header_bytes + frames * align_up(rows * cols, FRAME_ALIGN)


def layout_of(frame: DeviceNv12, device: int) -> Nv12Layout:
    """The frame's layout, or ``InvalidImage`` saying what is wrong with it."""
    planes = frame.planes
    if getattr(planes, "dim", None) is None or planes.dim() != 2 or str(planes.dtype) != "torch.uint8":
        raise InvalidImage(f"NV12 planes must be a 2-D uint8 tensor, got {getattr(planes, 'dtype', type(planes))} "
                           f"{tuple(getattr(planes, 'shape', ()))}")
    if not planes.is_cuda or planes.device.index != device:
        raise InvalidImage(f"NV12 planes must be on cuda:{device}, got {planes.device}")
    rows, cols = planes.shape
    layout = Nv12Layout(int(rows), int(cols), int(planes.stride(0)))
    check_layout(layout, frame.height, frame.width, int(planes.stride(1)))
    return layout


def check_layout(layout: Nv12Layout, height: int, width: int, col_stride: int = 1) -> None:
    """The picture fits: a Y plane of ``rows * 2 / 3`` rows holds it, and its UV plane holds a
    sample pair for every two columns (``width`` rounded up to even)."""
    if col_stride != 1 or layout.pitch < layout.cols:
        raise InvalidImage(f"NV12 rows must be contiguous (pitch {layout.pitch}, column stride {col_stride})")
    if layout.rows % 3 or layout.rows == 0:
        raise InvalidImage(f"NV12 planes need rows = 3/2 x luma rows, got {layout.rows}")
    if not (0 < height <= layout.luma_rows and 0 < width and width + width % 2 <= layout.cols):
        raise InvalidImage(f"a {width}x{height} picture does not fit NV12 planes of {layout.cols}x{layout.rows}")


def checked_frames(images: Sequence[Any], device: int, results: list[Any]) -> list[tuple[int, DeviceNv12, Nv12Layout]]:
    """``(index, frame, layout)`` of the valid device frames; anything else gets its error in ``results``."""
    frames = []
    for i, value in enumerate(images):
        if not isinstance(value, DeviceNv12):
            results[i] = InvalidImage("a batch of device NV12 frames holds nothing else (no images, no JPEG)")
            continue
        try:
            frames.append((i, value, layout_of(value, device)))
        except InvalidImage as exc:
            results[i] = exc
    return frames


def plan_nv12(header_bytes: int, max_batch: int, size: int,
              frames: list[tuple[int, Any, Nv12Layout, int, int, YuvConstants]]) -> Nv12Plan:
    """Offsets of ``frames`` (``(index, planes, layout, height, width, colour)``) in the staging."""
    plan = Nv12Plan(host_end=params_offset(header_bytes) + max_batch * NV12_PARAMS * 8)
    offset = frames_offset(header_bytes, max_batch)
    for i, planes, layout, height, width, colour in frames:
        plan.placed.append((i, letterbox_params(height, width, size), offset, layout))
        plan.sources.append(planes)
        plan.colours.append(colour)
        offset = align_up(offset + layout.span, FRAME_ALIGN)
    plan.end = offset
    return plan


def plan_frames(images: Sequence[Any], device: int, header_bytes: int, max_batch: int, size: int,
                results: list[Any]) -> Nv12Plan:
    """The valid device frames of ``images`` placed in a slot's staging; errors into ``results``."""
    frames = checked_frames(images, device, results)
    return plan_nv12(header_bytes, max_batch, size, [(i, f.planes, layout, f.height, f.width,
                                                      swscale_constants(f.colorspace, f.full_range))
                                                     for i, f, layout in frames])


def stage(staging: Any, plan: Nv12Plan, bucket: int, stream: Any) -> None:
    """Params into the pinned staging (uploaded with the batch), frames into the device staging."""
    write_params(staging.host_np, staging.header_bytes, staging.max_batch, plan, bucket)
    copy_frames(staging.dev, plan, stream)


def params_view(host_np: np.ndarray, header_bytes: int, max_batch: int) -> np.ndarray:
    """The NV12 params rows in a staging buffer (pinned host, or a device one's NumPy twin)."""
    start = params_offset(header_bytes)
    return host_np[start : start + max_batch * NV12_PARAMS * 8].view(np.int64).reshape(max_batch, NV12_PARAMS)


def write_params(host_np: np.ndarray, header_bytes: int, max_batch: int, plan: Nv12Plan, bucket: int) -> None:
    """Each frame's params into the pinned staging; the bucket's padding slots read no pixels."""
    rows = params_view(host_np, header_bytes, max_batch)
    for j, ((_, lb, offset, layout), colour) in enumerate(zip(plan.placed, plan.colours)):
        fill_nv12_params(rows[j], lb, offset, layout.pitch, layout.luma_rows, colour)
    for j in range(len(plan.placed), bucket):
        fill_nv12_params(rows[j], None, 0, 0)


def copy_frames(staging_dev: Any, plan: Nv12Plan, stream: Any) -> None:
    """Each frame's bytes into the device staging, device to device, on ``stream`` (torch)."""
    import torch

    with torch.cuda.stream(stream):
        for (_, _, offset, layout), planes in zip(plan.placed, plan.sources):
            src = torch.as_strided(planes, (layout.span,), (1,))  # its rows, pitch and all, as one range
            staging_dev[offset : offset + layout.span].copy_(src, non_blocking=True)


def device_params(staging: Any) -> Any:
    """The Numba view of a slot's device NV12 params (made at capture time only: graphs keep it)."""
    from numba import cuda

    start = params_offset(staging.header_bytes)
    rows = staging.dev[start : start + staging.max_batch * NV12_PARAMS * 8]
    return cuda.as_cuda_array(rows.view(_torch_int64()).view(staging.max_batch, NV12_PARAMS), sync=False)


def clear_params(staging: Any) -> None:
    """Zero the device NV12 params (every slot empty), so that a graph's warm-up runs before its
    first upload read no pixels: that region may hold an image batch's bytes."""
    import torch

    start = params_offset(staging.header_bytes)
    staging.dev[start : start + staging.max_batch * NV12_PARAMS * 8].zero_()
    torch.cuda.synchronize(staging.device)


def launch_nv12_input(staging: Any, input_nb: Any, batch: int, stream: Any) -> None:
    """The NV12 letterbox kernel of a slot's staging into the engine input (what the graph holds)."""
    launch_nv12_letterbox(staging.nb_staging, device_params(staging), input_nb, batch, stream=stream)


def _torch_int64() -> Any:
    import torch

    return torch.int64

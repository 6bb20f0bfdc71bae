"""Laying one batch out in a slot's staging buffer, and the bucket it runs in.

Staging layout (``app.gpu.memory.Staging``)::

    [ params header | frames (BGR HWC, packed on the host) | JPEGs (decoded on the device) ]
      \\_________ one H2D copy per batch _________/            \\_ written by the decoder _/

A JPEG's place is reserved from its header's size before it is decoded, and the decoder
writes it there. Frames are copied into the pinned buffer on the calling thread, or by several
host threads at once once there are megabytes of them (NumPy releases the GIL for the copies);
JPEGs decoded on the GPU never touch the host.

A JPEG waits in ``BatchPlan.pending`` until its decode is settled (``settle_decoded``;
``settle_and_upload`` also uploads OpenCV's frames into the slot's device staging): it joins
the batch (``placed``, what the params header and so the graph read) only when the decoder
reported it decoded whole at its place, or as OpenCV's frame of it written there; any other
answer is the image's error and its place is read by nothing. ``write_header`` refuses a plan
with an image still pending.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.errors import InvalidImage, InvalidParameter, YolopipeError
from app.gpu.decoded import IN_PLACE
from app.gpu.memory import align_up
from app.gpu.preprocess import LAYOUT_HWC_BGR, fill_params, letterbox_placement
from app.imaging.check import undecodable
from app.types import Letterbox

IMAGE_ALIGN = 16  # byte alignment of each image in the staging buffer
# Bytes per host thread below which splitting a copy costs more than it saves: handing work to
# the pool and waiting for it costs tens of microseconds, a 640x480 frame's copy about as much.
PARALLEL_PACK_MIN_BYTES = 2 * 1024 * 1024


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (which is always the last bucket)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The smallest of ``buckets`` (``bucket_sizes``) that takes ``n`` images."""
    for b in buckets:
        if b >= n:
            return b
    raise InvalidParameter(f"batch of {n} images is over max_batch {buckets[-1]}")


def bucket_to_run(buckets: Sequence[int], n: int, captured: Callable[[int], bool] | None = None) -> int:
    """The bucket ``n`` images run in: the smallest that takes them; given ``captured`` (whether a
    bucket's graph is captured already) and that one not captured, the smallest captured one that
    takes them, if any."""
    exact = bucket_for(buckets, n)
    if captured is not None and not captured(exact):
        for b in buckets:
            if b > exact and captured(b):
                return b
    return exact


@dataclass
class BatchPlan:
    """Where each image of a batch goes; batch position ``j`` is ``placed[j]``."""

    placed: list[tuple[int, Letterbox, int, int]] = field(default_factory=list)  # (result index, lb, offset, layout)
    pending: list[tuple[int, Letterbox, int, int]] = field(default_factory=list)  # JPEGs not yet decoded, alike
    frame_copies: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (offset, BGR frame)
    host_end: int = 0  # bytes [0, host_end) travel in the H2D copy
    device_start: int = 0  # bytes [device_start, end) are the JPEGs' places, written on the device
    end: int = 0  # bytes of the staging buffer in use

    @property
    def device_offsets(self) -> list[int]:
        """Where each JPEG still to be decoded on the device goes."""
        return [offset for _, _, offset, _ in self.pending]

    def __len__(self) -> int:
        return len(self.placed)


def plan_batch(
    header_bytes: int, size: int, frames: list[tuple[int, np.ndarray]], images: list[tuple[int, int, int, int]]
) -> BatchPlan:
    """Offsets of ``frames`` (host) then ``images`` (``(index, height, width, layout)``, decoded
    on the device) after the params header."""
    plan = BatchPlan()
    offset = header_bytes
    for i, img in frames:
        h, w = img.shape[:2]
        plan.placed.append((i, letterbox_placement(h, w, size), offset, LAYOUT_HWC_BGR))
        plan.frame_copies.append((offset, img))
        offset += align_up(img.nbytes, IMAGE_ALIGN)
    plan.host_end = offset
    offset = align_up(offset)
    plan.device_start = offset
    for i, h, w, layout in images:
        plan.pending.append((i, letterbox_placement(h, w, size), offset, layout))
        offset += align_up(h * w * 3, IMAGE_ALIGN)
    plan.end = offset
    return plan


def settle_decoded(
    plan: BatchPlan, answers: Sequence[Any], host_np: np.ndarray, size: int
) -> tuple[list[tuple[int, int]], dict[int, YolopipeError]]:
    """After ``decode_into``: ``answers[k]`` for ``plan.pending[k]`` is ``IN_PLACE`` (the decoder
    reported it decoded whole at its place), OpenCV's frame (the GPU refused it) or the image's
    error. A frame is written into the pinned staging at the image's reserved offset, to be
    uploaded there (``(offset, nbytes)`` returned). Only those two join the batch; anything
    else (an error, a missing or unknown answer) takes the image out of it, its error returned
    by result index. Nothing is pending after."""
    uploads: list[tuple[int, int]] = []
    errors: dict[int, YolopipeError] = {}
    pending, plan.pending = plan.pending, []
    for k, (i, lb, offset, layout) in enumerate(pending):
        answer = answers[k] if k < len(answers) else None
        if answer is IN_PLACE:
            plan.placed.append((i, lb, offset, layout))
        elif isinstance(answer, np.ndarray) and answer.nbytes <= lb.src_h * lb.src_w * 3:
            host_np[offset : offset + answer.nbytes] = answer.reshape(-1)
            uploads.append((offset, answer.nbytes))
            plan.placed.append((i, letterbox_placement(answer.shape[0], answer.shape[1], size), offset, LAYOUT_HWC_BGR))
        elif isinstance(answer, YolopipeError):
            errors[i] = answer
        elif isinstance(answer, np.ndarray):
            errors[i] = InvalidImage("the decoded image is larger than its header says")
        else:  # not reported decoded: refused as OpenCV refuses what it cannot decode
            errors[i] = undecodable("jpeg")
    return uploads, errors


def settle_and_upload(staging: Any, plan: BatchPlan, answers: Sequence[Any], stream: Any, size: int,
                      results: list[Any]) -> None:
    """``settle_decoded`` in a slot's ``staging``: each JPEG joins the batch only as the decoder
    reported it decoded in place, or as OpenCV's frame of it (through the pinned staging, H2D on
    ``stream``, the decoder's); any other answer is its error in ``results``, and its place is
    read by nothing."""
    from app.gpu.driver import copy_host_to_device, cuda_driver

    uploads, errors = settle_decoded(plan, answers, staging.host_np, size)
    for i, err in errors.items():
        results[i] = err
    if uploads:
        dev, host = staging.dev.data_ptr(), staging.host.data_ptr()
        copy_host_to_device(cuda_driver(), [(dev + off, host + off, n) for off, n in uploads], stream.cuda_stream)


def write_header(host_params: np.ndarray, plan: BatchPlan, bucket: int) -> None:
    """Each image's params into the pinned header; the bucket's padding slots read no pixels."""
    if plan.pending:
        raise RuntimeError("a batch was about to run with images whose decode was never settled")
    for j, (_, lb, offset, layout) in enumerate(plan.placed):
        fill_params(host_params[j], lb, offset, layout)
    for j in range(len(plan.placed), bucket):
        fill_params(host_params[j], None, 0, 0)


def copy_frames(
    host_np: np.ndarray, copies: list[tuple[int, np.ndarray]], parallel_map: Callable[..., Iterable] | None, parts: int
) -> None:
    """Frames into the pinned staging at their offsets, split by rows over ``parts`` host threads
    once there is enough to copy: one thread writes pinned memory at only a few GB/s."""
    pieces = _row_pieces(host_np, copies, parts if parallel_map is not None else 1)
    if len(pieces) > 1:
        list(parallel_map(_copy_rows, pieces))
    elif pieces:
        _copy_rows(pieces[0])


def _row_pieces(
    host_np: np.ndarray, copies: list[tuple[int, np.ndarray]], parts: int
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """``(destination view, source rows)`` pairs in ``parts`` groups of about equal bytes."""
    total = sum(img.nbytes for _, img in copies)
    parts = max(1, min(parts, total // PARALLEL_PACK_MIN_BYTES))
    per_part = -(-total // parts)
    pieces: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    filled = 0
    for offset, img in copies:
        row_bytes = img.nbytes // img.shape[0]
        r = 0
        while r < img.shape[0]:
            room = max(1, (per_part - filled) // row_bytes)
            r1 = min(img.shape[0], r + room)
            start = offset + r * row_bytes
            dst = host_np[start : start + (r1 - r) * row_bytes].reshape((r1 - r, *img.shape[1:]))
            pieces[-1].append((dst, img[r:r1]))
            filled += (r1 - r) * row_bytes
            r = r1
            if filled >= per_part and len(pieces) < parts:
                pieces.append([])
                filled = 0
    return [p for p in pieces if p]


def _copy_rows(piece: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in piece:
        np.copyto(dst, src)  # NumPy releases the GIL for the copy


def checked_frames(images: Sequence[Any], byte_slots: set[int], results: list[Any]) -> list:
    """``(index, frame)`` of the valid BGR frames; an invalid one gets its error in ``results``."""
    frames = []
    for i, value in enumerate(images):
        if i in byte_slots:
            continue
        if not isinstance(value, np.ndarray) or value.ndim != 3 or value.shape[2] != 3 or value.dtype != np.uint8 \
                or 0 in value.shape:
            shape = getattr(value, "shape", type(value).__name__)
            results[i] = InvalidImage(f"frames must be BGR uint8 [H, W, 3], got {getattr(value, 'dtype', '')} {shape}")
        else:
            frames.append((i, value))
    return frames

"""``GpuPipeline.warmup`` on a CPU: what it captures, the room it makes for NVDEC's frames, and
that a warm-up with nothing left to do never takes the device's gate (a stream runner calls it
for every stream it opens, while other streams' batches run).

The pipeline's device steps are stood in for (no GPU here): slots whose staging is a size, a
graph builder that notes what it captures. ``warmup`` and ``BatchSlot.has``/``make_room`` run
as written. Growing a slot's staging gives it new addresses, which its captured graphs baked
in: they must be captured again inside the warm-up, not by a later batch while NVDEC readers
decode (on the H200 such a capture was invalidated, and every stream failed).
"""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

from app.gpu.capture import graph_key
from app.gpu.memory import CapturedBatch, CapturedGraphs
from app.gpu.nv12_input import Nv12Layout, plan_nv12, staging_for
from app.gpu.slot import BatchSlot
from app.imaging.yuv import swscale_constants
from app.pipeline.gpu import GpuPipeline

HEADER = 4096


class Slot(BatchSlot):
    """A batch slot whose staging is only its size."""

    def __init__(self, capacity: int) -> None:
        self.staging = types.SimpleNamespace(capacity=capacity, header_bytes=HEADER)
        self.graphs = CapturedGraphs()
        self.dispatch = None

    def resize_staging(self, capacity: int) -> None:
        self.graphs.free()
        self.staging = types.SimpleNamespace(capacity=capacity, header_bytes=HEADER)


def pipeline(capacity: int = 10_000_000, max_batch: int = 8):
    captured: list[tuple[int, int, bool]] = []
    gate_taken: list[int] = []

    def capture(slot, batch, *, profile, raw_exec, nv12=False):
        key = graph_key(batch, nv12)
        if slot.graphs.get(key) is None:
            captured.append((slot.index, batch, nv12))
            slot.graphs.add(CapturedBatch(batch=batch, graph=None, head=None), key)

    @contextlib.contextmanager
    def exclusive():
        gate_taken.append(1)
        yield

    slots = [Slot(capacity) for _ in range(2)]
    for i, slot in enumerate(slots):
        slot.index = i
    attached: list[int] = []
    pipe = types.SimpleNamespace(
        _closed=False, slots=slots, max_batch=max_batch, buckets=(1, 2, 4, 8), _exclusive=exclusive,
        graphs=types.SimpleNamespace(captured=capture),
        dispatcher=types.SimpleNamespace(attach=lambda s: attached.append(s.index)))
    return pipe, captured, gate_taken, attached


def test_warmup_captures_each_bucket_once_and_then_holds_nothing_up():
    pipe, captured, gate_taken, _ = pipeline()
    GpuPipeline.warmup(pipe, nv12=True)
    assert sorted(captured) == sorted((s, b, True) for s in (0, 1) for b in (1, 2, 4, 8))
    assert gate_taken == [1]
    GpuPipeline.warmup(pipe, nv12=True)  # all there: not even the gate
    GpuPipeline.warmup(pipe, [3], nv12=True)
    assert gate_taken == [1] and len(captured) == 8


def test_room_for_a_batch_of_frames_captures_the_dropped_graphs_again_inside_the_warmup():
    pipe, captured, gate_taken, attached = pipeline()
    GpuPipeline.warmup(pipe)  # the images' graphs
    GpuPipeline.warmup(pipe, nv12=True)
    before = len(captured)
    GpuPipeline.warmup(pipe, nv12=True, frame_size=(1080, 1920))
    room = staging_for(HEADER, 8, 8, 1080, 1920)
    assert room > 10_000_000 and all(slot.staging.capacity == room for slot in pipe.slots)
    again = captured[before:]
    assert sorted(again) == sorted((s, b, nv12) for s in (0, 1) for b in (1, 2, 4, 8) for nv12 in (False, True))
    assert attached == [0, 1] and gate_taken == [1, 1, 1]
    # The next stream of that size (or smaller) holds nothing up.
    GpuPipeline.warmup(pipe, nv12=True, frame_size=(1080, 1920))
    GpuPipeline.warmup(pipe, nv12=True, frame_size=(720, 1280))
    assert gate_taken == [1, 1, 1] and len(captured) == before + 16


def test_a_video_read_in_batches_of_4_makes_room_for_4_frames():
    pipe, captured, _, _ = pipeline(capacity=1000)
    GpuPipeline.warmup(pipe, range(1, 5), nv12=True, frame_size=(2160, 3840))
    assert all(slot.staging.capacity == staging_for(HEADER, 8, 4, 2160, 3840) for slot in pipe.slots)
    assert sorted({b for _, b, _ in captured}) == [1, 2, 4]


@pytest.mark.parametrize(("height", "width", "coded_rows"), [(1080, 1920, 1088), (720, 1280, 720), (481, 641, 496)])
@pytest.mark.parametrize("count", [8, 3])
def test_the_room_holds_a_batch_of_nvdec_frames(height, width, coded_rows, count):
    """NVDEC's frames as the readers hand them over (``own_copies``: rows of the coded height, no
    padding), ``count`` of them planned into the staging of a slot of 8, take no more than
    ``staging_for`` says (the params of all 8 come first, whatever the batch)."""
    cols = width + width % 2
    layout = Nv12Layout(coded_rows * 3 // 2, cols, cols)
    colour = swscale_constants(1, False)
    frames = [(i, np.zeros(1), layout, height, width, colour) for i in range(count)]
    plan = plan_nv12(HEADER, 8, 640, frames)
    assert plan.end - HEADER <= staging_for(HEADER, 8, count, height, width)

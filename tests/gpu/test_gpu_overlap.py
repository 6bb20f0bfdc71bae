"""Batches in flight at once on a real GPU: slots driven by several threads, the overlapped
runner, the stage timeline's ordering, staging growth, and the host-side decode path.
"""

from __future__ import annotations

import importlib.util
import threading

import numpy as np
import pytest
import torch

from app.boxes import box_iou
from app.contracts import DetectParams
from app.errors import InvalidParameter
from app.pipeline.overlap import run_overlapped

pytestmark = pytest.mark.requires_gpu


def _assert_rows_close(a, b, where):
    assert len(a) == len(b), where
    if len(a):
        assert np.diag(box_iou(a[:, :4], b[:, :4])).min() >= 0.999, where
        assert np.abs(a[:, 4] - b[:, 4]).max() <= 2e-4, where
        np.testing.assert_array_equal(a[:, 5], b[:, 5])


@pytest.fixture(scope="module")
def pipe_slots(gpu, sample_model_dir, meta):
    p = gpu.make_pipeline(sample_model_dir, meta, "fp32", max_batch=16, in_flight=3)
    yield p
    p.close()


@pytest.fixture(scope="module")
def batches(gpu, frames, assets_dir):
    jpegs = [gpu.jpeg((assets_dir / n).read_bytes()) for n in ("bus.jpg", "zidane.jpg")]
    return [
        [frames["bus"], frames["zidane"]],
        [frames["stacked"], frames["bus_small"], frames["zidane_gray"]],
        jpegs,
        [jpegs[0], frames["bus_flipped"], jpegs[1]],  # GPU-decoded and host frames in one batch
        [frames["bus"], frames["zidane"], frames["bus_flipped"], frames["zidane_tiny_upscaled"]] * 4,
    ]


def test_threads_on_slots_equal_serial(gpu, pipe_slots, batches):
    """Three threads on a three-slot pipeline at once give the detections of serial runs,
    frames, GPU-decoded JPEG, both in one batch, and 16 frames packed by the host pool."""
    pipe = pipe_slots
    params = DetectParams()
    pipe.warmup([2, 3, 4, 16])
    assert all(slot.graphs.get(16) is not None for slot in pipe.slots)
    serial = [gpu.rows_of(pipe.run(b, params)) for b in batches]
    got: dict[tuple[int, int, int], list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(3, timeout=30)

    def worker(t):
        try:
            start.wait()
            for rep in range(4):
                for k, b in enumerate(batches):
                    got[(t, rep, k)] = gpu.rows_of(pipe.run(b, params))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert len(got) == 3 * 4 * len(batches)
    for (t, rep, k), rows in got.items():
        for j, (a, b) in enumerate(zip(rows, serial[k])):
            _assert_rows_close(a, b, (t, rep, k, j))


def test_overlapped_runner_keeps_order_and_results(gpu, pipe_slots, batches):
    params = DetectParams()
    serial = [gpu.rows_of(pipe_slots.run(b, params)) for b in batches]
    stream = [batches[k % len(batches)] for k in range(12)]
    out = list(run_overlapped(lambda b: gpu.rows_of(pipe_slots.run(b, params)), stream, pipe_slots.in_flight))
    assert len(out) == len(stream)
    for k, rows in enumerate(out):
        for j, (a, b) in enumerate(zip(rows, serial[k % len(batches)])):
            _assert_rows_close(a, b, (k, j))


def test_timeline_orders_the_stages_of_each_batch(pipe_slots, batches):
    """Per batch: the graph starts after its upload and its decode end; graphs of different
    batches never overlap (one compute stream); and decode work of some batch overlaps some
    graph when batches are in flight together."""
    params = DetectParams()
    jpeg_batch = batches[3]
    pipe_slots.run(jpeg_batch, params)
    with pipe_slots.diagnose(timeline=True).timeline as timeline:
        list(run_overlapped(lambda b: pipe_slots.run(b, params), [jpeg_batch] * 9, 3))
    pipe_slots.run(jpeg_batch, params)  # closed: no batch records into it any more
    recs = timeline.records
    assert len(recs) == 9
    eps = 0.002  # ms: event timestamps have ~0.5 µs resolution
    for r in recs:
        assert {"decode", "upload", "compute"} <= set(r), r
        assert r["upload"][1] <= r["compute"][0] + eps, r
        assert r["decode"][1] <= r["compute"][0] + eps, r
        assert r["host_start"] <= r["host_end"]
    computes = sorted(tuple(r["compute"]) for r in recs)
    for (s0, e0), (s1, e1) in zip(computes, computes[1:]):
        assert e0 <= s1 + eps, (computes, "graphs overlapped on the one compute stream")
    summary = timeline.summary()
    assert summary["batches"] == 9 and 0 < summary["compute_busy_pct"] <= 100.0
    print(summary)


@pytest.mark.skipif(importlib.util.find_spec("nvidia.nvimgcodec") is None, reason="no nvImageCodec")
def test_decode_of_the_next_batch_overlaps_the_engine(gpu, sample_model_dir, meta, frames):
    """With batches in flight, batch N+1's JPEGs are decoded while the engine runs batch N:
    in the stage timeline, each decode ends before the graph of the batch before it does
    (when the decode waited for the device, it ended ~one decode after that graph instead)."""
    import cv2

    pipe = gpu.make_pipeline(sample_model_dir, meta, "fp16", max_batch=64, in_flight=3, decode="nvimgcodec")
    try:
        jpegs = [gpu.jpeg(cv2.imencode(".jpg", cv2.resize(frames[name], size))[1].tobytes())
                 for name in ("bus", "zidane") for size in ((640, 480), (810, 1080), (1280, 720))]
        batch = [jpegs[i % len(jpegs)] for i in range(64)]
        params = DetectParams()
        list(run_overlapped(lambda b: pipe.run(b, params), [batch] * 3, 3))  # every slot captured
        with pipe.diagnose(timeline=True).timeline as timeline:
            list(run_overlapped(lambda b: pipe.run(b, params), [batch] * 16, 3))
        summary = timeline.summary()
        print(summary)
        assert summary["batches"] == 16
        assert summary["decode_hidden_pct"] >= 80.0, (summary, timeline.records)
    finally:
        pipe.close()


def test_staging_grows_and_graphs_are_recaptured(gpu, sample_model_dir, meta, frames):
    pipe = gpu.make_pipeline(sample_model_dir, meta, "fp32", max_batch=2, in_flight=1)
    try:
        small = gpu.detect(pipe, [frames["bus"]])  # fits the initial staging (2 × 640² × 3)
        cap = pipe.slots[0].staging.capacity
        big = gpu.detect(pipe, [frames["zidane_huge"], frames["bus"]])  # 11 MB: must grow
        assert pipe.slots[0].staging.capacity > cap
        # the driver calls were rebuilt for the new buffers
        assert pipe.run([frames["zidane_huge"], frames["bus"]], DetectParams()).facts.launch == "driver"
        again = gpu.detect(pipe, [frames["bus"]])
        np.testing.assert_array_equal(small[0].boxes, again[0].boxes)
        assert len(big[1]) == len(small[0])  # bucket 2 vs bucket 1: cuDNN may pick other kernels
        assert np.diag(box_iou(big[1].boxes, small[0].boxes)).min() >= 0.999
    finally:
        pipe.close()


def device_used() -> int:
    """Bytes in use on the device as the driver counts them (every allocator, every context)."""
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_release_memory_shrinks_grown_staging_and_frees_torch_caches(gpu, sample_model_dir, meta, frames):
    """After a burst of large images, ``release_memory`` (the idle server's call) puts the grown
    staging back to its first size and gives the driver back what the burst took: the device's
    used memory and torch's reserved pool are back to what they were before it (a first burst
    and release come before, so that what any burst loads once, kernels and workspaces, is
    already there); the next batch captures its graph again and answers the same rows."""
    pipe = gpu.make_pipeline(sample_model_dir, meta, "fp32", max_batch=2, in_flight=2)

    def burst():  # both slots take a batch of two large images and grow
        for _ in range(2):
            gpu.detect(pipe, [frames["zidane_huge"], frames["zidane_huge"]])

    try:
        small = gpu.detect(pipe, [frames["bus"]])  # bus (810 x 1080) grows its slot too
        pipe.release_memory()
        first = [slot.staging.capacity for slot in pipe.slots]
        assert first == [pipe.slots[0].staging.capacity] * len(first)  # every slot at its first size
        burst()
        pipe.release_memory()
        reserved, used = torch.cuda.memory_reserved(), device_used()
        burst()
        grown = max(slot.staging.capacity for slot in pipe.slots)
        assert grown > max(first)
        assert device_used() >= used + grown - max(first)  # the grown staging is on the device
        pipe.release_memory()
        assert [slot.staging.capacity for slot in pipe.slots] == first
        assert torch.cuda.memory_reserved() <= reserved
        assert device_used() <= used, f"{device_used() - used} bytes more on the device than before the burst"
        again = gpu.detect(pipe, [frames["bus"]])
        np.testing.assert_array_equal(small[0].boxes, again[0].boxes)
        # the driver calls were rebuilt for the new buffers
        assert pipe.run([frames["bus"]], DetectParams()).facts.launch == "driver"
    finally:
        pipe.close()


def test_cpu_decode_equals_opencv_frames(gpu, pipe32, assets_dir):
    """decode="opencv" (``cpu``: its old name): bytes decoded by OpenCV in the host pool give
    exactly the rows of the frames decoded by the CPU path's own decoder (Ultralytics' reader)."""
    from app.imaging.decode import decode_image

    datas = [(assets_dir / n).read_bytes() for n in ("bus.jpg", "zidane.jpg")]
    assert pipe32.diagnose(decode="cpu").decoder == "opencv"
    from_bytes = gpu.rows_of(pipe32.run([gpu.jpeg(d) for d in datas], DetectParams(), decode="cpu"))
    single = gpu.rows_of(pipe32.run([gpu.jpeg(datas[0])], DetectParams(), decode="cpu"))  # one image: decoded inline
    from_frames = gpu.rows_of(pipe32.run([decode_image(d) for d in datas], DetectParams()))
    single_frame = gpu.rows_of(pipe32.run([decode_image(datas[0])], DetectParams()))  # same bucket as `single`
    for a, b in zip(from_bytes, from_frames):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(single[0], single_frame[0])
    with pytest.raises(InvalidParameter):
        pipe32.run([gpu.jpeg(datas[0])], DetectParams(), decode="libjpeg")

"""CPU-side logic of the GPU pipeline: buckets, batch splitting, the capture gate, driver loading."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from app.errors import DeviceError, InvalidParameter
from app.gpu.driver import CudaDriver
from app.gpu.gate import Gate
from app.gpu.pack import bucket_for, bucket_sizes, bucket_to_run


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


def test_the_bucket_a_batch_runs_in():
    buckets = bucket_sizes(12)
    assert [bucket_for(buckets, n) for n in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]
    with pytest.raises(InvalidParameter, match="batch of 13 images is over max_batch 12"):
        bucket_for(buckets, 13)
    assert bucket_to_run(buckets, 3) == 4
    assert bucket_to_run(buckets, 3, lambda b: b in (8, 12)) == 8  # the smallest captured that takes them
    assert bucket_to_run(buckets, 3, lambda b: b in (2, 4, 12)) == 4  # its own, captured
    assert bucket_to_run(buckets, 3, lambda b: b == 2) == 4  # none captured takes them: its own


def _started(target) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_gate_shared_holders_run_together():
    gate = Gate()
    inside = threading.Barrier(3, timeout=5)  # fails (BrokenBarrierError) unless all 3 hold it at once

    def run():
        with gate.shared():
            inside.wait()

    threads = [_started(run) for _ in range(3)]
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert not inside.broken


def test_gate_exclusive_waits_for_shared_and_blocks_new_shared():
    gate = Gate()
    events: list[str] = []
    batch_in, batch_done = threading.Event(), threading.Event()

    def batch():
        with gate.shared():
            batch_in.set()
            batch_done.wait(5)

    def exclusive():
        with gate.exclusive():
            events.append("exclusive")

    def late_shared():
        with gate.shared():
            events.append("late shared")

    t_batch = _started(batch)
    assert batch_in.wait(5)
    t_ex = _started(exclusive)
    time.sleep(0.1)
    assert events == []  # the capture waits for the batch in flight
    t_sh = _started(late_shared)
    time.sleep(0.1)
    assert events == []  # a waiting capture goes before a new batch
    batch_done.set()
    for t in (t_batch, t_ex, t_sh):
        t.join(5)
    assert events == ["exclusive", "late shared"]


def test_gate_open_since_is_now_while_a_capture_holds_or_waits_then_when_it_let_go():
    gate = Gate()
    assert gate.open_since() == 0.0  # no capture yet
    with gate.shared():
        assert gate.open_since() == 0.0
    waiting, held = threading.Event(), threading.Event()

    def capture():
        waiting.set()
        with gate.exclusive():
            held.set()
            time.sleep(0.2)

    with gate.shared():  # the capture waits for this batch: shared holders are not let in
        t = _started(capture)
        assert waiting.wait(5)
        time.sleep(0.05)
        before = time.monotonic()
        assert gate.open_since() >= before
    assert held.wait(5)
    assert gate.open_since() >= time.monotonic() - 0.01  # held: now
    t.join(5)
    released = gate.open_since()
    time.sleep(0.05)
    assert gate.open_since() == released <= time.monotonic() - 0.05  # let go: that time, which stays


def test_gate_two_runs_that_both_need_a_capture_do_not_deadlock():
    """The pattern of GpuPipeline._capture_while_shared (``exclusive_from_shared`` inside a
    batch's ``shared``), in two threads at once; each holds its share again after its capture."""
    gate = Gate()
    both_shared = threading.Barrier(2, timeout=5)
    captures: list[int] = []
    shared_again = threading.Barrier(2, timeout=5)  # both back inside their share at once

    def run(k):
        with gate.shared():
            both_shared.wait()
            with gate.exclusive_from_shared():
                captures.append(k)
                assert gate.held_exclusive
            shared_again.wait()

    threads = [_started(lambda k=k: run(k)) for k in range(2)]
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert sorted(captures) == [0, 1] and not shared_again.broken
    with gate.exclusive():  # every share was given back: nothing holds the gate
        assert gate.held_exclusive


def test_gate_a_capture_that_fails_inside_a_batch_gives_the_share_back():
    gate = Gate()
    with pytest.raises(DeviceError), gate.shared(), gate.exclusive_from_shared():
        raise DeviceError("capture failed")
    assert not gate.held_exclusive
    taken = threading.Event()

    def capture():
        with gate.exclusive():
            taken.set()

    _started(capture).join(5)
    assert taken.is_set()  # no share was left behind: a capture gets the gate at once


def test_driver_missing_library_is_a_device_error():
    with pytest.raises(DeviceError, match="cannot load"):
        CudaDriver("libcuda-does-not-exist.so.1")


def test_driver_library_without_cuda_symbols_is_a_device_error():
    with pytest.raises(DeviceError, match="has no cuGetErrorName"):
        CudaDriver("libc.so.6")


@pytest.mark.parametrize("parts", [1, 3, 8])
@pytest.mark.parametrize("shapes", [[(480, 640)], [(7, 5), (480, 640), (1, 1), (300, 200)], [(1080, 1920)] * 3])
def test_copy_frames_packs_every_byte_at_its_offset(parts, shapes):
    """Frames split by rows over host threads land exactly where the params say, and nothing
    outside them is written (views of non-contiguous frames included)."""
    from concurrent.futures import ThreadPoolExecutor

    from app.gpu.pack import copy_frames

    rng = np.random.default_rng(len(shapes) * 10 + parts)
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    frames[0] = frames[0][:, ::-1]  # a flipped view: not contiguous
    copies, offset = [], 64
    for img in frames:
        copies.append((offset, img))
        offset += img.nbytes + 16
    host = np.full(offset + 64, 7, np.uint8)
    with ThreadPoolExecutor(4) as pool:
        copy_frames(host, copies, pool.map, parts)
    expected = np.full_like(host, 7)
    for off, img in copies:
        expected[off : off + img.nbytes] = np.ascontiguousarray(img).reshape(-1)
    np.testing.assert_array_equal(host, expected)


def test_plan_reserves_each_gpu_jpeg_its_decoded_size_after_the_frames():
    """Frames first (the H2D prefix), then every GPU-decoded JPEG at an aligned offset with
    room for its decoded height × width × 3 bytes, none overlapping."""
    from app.gpu.memory import align_up
    from app.gpu.pack import IMAGE_ALIGN, plan_batch
    from app.gpu.preprocess import LAYOUT_HWC_BGR, LAYOUT_HWC_RGB

    frames = [(0, np.zeros((480, 640, 3), np.uint8)), (3, np.zeros((7, 5, 3), np.uint8))]
    jpegs = [(1, 1080, 1920, LAYOUT_HWC_RGB), (2, 3, 1, LAYOUT_HWC_RGB), (4, 640, 480, LAYOUT_HWC_RGB)]
    plan = plan_batch(1024, 640, frames, jpegs)
    assert [p[0] for p in plan.placed] == [0, 3]  # the JPEGs wait for their decode
    assert [p[0] for p in plan.pending] == [1, 2, 4]
    assert [p[3] for p in plan.placed + plan.pending] == [LAYOUT_HWC_BGR] * 2 + [LAYOUT_HWC_RGB] * 3
    assert plan.host_end == 1024 + align_up(480 * 640 * 3, IMAGE_ALIGN) + align_up(7 * 5 * 3, IMAGE_ALIGN)
    assert plan.device_offsets[0] == plan.device_start >= plan.host_end and plan.device_offsets[0] % 256 == 0
    spans = [(off, off + h * w * 3) for off, (_, h, w, _) in zip(plan.device_offsets, jpegs)]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= plan.end
    assert all(off % IMAGE_ALIGN == 0 for off in plan.device_offsets)


def test_decoded_size_and_hardware_routing_from_the_header():
    from app.gpu.decoded import decoded_size
    from app.gpu.jpeg import JpegHeader
    from app.gpu.nvimgcodec import hardware_takes

    def header(**kw):
        base = dict(height=480, width=640, components=3, precision=8, progressive=False, arithmetic=False,
                    lossless=False, sampling=((2, 2), (1, 1), (1, 1)), orientation=1)
        return JpegHeader(**{**base, **kw})

    assert decoded_size(header()) == (480, 640)
    assert [decoded_size(header(orientation=o)) for o in (5, 6, 7, 8)] == [(640, 480)] * 4
    assert [decoded_size(header(orientation=o)) for o in (2, 3, 4)] == [(480, 640)] * 3
    assert hardware_takes(header())  # 4:2:0
    assert all(hardware_takes(header(sampling=(s, (1, 1), (1, 1)))) for s in ((1, 1), (2, 1), (1, 2)))
    assert hardware_takes(header(components=1, sampling=((1, 1),)))
    assert not hardware_takes(header(sampling=((4, 1), (1, 1), (1, 1))))  # 4:1:1
    assert not hardware_takes(header(progressive=True))


def test_timeline_summary_says_whether_each_decode_finished_under_the_graph_before_it():
    from app.gpu.timeline import summarize

    hidden = [{"decode": [10 * k + 1, 10 * k + 4], "compute": [10 * k + 5, 10 * k + 15]} for k in range(4)]
    assert summarize(hidden)["decode_hidden_pct"] == 100.0
    # Each decode stalled until the graph before it was done, then took its own time: 0 %.
    stalled = [{"decode": [0, 4], "compute": [5, 15]}, {"decode": [5, 19], "compute": [20, 30]},
               {"decode": [20, 34], "compute": [35, 45]}]
    s = summarize(stalled)
    assert s["decode_hidden_pct"] == 0.0 and s["decode_overlapping_compute_pct"] > 50


def test_what_the_gpu_refused_goes_into_its_reserved_place_or_out_of_the_batch():
    from app.errors import InvalidImage
    from app.gpu.decoded import IN_PLACE
    from app.gpu.pack import plan_batch, settle_decoded, write_header
    from app.gpu.preprocess import LAYOUT_HWC_BGR, LAYOUT_HWC_RGB, PARAMS_PER_IMAGE

    frame = np.full((4, 6, 3), 9, np.uint8)
    plan = plan_batch(256, 640, [(0, frame)], [(1, 4, 6, LAYOUT_HWC_RGB), (2, 5, 5, LAYOUT_HWC_RGB),
                                               (3, 2, 2, LAYOUT_HWC_RGB), (4, 3, 3, LAYOUT_HWC_RGB),
                                               (5, 3, 3, LAYOUT_HWC_RGB)])
    host = np.zeros(plan.end, np.uint8)
    params = np.zeros((8, PARAMS_PER_IMAGE), np.int64)
    with pytest.raises(RuntimeError, match="never settled"):
        write_header(params, plan, 8)  # JPEGs still pending never reach the graph's params
    refused = np.arange(5 * 5 * 3, dtype=np.uint8).reshape(5, 5, 3)  # OpenCV's frame of image 2
    err = InvalidImage("corrupt")
    offsets = list(plan.device_offsets)
    # image 4: None (no report of a decode) and image 5: no answer at all are refused, not trusted
    uploads, errors = settle_decoded(plan, [IN_PLACE, refused, err, None], host, 640)
    assert uploads == [(offsets[1], refused.nbytes)]
    np.testing.assert_array_equal(host[offsets[1] : offsets[1] + refused.nbytes], refused.reshape(-1))
    assert errors[3] is err and sorted(errors) == [3, 4, 5]
    assert all(str(errors[i]) == "cannot decode this JPEG image (truncated or corrupt)" for i in (4, 5))
    assert [(p[0], p[2], p[3]) for p in plan.placed] == [(0, 256, LAYOUT_HWC_BGR), (1, offsets[0], LAYOUT_HWC_RGB),
                                                          (2, offsets[1], LAYOUT_HWC_BGR)]
    assert not plan.pending
    write_header(params, plan, 8)
    assert params[:3, 0].tolist() == [256, offsets[0], offsets[1]] and not params[3:].any()


def test_a_slot_rewrites_its_nms_params_only_on_change_and_unpacks_rows_per_image():
    import contextlib
    import types

    from app.contracts import DetectParams
    from app.gpu.slot import BatchSlot

    slot, calls, entered = object.__new__(BatchSlot), [], []
    slot.nms, slot.nms_params_key = types.SimpleNamespace(set_params=lambda **kw: calls.append(kw)), None

    @contextlib.contextmanager
    def context():
        entered.append(True)
        yield

    for params in (DetectParams(), DetectParams(), DetectParams(conf=0.5)):
        slot.set_nms_params(params, "stream", context)
    assert [c["conf"] for c in calls] == [DetectParams().conf, 0.5] and len(entered) == 2
    assert all(c["stream"] == "stream" for c in calls)

    rows = np.arange(2 * 3 * 6, dtype=np.float32).reshape(2, 3, 6)
    slot.results = types.SimpleNamespace(counts=np.array([2, 0]), rows=rows)
    results: list = [None, None, None]
    slot.unpack([(2, "lb2", 0, 0), (0, "lb0", 0, 0)], results)
    np.testing.assert_array_equal(results[2][0], rows[0, :2])
    assert results[2][1] == "lb2" and results[0][0].shape == (0, 6) and results[0][1] == "lb0" and results[1] is None
    assert results[2][0].base is not rows  # a copy: the slot's rows are overwritten by its next batch

"""GpuPipeline + TorchCudaEngine on a real GPU, against Ultralytics' own predictions.

Each test checks one property, so one run on the device says exactly which part is wrong:
fidelity fp32/fp16 on frames, zero copy, the profiler trace of a replay, bucket padding,
parameters across replays (rows bit-equal to the NumPy NMS on the graph's own head output),
the profiling path, the driver dispatch (one upload and one graph launch per batch, equal to
torch's replay), torch.compile.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from app.backends.torch_cuda import TorchCudaEngine
from app.boxes import box_iou, f1, match_pairs, nms_numpy
from app.contracts import DetectParams
from app.errors import InvalidParameter
from app.gpu.pack import bucket_sizes

pytestmark = pytest.mark.requires_gpu


def assert_same_detections(name, ref, det, conf, *, iou_min=0.99, score_tol=1e-3, margin=2e-3):
    """Same boxes one for one (class, IoU, score); a box within ``margin`` of the conf threshold
    may be on either side of it."""
    ref_boxes, ref_scores, ref_cls = ref
    boxes, scores, cls = det.boxes, det.scores, det.class_ids
    ious = box_iou(ref_boxes, boxes) * (ref_cls[:, None] == cls[None, :])
    used = set()
    for i in range(len(ref_cls)):
        j = int(np.argmax(ious[i])) if len(cls) else -1
        if j < 0 or ious[i, j] < iou_min:
            assert ref_scores[i] < conf + margin, f"{name}: Ultralytics box {i} ({ref_scores[i]:.4f}) has no match"
            continue
        used.add(j)
        assert abs(scores[j] - ref_scores[i]) <= score_tol, f"{name}: score {scores[j]:.5f} vs {ref_scores[i]:.5f}"
    for j in set(range(len(cls))) - used:
        assert scores[j] < conf + margin, f"{name}: extra box {j} ({scores[j]:.4f}) not in Ultralytics"


# ------------------------------------------------------------------------------- fidelity
def test_buckets():
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


def test_fp32_equals_ultralytics(gpu, pipe32, ultralytics_model, frames):
    total = 0
    for name, frame in frames.items():
        ref = gpu.ultralytics_predict(ultralytics_model, frame, half=False)
        (det,) = gpu.detect(pipe32, [frame])
        assert_same_detections(name, ref, det, gpu.CONF)
        total += len(ref[0])
    assert total >= 8, f"too few reference detections ({total}) for a meaningful comparison"


def test_fp32_batch_equals_single(gpu, pipe32, frames):
    items = list(frames.values())
    batched = gpu.detect(pipe32, items)
    for name, frame, det in zip(frames, frames.values(), batched):
        (single,) = gpu.detect(pipe32, [frame])
        assert len(det) == len(single), name
        if len(det):
            assert np.diag(box_iou(det.boxes, single.boxes)).min() >= 0.999, name
            assert np.abs(det.scores - single.scores).max() <= 2e-4, name  # true fp32 (TF32 off)


def test_fp16_f1_vs_ultralytics(gpu, pipe16, ultralytics_model, frames):
    tp = n_ref = n_pred = 0
    for frame in frames.values():
        ref_boxes, _, ref_cls = gpu.ultralytics_predict(ultralytics_model, frame, half=True)
        (det,) = gpu.detect(pipe16, [frame])
        tp += len(match_pairs(ref_boxes, ref_cls, det.boxes, det.class_ids, iou_thr=0.5))
        n_ref, n_pred = n_ref + len(ref_cls), n_pred + len(det.class_ids)
    assert n_ref >= 8
    assert f1(tp, n_ref, n_pred) >= 0.99, f"F1 {f1(tp, n_ref, n_pred):.4f} (tp {tp}, ref {n_ref}, ours {n_pred})"


# --------------------------------------------------------------------------- the graphs
def test_zero_copy_head(gpu, sample_model_dir, meta, frames):
    """The NMS in the graph was handed the engine's own output buffer, not a copy of it, and no
    view of a head outlives the capture (the graph replays without one; a cached view would keep
    a warm-up's head allocated: the release-memory test's lost megabytes)."""
    pipe = gpu.make_pipeline(sample_model_dir, meta, "fp32", max_batch=2, in_flight=1)
    try:
        slot = pipe.slots[0]
        viewed, view = [], slot.nms.head_view

        def recording(head):
            viewed.append(head.__cuda_array_interface__["data"][0])
            return view(head)

        slot.nms.head_view = recording  # the instance's: run() looks it up there
        pipe.run([frames["bus"]], DetectParams())
        head = slot.graphs.get(1).head
        assert head.is_cuda and tuple(head.shape) == (1, 4 + pipe.meta.num_classes, pipe.meta.num_anchors)
        assert len(viewed) == 3 and viewed[-1] == head.data_ptr(), (viewed, head.data_ptr())  # 2 warm-ups, the capture
        assert not slot.nms._views
    finally:
        pipe.close()


def test_replay_trace_has_only_the_final_copies(pipe32, frames):
    from torch.profiler import ProfilerActivity, profile

    params = DetectParams()
    items = [frames["bus"], frames["zidane"]]
    for _ in range(len(pipe32.slots)):  # every slot: captured, params set
        pipe32.run(items, params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pipe32.run(items, params)
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    memcpy = [n for n in names if "memcpy" in n.lower()]
    summary = f"CUDA activity: {sorted(set(names))}"
    assert any("letterbox" in n for n in names), "graph kernels not visible in the trace: " + summary
    assert any("_suppress" in n for n in names), summary
    dtoh = [n for n in memcpy if "DtoH" in n]
    htod = [n for n in memcpy if "HtoD" in n]
    dtod = [n for n in memcpy if "DtoD" in n]
    assert not dtod, f"device-to-device copies: {dtod}"
    assert len(dtoh) == 2, f"expected the rows + counts copies only, got {dtoh}"
    assert len(htod) == 1, f"expected the one staging upload, got {htod}"


def test_bucket_padding_three_in_four(gpu, sample_model_dir, meta, frames):
    pipe = gpu.make_pipeline(sample_model_dir, meta, "fp32", max_batch=4, in_flight=1)
    try:
        items = [frames["bus"], frames["zidane"], frames["bus_small"]]
        pipe.run([*items, frames["zidane_huge"]], DetectParams())  # slot 3 of bucket 4 once held an image
        batched = gpu.detect(pipe, items)
        run = pipe.run(items, DetectParams())
        assert (run.facts.bucket, run.facts.batch) == (4, 3)
        assert sorted(pipe.slots[0].graphs.by_batch) == [4]
        # The padding slot read no pixels: its engine input is pure padding.
        pad = torch.full((3, 640, 640), 114 / 255, dtype=pipe.inputs.tensor.dtype, device=pipe.inputs.tensor.device)
        assert torch.equal(pipe.inputs.tensor[3], pad)
        for name, det, frame in zip(["bus", "zidane", "bus_small"], batched, items):
            (single,) = gpu.detect(pipe, [frame])
            assert len(det) == len(single) and len(det) > 0, name
            assert np.diag(box_iou(det.boxes, single.boxes)).min() >= 0.999, name
    finally:
        pipe.close()
        pipe.close()  # idempotent


@pytest.mark.parametrize(
    "params",
    [
        DetectParams(conf=0.25, iou=0.7),
        DetectParams(conf=0.05, iou=0.5),
        DetectParams(conf=0.6, iou=0.7),
        DetectParams(conf=0.01, iou=0.7, max_det=3),
        DetectParams(conf=0.01, iou=0.45, classes=(1,)),
        DetectParams(conf=0.01, iou=0.3, agnostic=True),
    ],
    ids=["default", "low-conf", "high-conf", "max-det-3", "class-1", "agnostic"],
)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_params_across_replays_equal_numpy_nms(request, gpu, precision, params, frames):
    """Same graph, other params: rows are bit-equal to the NumPy NMS of the graph's own head."""
    pipe = request.getfixturevalue("pipe32" if precision == "fp32" else "pipe16")
    out = pipe.run([frames["bus"], frames["zidane"]], params)
    head = gpu.slot_of(pipe, out).graphs.get(2).head.float().cpu().numpy()
    for j, (rows, _) in enumerate(out.images):
        np.testing.assert_array_equal(rows, nms_numpy(head[j], params), err_msg=f"image {j}")


def test_max_det_over_capacity_is_refused(pipe32, frames):
    with pytest.raises(InvalidParameter):
        pipe32.run([frames["bus"]], DetectParams(max_det=pipe32.max_det + 1))


def test_input_buffer_is_the_letterboxed_image(pipe16, frames):
    """What the graph's letterbox wrote into the engine input equals the CPU reference."""
    from app.imaging.letterbox import letterbox, to_input

    items = [frames["zidane"], frames["bus_small"]]
    pipe16.run(items, DetectParams())
    got = pipe16.inputs.tensor[:2].float().cpu().numpy()
    ref = to_input([letterbox(f, pipe16.size)[0] for f in items]).astype(np.float16).astype(np.float32)
    assert np.abs(got - ref).max() <= 1 / 255 + 1e-3


# ------------------------------------------------------------------------ profiling, dispatch
def test_profile_path_gives_stage_times_and_same_rows(gpu, pipe32, frames, assets_dir):
    items = [frames["bus"], gpu.jpeg((assets_dir / "zidane.jpg").read_bytes())]
    plain = pipe32.run(items, DetectParams())
    profiled = pipe32.diagnose(profile=(items, DetectParams())).profiled
    t = profiled.device_ms
    stages = ("h2d", "preprocess", "engine", "nms", "d2h")
    assert all(t[key] > 0 for key in stages), t  # every stage did GPU work
    # the stages are consecutive events: they add up to the whole, and the engine is the largest
    assert abs(sum(t[key] for key in stages) - t["total"]) < 0.01, t
    assert t["engine"] == max(t[key] for key in stages), t
    assert profiled.facts.launch == "torch" and min(profiled.timings.as_dict().values()) > 0, profiled.timings
    for a, b in zip(plain.images, profiled.images):
        np.testing.assert_array_equal(a[0], b[0])


class _Counting:
    """A driver function that counts its calls and calls through."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "in-flight"])
@pytest.mark.parametrize("kind", ["frames", "jpeg"])
def test_dispatch_is_one_upload_and_one_graph_launch(gpu, pipe32, frames, assets_dir, kind, alone):
    """Per batch the host enqueues exactly one H2D copy and one graph launch, plus the event
    calls that order them: alone, the upload goes on the compute stream (no event); with other
    batches in flight, on the copy stream (an event, and the compute stream waits for it)."""
    assert pipe32.diagnose().launch_error is None, pipe32.diagnose().launch_error
    items = [frames["bus"], frames["zidane"]] if kind == "frames" else [gpu.jpeg((assets_dir / "bus.jpg").read_bytes())] * 2
    pipe32.run(items, DetectParams())  # captured on some slot; make every slot count
    saved = []
    for slot in pipe32.slots:
        d = slot.dispatch
        saved.append((d, d._memcpy, d._launch, d._wait_event, d._record))
        d._memcpy, d._launch, d._wait_event, d._record = (_Counting(f) for f in saved[-1][1:])
    if not alone:
        pipe32.dispatcher._active += 1  # as if another batch were in flight
    try:
        for _ in range(len(pipe32.slots)):
            last = pipe32.run(items, DetectParams())
        calls = [(d._memcpy.calls, d._launch.calls, d._wait_event.calls, d._record.calls) for d, *_ in saved]
    finally:
        if not alone:
            pipe32.dispatcher._active -= 1
        for d, memcpy, launch, wait_event, record in saved:
            d._memcpy, d._launch, d._wait_event, d._record = memcpy, launch, wait_event, record
    assert last.facts.launch == "driver"
    assert last.facts.upload_on_compute == alone
    decoder_wait = 0 if kind == "frames" else 1  # JPEG: the compute stream waits for the decoder's copies
    expected = (1, 1, decoder_wait, 1) if alone else (1, 1, decoder_wait + 1, 2)  # records: [uploaded,] done
    assert calls == [expected] * len(pipe32.slots), calls
    assert last.facts.dispatch_us > 0 and last.facts.upload_us > 0
    assert pipe32.dispatcher._active == 0


def test_raw_driver_dispatch_is_used_and_equals_torch(gpu, pipe32, frames):
    """Each slot's graph launched by cuGraphLaunch (after cuMemcpyHtoDAsync) and by torch's
    replay: bit-equal rows; the driver path is the one a plain run takes. One run per slot in
    each mode (runs take the slots in turn), the graphs captured before the torch runs, so none
    is captured without its exec handle; each property has its own message (a run cut short by
    a timeout keeps only the first line of a failure)."""
    items = [frames["bus"], frames["zidane"], frames["bus_small"]]  # bucket 4
    params = DetectParams(conf=0.1)
    n = len(pipe32.slots)

    def one_run_per_slot() -> dict[int, tuple[list, str, float]]:
        out = {}
        for _ in range(n):
            run = pipe32.run(items, params)
            out[run.facts.slot] = (gpu.rows_of(run), run.facts.launch, 1.0 if run.facts.launch == "driver" else 0.0)
        assert sorted(out) == list(range(n)), f"runs took slots {sorted(out)}, not each of {n} once"
        return out

    driver = one_run_per_slot()
    paths = {k: (path, raw) for k, (_, path, raw) in driver.items()}
    assert paths == {k: ("driver", 1.0) for k in range(n)}, (paths, pipe32.diagnose().launch_error)
    assert [slot.graphs.get(4).graph_exec is not None for slot in pipe32.slots] == [True] * n
    dispatches = [slot.dispatch for slot in pipe32.slots]
    for slot in pipe32.slots:
        slot.dispatch = None  # the torch path, same graphs and buffers
    try:
        torch_runs = one_run_per_slot()
    finally:
        for slot, d in zip(pipe32.slots, dispatches):
            slot.dispatch = d
    assert {k: (path, raw) for k, (_, path, raw) in torch_runs.items()} == {k: ("torch", 0.0) for k in range(n)}
    again = one_run_per_slot()  # and back: still the driver, still equal
    assert {k: path for k, (_, path, _) in again.items()} == {k: "driver" for k in range(n)}
    for k in range(n):
        for j, (a, b, c) in enumerate(zip(driver[k][0], torch_runs[k][0], again[k][0])):
            np.testing.assert_array_equal(a, b, err_msg=f"slot {k} image {j}: driver vs torch launch of one graph")
            np.testing.assert_array_equal(a, c, err_msg=f"slot {k} image {j}: two driver launches of one graph")
    for k in range(1, n):  # the slots' own captures of the same bucket: the same kernels on the same input
        for j, (a, b) in enumerate(zip(driver[0][0], driver[k][0])):
            np.testing.assert_array_equal(a, b, err_msg=f"image {j}: slot 0's bucket-4 graph vs slot {k}'s")


def test_int8_is_refused(sample_model_dir, meta):
    with pytest.raises(InvalidParameter, match="int8"):
        TorchCudaEngine(sample_model_dir, meta, precision="int8", max_batch=1)


@pytest.mark.slow
def test_torch_compile_engine(gpu, sample_model_dir, meta, frames, pipe16):
    """torch.compile (inductor) builds, caches under model_dir, is captured, and agrees with eager."""
    import torch

    before = "TORCHINDUCTOR_CACHE_DIR" in os.environ
    benchmark_before = torch.backends.cudnn.benchmark
    pipe = gpu.make_pipeline(sample_model_dir, meta, "fp16", compile=True, max_batch=1, in_flight=1)
    try:
        items = [frames["bus"]]
        (det,) = gpu.detect(pipe, items)
        assert pipe.diagnose().compiled, "torch.compile fell back to eager (see the warning above)"
        if not before:  # compiled into the model's folder, and the process's environment left as it was
            assert any((sample_model_dir / "torch-cache" / "inductor").iterdir())
            assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
        assert torch.backends.cudnn.benchmark == benchmark_before  # the engine's setting was for its calls only
        (ref,) = gpu.detect(pipe16, items)
        tp = len(match_pairs(ref.boxes, ref.class_ids, det.boxes, det.class_ids))
        assert f1(tp, len(ref.class_ids), len(det.class_ids)) >= 0.99
    finally:
        pipe.close()

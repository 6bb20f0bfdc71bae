"""GpuPipeline + TorchCudaEngine on a real GPU, against Ultralytics' own predictions.

Skips cleanly without a CUDA GPU. Each test checks one property, so one run on the device says
exactly which part is wrong: fidelity fp32/fp16, JPEG path, zero copy, the profiler trace of a
replay, bucket padding, parameters across replays (rows bit-equal to the NumPy NMS on the
graph's own head output), bad images, the profiling path, torch.compile, the raw CUDA driver
dispatch against torch's, lanes driven by concurrent threads, CPU JPEG decode.
"""

from __future__ import annotations

import os
import threading

import cv2
import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("the Numba CUDA simulator is on: these tests need a real GPU", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from app.backends.torch_cuda import TorchCudaEngine
from app.errors import InvalidImage, InvalidParameter, YolopipeError
from app.gpu.pipeline import GpuPipeline, bucket_sizes
from app.boxes import box_iou, f1, match_counts
from app.boxes import nms_numpy, rows_to_detections
from app.types import DetectParams, ModelMeta

CONF, IOU = 0.25, 0.7
MAX_BATCH = 8


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def meta(sample_model_dir) -> ModelMeta:
    return ModelMeta.load(sample_model_dir / "meta.json")


def _pipeline(model_dir, meta, precision, *, compile=False, max_batch=MAX_BATCH, **kwargs):
    engine = TorchCudaEngine(model_dir, meta, precision=precision, max_batch=max_batch, compile=compile)
    return GpuPipeline(engine, meta, max_batch=max_batch, **kwargs)


@pytest.fixture(scope="module")
def pipe32(sample_model_dir, meta):
    p = _pipeline(sample_model_dir, meta, "fp32")
    yield p
    p.close()


@pytest.fixture(scope="module")
def pipe16(sample_model_dir, meta):
    p = _pipeline(sample_model_dir, meta, "fp16")
    yield p
    p.close()


@pytest.fixture(scope="module")
def frames(assets_dir) -> dict[str, np.ndarray]:
    """bus, zidane, and generated variants: downscaled, upscaled, flipped, gray, stacked."""
    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    zidane = cv2.imread(str(assets_dir / "zidane.jpg"))
    gray = cv2.cvtColor(cv2.cvtColor(zidane, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
    stacked = np.concatenate([cv2.resize(bus, (640, 853)), cv2.resize(zidane, (640, 360))], axis=0)
    return {
        "bus": bus,
        "zidane": zidane,
        "bus_small": cv2.resize(bus, (317, 423), interpolation=cv2.INTER_AREA),
        "zidane_tiny_upscaled": cv2.resize(zidane, (300, 169), interpolation=cv2.INTER_AREA),
        "bus_flipped": np.ascontiguousarray(bus[:, ::-1]),
        "zidane_gray": gray,
        "stacked": stacked,
        "zidane_huge": cv2.resize(zidane, (2560, 1440)),
    }


def ultralytics_predict(model, frame, half):
    r = model.predict(frame, imgsz=640, rect=False, conf=CONF, iou=IOU, quantize="fp16" if half else "fp32", device=0, verbose=False)[0]
    b = r.boxes
    return b.xyxy.cpu().numpy(), b.conf.cpu().numpy(), b.cls.cpu().numpy().astype(int)


def detect(pipe, items, params=None):
    out = pipe.run(items, params or DetectParams(conf=CONF, iou=IOU))
    dets = []
    for o in out:
        if isinstance(o, YolopipeError):
            dets.append(o)
        else:
            rows, lb = o
            dets.append(rows_to_detections(rows, lb))
    return dets


def assert_same_detections(name, ref, det, *, iou_min=0.99, score_tol=1e-3, margin=2e-3):
    """Same boxes one for one (class, IoU, score); a box within ``margin`` of the conf threshold
    may be on either side of it."""
    ref_boxes, ref_scores, ref_cls = ref
    boxes, scores, cls = det.boxes, det.scores, det.class_ids
    ious = box_iou(ref_boxes, boxes) * (ref_cls[:, None] == cls[None, :])
    used = set()
    for i in range(len(ref_cls)):
        j = int(np.argmax(ious[i])) if len(cls) else -1
        if j < 0 or ious[i, j] < iou_min:
            assert ref_scores[i] < CONF + margin, f"{name}: Ultralytics box {i} ({ref_scores[i]:.4f}) has no match"
            continue
        used.add(j)
        assert abs(scores[j] - ref_scores[i]) <= score_tol, f"{name}: score {scores[j]:.5f} vs {ref_scores[i]:.5f}"
    for j in set(range(len(cls))) - used:
        assert scores[j] < CONF + margin, f"{name}: extra box {j} ({scores[j]:.4f}) not in Ultralytics"


# ------------------------------------------------------------------------------- fidelity
def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


def test_fp32_equals_ultralytics(pipe32, ultralytics_model, frames):
    total = 0
    for name, frame in frames.items():
        ref = ultralytics_predict(ultralytics_model, frame, half=False)
        (det,) = detect(pipe32, [frame])
        assert_same_detections(name, ref, det)
        total += len(ref[0])
    assert total >= 8, f"too few reference detections ({total}) for a meaningful comparison"


def test_fp32_batch_equals_single(pipe32, frames):
    items = list(frames.values())
    batched = detect(pipe32, items)
    for name, frame, det in zip(frames, frames.values(), batched):
        (single,) = detect(pipe32, [frame])
        assert len(det) == len(single), name
        if len(det):
            assert np.diag(box_iou(det.boxes, single.boxes)).min() >= 0.999, name
            assert np.abs(det.scores - single.scores).max() <= 2e-4, name  # true fp32 (TF32 off)


def test_fp16_f1_vs_ultralytics(pipe16, ultralytics_model, frames):
    tp = n_ref = n_pred = 0
    for name, frame in frames.items():
        ref_boxes, _, ref_cls = ultralytics_predict(ultralytics_model, frame, half=True)
        (det,) = detect(pipe16, [frame])
        t, r, p = match_counts(ref_boxes, ref_cls, det.boxes, det.class_ids, iou_thr=0.5)
        tp, n_ref, n_pred = tp + t, n_ref + r, n_pred + p
    assert n_ref >= 8
    assert f1(tp, n_ref, n_pred) >= 0.99, f"F1 {f1(tp, n_ref, n_pred):.4f} (tp {tp}, ref {n_ref}, ours {n_pred})"


# ----------------------------------------------------------------------------- JPEG path
def test_jpeg_bytes_equal_frames_of_the_same_pixels(pipe32, assets_dir, frames):
    """Bytes (nvJPEG → CHW RGB staging) and frames made of the very pixels nvJPEG decoded
    (HWC BGR staging) go through different packing and kernel layouts: rows must be equal."""
    from app.gpu.preprocess import decode_jpegs

    _, gen = cv2.imencode(".jpg", frames["zidane_tiny_upscaled"])
    datas = [(assets_dir / "bus.jpg").read_bytes(), (assets_dir / "zidane.jpg").read_bytes(), gen.tobytes()]
    same_pixels = [t.permute(1, 2, 0).cpu().numpy()[..., ::-1].copy() for t in decode_jpegs(datas)]
    out_bytes = pipe32.run(datas, DetectParams())
    out_frames = pipe32.run(same_pixels, DetectParams())
    for i, (a, b) in enumerate(zip(out_bytes, out_frames)):
        assert not isinstance(a, YolopipeError) and not isinstance(b, YolopipeError), (a, b)
        assert a[1] == b[1], f"image {i}: placements differ"
        np.testing.assert_array_equal(a[0], b[0], err_msg=f"image {i}")
    # Mixed in one batch: frames and bytes together.
    mixed = pipe32.run([datas[0], same_pixels[1], datas[2]], DetectParams())
    for i, (m, b) in enumerate(zip(mixed, out_frames)):
        np.testing.assert_array_equal(m[0], b[0], err_msg=f"mixed image {i}")


def test_jpeg_bytes_close_to_opencv_frames(pipe32, assets_dir):
    """nvJPEG and libjpeg round differently; detections still agree (F1 ≥ 0.99 at IoU 0.5)."""
    datas = [(assets_dir / n).read_bytes() for n in ("bus.jpg", "zidane.jpg")]
    cv_frames = [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for d in datas]
    tp = n_ref = n_pred = 0
    for a, b in zip(detect(pipe32, datas), detect(pipe32, cv_frames)):
        t, r, p = match_counts(b.boxes, b.class_ids, a.boxes, a.class_ids)
        tp, n_ref, n_pred = tp + t, n_ref + r, n_pred + p
    assert n_ref > 0 and f1(tp, n_ref, n_pred) >= 0.99


def test_bad_images_fail_alone(pipe32, assets_dir, frames):
    good = (assets_dir / "bus.jpg").read_bytes()
    out = pipe32.run([good, b"\xff\xd8\xff\xe0 corrupt", frames["zidane"], np.zeros((4, 4), np.uint8)], DetectParams())
    assert isinstance(out[1], InvalidImage)
    assert isinstance(out[3], InvalidImage)
    assert len(out[0][0]) > 0 and len(out[2][0]) > 0
    assert pipe32.last_timings["batch"] == 2 and pipe32.last_timings["bucket"] == 2


# --------------------------------------------------------------------------- the graphs
def test_zero_copy_head(pipe32, frames):
    pipe32.run([frames["bus"]], DetectParams())
    captured = pipe32.graphs.get(1)
    assert captured is not None
    head = captured.head
    assert head.is_cuda and tuple(head.shape) == (1, 4 + pipe32.meta.num_classes, pipe32.meta.num_anchors)
    view = pipe32.nms.head_view(head)
    assert view.__cuda_array_interface__["data"][0] == head.data_ptr()
    # The view the graph's NMS launch was given is the one cached for this very pointer.
    pointers = {v.__cuda_array_interface__["data"][0] for v in pipe32.nms._views.values()}
    assert head.data_ptr() in pointers


def test_replay_trace_has_only_the_final_copies(pipe32, frames):
    from torch.profiler import ProfilerActivity, profile

    params = DetectParams()
    pipe32.run([frames["bus"], frames["zidane"]], params)  # capture + params set beforehand
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pipe32.run([frames["bus"], frames["zidane"]], params)
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


def test_bucket_padding_three_in_four(sample_model_dir, meta, frames):
    pipe = _pipeline(sample_model_dir, meta, "fp32", max_batch=4)
    try:
        items = [frames["bus"], frames["zidane"], frames["bus_small"]]
        batched = detect(pipe, items)
        assert pipe.last_timings["bucket"] == 4 and pipe.last_timings["batch"] == 3
        assert sorted(pipe.graphs.by_batch) == [4]
        for name, det, frame in zip(["bus", "zidane", "bus_small"], batched, items):
            (single,) = detect(pipe, [frame])
            assert len(det) == len(single) and len(det) > 0, name
            assert np.diag(box_iou(det.boxes, single.boxes)).min() >= 0.999, name
        # The padded slot's outputs never leak into the results.
        assert len(pipe.run(items, DetectParams())) == 3
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
def test_params_across_replays_equal_numpy_nms(request, precision, params, frames):
    """Same graph, other params: rows are bit-equal to the NumPy NMS of the graph's own head."""
    pipe = request.getfixturevalue("pipe32" if precision == "fp32" else "pipe16")
    items = [frames["bus"], frames["zidane"]]
    out = pipe.run(items, params)
    head = pipe.graphs.get(2).head.float().cpu().numpy()
    for j, (rows, _) in enumerate(out):
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


# ------------------------------------------------------------------------ profiling, misc
def test_profile_path_gives_stage_times_and_same_rows(pipe32, frames, assets_dir):
    items = [frames["bus"], (assets_dir / "zidane.jpg").read_bytes()]
    plain = pipe32.run(items, DetectParams())
    profiled = pipe32.run(items, DetectParams(), profile=True)
    t = pipe32.last_timings
    for key in ("gpu_h2d_ms", "gpu_preprocess_ms", "gpu_engine_ms", "gpu_nms_ms", "gpu_d2h_ms", "gpu_total_ms"):
        assert key in t and t[key] >= 0, (key, t)
    assert t["gpu_engine_ms"] > 0
    print({k: round(v, 4) for k, v in t.items()})
    for a, b in zip(plain, profiled):
        np.testing.assert_array_equal(a[0], b[0])


def test_dispatch_is_timed(pipe32, frames):
    for _ in range(20):
        pipe32.run([frames["bus"]], DetectParams())
    t = pipe32.last_timings
    print(f"batch 1: dispatch {t['dispatch_us']:.1f} us, total {t['total_ms']:.3f} ms, wait {t['wait_ms']:.3f} ms")
    assert t["dispatch_us"] > 0


def _rows(out):
    assert not any(isinstance(o, YolopipeError) for o in out), out
    return [rows for rows, _ in out]


def test_raw_driver_dispatch_is_used_and_equals_torch(pipe32, frames):
    """Same graph launched by cuGraphLaunch (after cuMemcpyHtoDAsync) and by torch's replay:
    bit-equal rows; the driver path is the one a plain run takes."""
    assert pipe32.raw_launch_error is None, pipe32.raw_launch_error
    lane = pipe32.lanes[0]
    items = [frames["bus"], frames["zidane"], frames["bus_small"]]
    params = DetectParams(conf=0.1)
    driver = _rows(pipe32.run(items, params))
    assert pipe32.last_launch_path == "driver" and pipe32.last_timings["raw_launch"] == 1.0
    assert pipe32.graphs.get(4).graph_exec is not None
    launcher = lane.launcher
    lane.launcher = None  # the torch path, same graph and buffers
    try:
        torch_rows = _rows(pipe32.run(items, params))
        assert pipe32.last_launch_path == "torch" and pipe32.last_timings["raw_launch"] == 0.0
    finally:
        lane.launcher = launcher
    again = _rows(pipe32.run(items, params))  # and back: still the driver, still equal
    assert pipe32.last_launch_path == "driver"
    for a, b, c in zip(driver, torch_rows, again):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    for _ in range(20):
        pipe32.run([frames["bus"]], params)
    print(f"driver dispatch at batch 1: {pipe32.last_timings['dispatch_us']:.1f} us")


def test_lanes_two_threads_equal_serial(sample_model_dir, meta, frames, assets_dir):
    """Two threads on a two-lane pipeline at once give the detections of serial runs: frames,
    JPEG bytes (nvJPEG), and a batch of 16 frames (packed by the host pool)."""
    pipe = _pipeline(sample_model_dir, meta, "fp32", max_batch=16, lanes=2)
    try:
        assert pipe.num_lanes == 2
        jpegs = [(assets_dir / n).read_bytes() for n in ("bus.jpg", "zidane.jpg")]
        batches = [
            [frames["bus"], frames["zidane"]],
            [frames["stacked"], frames["bus_small"], frames["zidane_gray"]],
            jpegs,
            [frames["bus"], frames["zidane"], frames["bus_flipped"], frames["zidane_tiny_upscaled"]] * 4,
        ]
        params = DetectParams()
        pipe.warmup([2, 4, 16])
        serial = [_rows(pipe.run(b, params)) for b in batches]
        assert all(lane.graphs.get(16) is not None for lane in pipe.lanes)
        got: dict[tuple[int, int, int], list] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(2, timeout=30)

        def worker(t):
            try:
                start.wait()
                for rep in range(5):
                    for k, b in enumerate(batches):
                        got[(t, rep, k)] = _rows(pipe.run(b, params))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(got) == 2 * 5 * len(batches)
        for (t, rep, k), rows in got.items():
            for j, (a, b) in enumerate(zip(rows, serial[k])):
                assert len(a) == len(b), (t, rep, k, j)
                if len(a):
                    assert np.diag(box_iou(a[:, :4], b[:, :4])).min() >= 0.999, (t, rep, k, j)
                    assert np.abs(a[:, 4] - b[:, 4]).max() <= 2e-4, (t, rep, k, j)
                    np.testing.assert_array_equal(a[:, 5], b[:, 5])
        # 16 frames in one batch (parallel pack) equal each image alone.
        for j, frame in enumerate(batches[3][:4]):
            (single,) = _rows(pipe.run([frame], params))
            a = serial[3][j]
            assert len(a) == len(single) and len(a) > 0
            assert np.diag(box_iou(a[:, :4], single[:, :4])).min() >= 0.999
    finally:
        pipe.close()


def test_cpu_jpeg_decode_equals_opencv_frames(pipe32, assets_dir):
    """jpeg_decode="cpu": bytes decoded by OpenCV in the host pool give exactly the rows of the
    frames decoded by the CPU path's own decoder."""
    from app.imaging.decode import decode_image

    datas = [(assets_dir / n).read_bytes() for n in ("bus.jpg", "zidane.jpg")]
    pipe32.jpeg_decode = "cpu"
    try:
        from_bytes = _rows(pipe32.run(datas, DetectParams()))
        single = _rows(pipe32.run(datas[:1], DetectParams()))  # one image: decoded inline
    finally:
        pipe32.jpeg_decode = "gpu"
    from_frames = _rows(pipe32.run([decode_image(d) for d in datas], DetectParams()))
    for a, b in zip(from_bytes, from_frames):
        np.testing.assert_array_equal(a, b)
    assert len(single[0]) == len(from_bytes[0])
    with pytest.raises(InvalidParameter):
        pipe32.jpeg_decode = "nvimgcodec"


def test_staging_grows_and_graphs_are_recaptured(sample_model_dir, meta, frames):
    pipe = _pipeline(sample_model_dir, meta, "fp32", max_batch=2)
    try:
        small = detect(pipe, [frames["bus"]])  # fits the initial staging (2 × 640² × 3)
        cap = pipe.staging.capacity
        big = detect(pipe, [frames["zidane_huge"], frames["bus"]])  # 11 MB: must grow
        assert pipe.staging.capacity > cap
        again = detect(pipe, [frames["bus"]])
        np.testing.assert_array_equal(small[0].boxes, again[0].boxes)
        assert len(big[1]) == len(small[0])  # bucket 2 vs bucket 1: cuDNN may pick other kernels
        assert np.diag(box_iou(big[1].boxes, small[0].boxes)).min() >= 0.999
    finally:
        pipe.close()


def test_int8_is_refused(sample_model_dir, meta):
    with pytest.raises(InvalidParameter, match="int8"):
        TorchCudaEngine(sample_model_dir, meta, precision="int8", max_batch=1)


@pytest.mark.slow
def test_torch_compile_engine(sample_model_dir, meta, frames, pipe16):
    """torch.compile (inductor) builds, caches under model_dir, is captured, and agrees with eager."""
    before = "TORCHINDUCTOR_CACHE_DIR" in os.environ
    pipe = _pipeline(sample_model_dir, meta, "fp16", compile=True, max_batch=1)
    try:
        items = [frames["bus"]]
        (det,) = detect(pipe, items)
        assert pipe.engine.compiled, "torch.compile fell back to eager (see the warning above)"
        if not before:
            assert (sample_model_dir / "torch-cache").is_dir()
        (ref,) = detect(pipe16, items)
        t, r, p = match_counts(ref.boxes, ref.class_ids, det.boxes, det.class_ids)
        assert f1(t, r, p) >= 0.99
    finally:
        pipe.close()

"""app.gpu.nms on a real NVIDIA GPU: full-size randomized equality, zero copy, CUDA graphs.

Skipped cleanly without a CUDA GPU (or when the Numba simulator is on). The references run on
the CPU: ``nms_numpy`` (rows bit for bit, same order) and torchvision's CPU NMS (keep sets).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from numba import cuda

from app.boxes import MAX_WH, head_candidates, nms_numpy
from app.contracts import DetectParams
from app.gpu.nms import GpuNms

tv_ops = pytest.importorskip("torchvision.ops")
pytestmark = pytest.mark.requires_gpu  # also skipped when app.gpu.nms runs under the simulator

A = 8400  # YOLOv8 at 640: 80*80 + 40*40 + 20*20
N_CASES = int(os.environ.get("YOLOPIPE_NMS_CASES", "1000"))


def make_head(rng, batch, nc, anchors=A, *, n_obj=30, quantize=True, size=640.0):
    """Head output [B, 4 + nc, A] like a real one: most boxes jittered around 30 objects
    (heavy overlap), the rest spread over the image; low background scores (a fraction above
    0.001), high object scores, scores rounded to 2 decimals on half the anchors (ties), some
    exact duplicate boxes. ``quantize``: coordinates on a 1/4 px grid, so every class offset
    and area is exact and any NMS offset scheme (torchvision's batched_nms) gives equal IoUs."""
    head = np.empty((batch, 4 + nc, anchors), np.float32)
    for b in range(batch):
        centers = rng.uniform(0.05 * size, 0.95 * size, (n_obj, 2))
        sides = rng.uniform(6.0, 0.35 * size, (n_obj, 2))
        obj = rng.integers(0, n_obj, anchors)
        xy = centers[obj] + rng.normal(0.0, 4.0, (anchors, 2))
        wh = sides[obj] * rng.uniform(0.8, 1.2, (anchors, 2))
        spread = rng.random(anchors) < 0.3
        xy[spread] = rng.uniform(0.0, size, (spread.sum(), 2))
        wh[spread] = rng.uniform(4.0, 0.35 * size, (spread.sum(), 2))
        if quantize:
            xy, wh = np.round(xy * 4) / 4, np.round(wh * 2) / 2
        dup = rng.random(anchors) < 0.05
        src = rng.integers(0, anchors, anchors)
        xy[dup], wh[dup] = xy[src[dup]], wh[src[dup]]
        head[b, 0:2] = xy.T
        head[b, 2:4] = wh.T
        level = rng.uniform(0.0, 0.0012, anchors).astype(np.float32)  # background noise level
        scores = rng.random((nc, anchors), dtype=np.float32) * level
        obj_cls = rng.integers(0, nc, n_obj)
        hot = (~spread) & (rng.random(anchors) < 0.3)
        scores[obj_cls[obj[hot]], np.nonzero(hot)[0]] = rng.uniform(0.01, 1.0, hot.sum())
        tie = rng.random(anchors) < 0.5
        scores[:, tie] = np.round(scores[:, tie], 2)
        head[b, 4:] = scores
    return head


def assert_rows_equal(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def torchvision_keep(pred, params, *, batched):
    """Anchors torchvision keeps on the reference candidates (CPU), cut to max_det in stable
    (score desc, anchor asc) order. ``batched``: torchvision.ops.batched_nms (exact only for
    quantized boxes); else torchvision.ops.nms on Ultralytics' offset boxes (exact always)."""
    boxes, scores, cls, anchor_idx = head_candidates(pred, params.conf, params.classes)
    if len(scores) == 0:
        return np.zeros(0, np.int64)
    t_boxes, t_scores = torch.from_numpy(boxes), torch.from_numpy(scores)
    if params.agnostic:
        idxs = torch.zeros(len(cls), dtype=torch.int64)
    else:
        idxs = torch.from_numpy(cls.astype(np.int64))
    iou = params.iou  # the same double threshold: the kernels reproduce torchvision's comparison
    if batched:
        keep = tv_ops.batched_nms(t_boxes, t_scores, idxs, iou).numpy()
    else:
        offset = torch.zeros_like(t_scores) if params.agnostic else idxs.to(torch.float32) * float(MAX_WH)
        keep = tv_ops.nms(t_boxes + offset[:, None], t_scores, iou).numpy()
    keep = keep[np.lexsort((anchor_idx[keep], -scores[keep]))][: params.max_det]
    return anchor_idx[keep]


@pytest.fixture(scope="module")
def nms_by_nc():
    made = {nc: GpuNms(16, nc, A, max_det=300) for nc in (1, 2, 80)}
    yield made
    for nms in made.values():
        nms.free()


def _case(seed):
    rng = np.random.default_rng(1000 + seed)
    nc = (1, 2, 80)[seed % 3]
    batch = int(rng.choice([1, 1, 1, 2, 2, 3, 4, 8, 16]))
    params = DetectParams(
        conf=float(rng.choice([0.001, 0.25])),
        iou=float(rng.choice([0.45, 0.5, 0.6, 0.7])),
        max_det=int(rng.choice([300, 300, 100, 10])),
        classes=None if rng.random() < 0.8 else tuple(int(c) for c in rng.choice(nc, max(1, nc // 2), replace=False)),
        agnostic=bool(rng.random() < 0.2),
    )
    quantize = bool(rng.random() < 0.5)
    dtype = torch.float16 if rng.random() < 0.2 else torch.float32
    return rng, nc, batch, params, quantize, dtype


def test_randomized_cases_match_references(nms_by_nc):
    stream = cuda.stream()
    failures = []
    for seed in range(N_CASES):
        rng, nc, batch, params, quantize, dtype = _case(seed)
        host = make_head(rng, batch, nc, quantize=quantize)
        head = torch.from_numpy(host).to("cuda", dtype)
        torch.cuda.synchronize()  # the numba stream below is not ordered after torch's
        ref_head = head.float().cpu().numpy()  # the float16 case: the values the kernels saw
        nms = nms_by_nc[nc]
        nms.set_params(params.conf, params.iou, params.max_det, params.classes, params.agnostic, stream=stream)
        nms.run(head, batch, stream)
        rows = nms.results(batch, stream=stream)
        anchors = nms.out_anchor.copy_to_host()
        counts = nms.out_count.copy_to_host()
        for b in range(batch):
            try:
                assert_rows_equal(rows[b], nms_numpy(ref_head[b], params))
                want = torchvision_keep(ref_head[b], params, batched=quantize)
                assert set(anchors[b, : counts[b]].tolist()) == set(want.tolist())
            except AssertionError as exc:
                failures.append(f"seed={seed} nc={nc} b={b}/{batch} {params} quantize={quantize} {dtype}: {exc}")
        assert len(failures) < 5, "\n".join(failures)
    assert not failures, "\n".join(failures)


def test_zero_copy_view_of_torch_tensor():
    host = make_head(np.random.default_rng(1), 2, 2)
    head = torch.from_numpy(host).cuda()
    with GpuNms(2, 2, A) as nms:
        view = nms.head_view(head)
        assert view.device_ctypes_pointer.value == head.data_ptr()
        assert view.__cuda_array_interface__["data"][0] == head.data_ptr()
        assert nms.head_view(head) is view  # made once, cached on the pointer
        params = DetectParams(conf=0.25, iou=0.5)
        nms.set_params(params.conf, params.iou)
        nms.run(head, 2)
        first = nms.results(2)
        # change the tensor in place: the kernels must see the new values (no stale copy)
        head[:, 4:] = torch.flip(head[:, 4:], dims=[2])
        torch.cuda.synchronize()
        nms.run(head, 2)
        second = nms.results(2)
        new_host = head.cpu().numpy()
        for b in range(2):
            assert_rows_equal(first[b], nms_numpy(host[b], params))
            assert_rows_equal(second[b], nms_numpy(new_host[b], params))


def test_cuda_graph_capture_and_replay_with_new_params():
    B, nc = 4, 80
    rng = np.random.default_rng(2)
    head = torch.empty((B, 4 + nc, A), device="cuda", dtype=torch.float32)
    head.copy_(torch.from_numpy(make_head(rng, B, nc)))
    with GpuNms(B, nc, A, max_det=300) as nms:
        # warm up (compile and load every kernel) on a side stream, as torch asks before capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ns = cuda.external_stream(side.cuda_stream)
            nms.set_params(stream=ns)
            nms.run(head, B, ns)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            nms.run(head, B, cuda.external_stream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()

        cases = [
            DetectParams(conf=0.25, iou=0.7),
            DetectParams(conf=0.001, iou=0.45, max_det=100),
            DetectParams(conf=0.1, iou=0.5, classes=(0, 3, 7), agnostic=True),
            DetectParams(conf=0.5, iou=0.6, max_det=7),
        ]
        for i, params in enumerate(cases):
            host = make_head(rng, B, nc, quantize=bool(i % 2))
            head.copy_(torch.from_numpy(host))  # same buffer, new image data
            stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
            nms.set_params(params.conf, params.iou, params.max_det, params.classes, params.agnostic, stream=stream)
            graph.replay()
            torch.cuda.synchronize()
            rows = nms.results(B)
            for b in range(B):
                assert_rows_equal(rows[b], nms_numpy(host[b], params))
        graph.reset()


def test_capacity_overflow_full_size():
    rng = np.random.default_rng(3)
    host = make_head(rng, 2, 80)
    params = DetectParams(conf=0.001, iou=0.7)
    cap = 1024
    with GpuNms(2, 80, A, candidate_capacity=cap) as nms:
        nms.set_params(params.conf, params.iou)
        nms.run(torch.from_numpy(host).cuda(), 2)
        rows = nms.results(2)
        totals = nms.num_candidates.copy_to_host()
    for b in range(2):
        _, scores, _, anchor_idx = head_candidates(host[b], params.conf)
        assert totals[b] == len(anchor_idx) > cap
        dropped = anchor_idx[np.argsort(-scores, kind="stable")[cap:]]
        clipped = host[b].copy()
        clipped[4:, dropped] = 0.0
        assert_rows_equal(rows[b], nms_numpy(clipped, params))


def _run_and_check(nms, host, params, batch):
    head = torch.from_numpy(host).cuda()
    nms.set_params(params.conf, params.iou, params.max_det, params.classes, params.agnostic)
    nms.run(head, batch)
    rows = nms.results(batch)
    totals = nms.num_candidates.copy_to_host()
    for b in range(batch):
        assert totals[b] == len(head_candidates(host[b], params.conf, params.classes)[1])
        assert_rows_equal(rows[b], nms_numpy(host[b], params))
    # the last kernel leaves the counters zero for the next run (there is no reset launch)
    assert not nms.cand_count.copy_to_host().any()
    assert not nms.tickets.copy_to_host().any()


@pytest.mark.parametrize("nc", [2, 80])
def test_every_anchor_a_candidate(nc):
    """The worst case: all 8,400 anchors above conf, capacity 8,400 (132 x 132 words of mask,
    every rank chunk and every IoU tile in use)."""
    rng = np.random.default_rng(4 + nc)
    host = make_head(rng, 3, nc)
    for b in range(3):  # every anchor: one class scored 0.3 .. 1.0, on 2 decimals for half (ties)
        score = rng.uniform(0.3, 1.0, A)
        score[::2] = np.round(score[::2], 2)
        host[b, 4 + rng.integers(0, nc, A), np.arange(A)] = score
    with GpuNms(3, nc, A, max_det=300) as nms:
        _run_and_check(nms, host, DetectParams(conf=0.25, iou=0.7), 3)
        _run_and_check(nms, host, DetectParams(conf=0.25, iou=0.45, agnostic=True), 3)


@pytest.mark.parametrize("grid", [(1, 1), (3, 7)], ids=["one-block-per-image", "few-blocks"])
def test_small_grids_full_size(grid):
    """Fewer blocks than chunks and tiles: the block-stride loops and the last-block handoff on
    the real GPU, with ~2,000 candidates per image."""
    rng = np.random.default_rng(6)
    host = make_head(rng, 4, 2)
    with GpuNms(4, 2, A, max_det=300) as nms:
        nms._grid_blocks = lambda batch: grid  # instead of the SM-count based sizes
        _run_and_check(nms, host, DetectParams(conf=0.001, iou=0.7), 4)
        _run_and_check(nms, host, DetectParams(conf=0.001, iou=0.5, max_det=100), 2)


def test_graph_replays_batch16_low_conf_exact():
    """Batch 16, conf 0.001, ~130 candidates per image (what the sample model gives), capacity
    8,400, replayed from a CUDA graph many times: rows stay exact. (Its speed is measured by
    ``yolopipe bench`` (app/benchmark/nms.py), not asserted here.)"""
    B, nc, per_image = 16, 2, 130
    rng = np.random.default_rng(7)
    host = make_head(rng, B, nc)
    for b in range(B):  # keep the scores of `per_image` clustered anchors only
        keep = rng.choice(A, per_image, replace=False)
        scores = host[b, 4:, keep].copy()
        host[b, 4:] = 0.0
        host[b, 4:, keep] = np.maximum(scores, np.float32(0.0011))
    params = DetectParams(conf=0.001, iou=0.7)
    head = torch.from_numpy(host).cuda()
    stream = torch.cuda.Stream()
    ns = cuda.external_stream(stream.cuda_stream)
    with GpuNms(B, nc, A, max_det=300) as nms:
        nms.set_params(params.conf, params.iou, stream=ns)
        with torch.cuda.stream(stream):
            for _ in range(2):
                nms.run(head, B, ns)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                nms.run(head, B, ns)
            for _ in range(50):
                graph.replay()
            stream.synchronize()
        rows = nms.results(B)
        graph.reset()
    for b in range(B):
        assert_rows_equal(rows[b], nms_numpy(host[b], params))


"""app.gpu.nms kernels against the NumPy reference and torchvision, in the CUDA simulator.

Sizes are tiny on purpose: the simulator runs every CUDA thread as a Python thread.
``tests/kernels/conftest.py`` turns the simulator on unless YOLOPIPE_REAL_GPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.pipeline.postprocess import head_candidates, nms_numpy
from app.types import DetectParams

cuda = pytest.importorskip("numba.cuda")
from app.gpu.nms import GpuNms  # noqa: E402


def make_head(rng, batch, nc, anchors, *, n_obj=4, quantize=True, size=640.0):
    """Realistic-ish head output [B, 4 + nc, A]: boxes jittered around a few objects (many
    overlaps), background scores low, object scores high, some scores rounded to 2 decimals
    (ties) and some boxes duplicated exactly. ``quantize`` puts coordinates on a 1/4 px grid
    so class offsets are exact and torchvision's batched_nms offsets give the same IoUs."""
    head = np.zeros((batch, 4 + nc, anchors), np.float32)
    for b in range(batch):
        centers = rng.uniform(0.1 * size, 0.9 * size, (n_obj, 2))
        sides = rng.uniform(8.0, 0.3 * size, (n_obj, 2))
        obj = rng.integers(0, n_obj, anchors)
        xy = centers[obj] + rng.normal(0.0, 3.0, (anchors, 2))
        wh = sides[obj] * rng.uniform(0.85, 1.15, (anchors, 2))
        if quantize:
            xy, wh = np.round(xy * 4) / 4, np.round(wh * 2) / 2
        dup = rng.random(anchors) < 0.15  # exact duplicates of another anchor's box
        src = rng.integers(0, anchors, anchors)
        xy[dup], wh[dup] = xy[src[dup]], wh[src[dup]]
        head[b, 0:2] = xy.T
        head[b, 2:4] = wh.T
        scores = rng.uniform(0.0, 0.3, (nc, anchors))
        obj_cls = rng.integers(0, nc, n_obj)
        hot = rng.random(anchors) < 0.6
        scores[obj_cls[obj[hot]], np.nonzero(hot)[0]] = rng.uniform(0.3, 1.0, hot.sum())
        tie = rng.random(anchors) < 0.5
        scores[:, tie] = np.round(scores[:, tie], 2)
        head[b, 4:] = scores
    return head


def run_gpu(head, params, *, capacity=None, max_det_buf=None, batch=None, nms=None):
    B, rows, A = head.shape
    nc = rows - 4
    own = nms is None
    if own:
        nms = GpuNms(B, nc, A, max_det=max_det_buf or max(params.max_det, 1), candidate_capacity=capacity)
    try:
        d_head = cuda.to_device(head)
        nms.set_params(params.conf, params.iou, params.max_det, params.classes, params.agnostic)
        nb = B if batch is None else batch
        nms.run(d_head, nb)
        rows_out = nms.results(nb)
        anchors = nms.out_anchor.copy_to_host()
        counts = nms.out_count.copy_to_host()
        totals = nms.num_candidates.copy_to_host()
        return rows_out, [anchors[b, : counts[b]] for b in range(nb)], totals[:nb]
    finally:
        if own:
            nms.free()


def assert_rows_equal(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    # bitwise: same floats, same order
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def torchvision_keep(pred, params):
    """Anchors kept by torchvision.ops.batched_nms on the reference candidates, truncated to
    max_det in the stable (score desc, anchor asc) order."""
    torch = pytest.importorskip("torch")
    tv = pytest.importorskip("torchvision")
    boxes, scores, cls, anchor_idx = head_candidates(pred, params.conf, params.classes)
    if len(scores) == 0:
        return np.zeros(0, np.int64)
    idxs = torch.zeros(len(cls), dtype=torch.int64) if params.agnostic else torch.from_numpy(cls.astype(np.int64))
    iou = float(np.float32(params.iou))  # the reference's float32 threshold (see the last test)
    keep = tv.ops.batched_nms(torch.from_numpy(boxes), torch.from_numpy(scores), idxs, iou).numpy()
    keep = keep[np.lexsort((anchor_idx[keep], -scores[keep]))][: params.max_det]
    return anchor_idx[keep]


def check(head, params, **kw):
    rows, anchors, totals = run_gpu(head, params, **kw)
    for b in range(len(rows)):
        assert_rows_equal(rows[b], nms_numpy(head[b], params))
        want = torchvision_keep(head[b].astype(np.float32), params)
        assert set(anchors[b].tolist()) == set(want.tolist())
        # scores in descending order; where distinct, the same order as torchvision
        assert np.all(np.diff(rows[b][:, 4]) <= 0)
        if len(np.unique(rows[b][:, 4])) == len(rows[b]):
            np.testing.assert_array_equal(anchors[b], want)
    return rows, anchors, totals


@pytest.mark.parametrize(
    "nc, params, seed",
    [
        (1, DetectParams(conf=0.25, iou=0.5, max_det=300), 0),
        (3, DetectParams(conf=0.25, iou=0.45, max_det=300), 1),
        (3, DetectParams(conf=0.1, iou=0.3, max_det=300, agnostic=True), 2),
        (3, DetectParams(conf=0.1, iou=0.5, max_det=300, classes=(0, 2)), 3),
        (2, DetectParams(conf=0.001, iou=0.7, max_det=300), 4),
    ],
    ids=["one-class", "several-classes", "agnostic", "class-filter", "low-conf"],
)
def test_matches_reference(nc, params, seed):
    rng = np.random.default_rng(seed)
    head = make_head(rng, 2, nc, 64)
    rows, _, _ = check(head, params)
    assert sum(len(r) for r in rows) > 2  # the case exercises something


def test_unquantized_boxes_bit_exact():
    # arbitrary float32 coordinates: rows must still match the NumPy reference bit for bit
    rng = np.random.default_rng(11)
    head = make_head(rng, 2, 3, 64, quantize=False)
    params = DetectParams(conf=0.2, iou=0.5)
    rows, _, _ = run_gpu(head, params)
    for b in range(2):
        assert_rows_equal(rows[b], nms_numpy(head[b], params))


def test_several_words_cross_word_suppression():
    # > 64 candidates: the removed bitset spans several words
    rng = np.random.default_rng(5)
    head = make_head(rng, 1, 2, 150, n_obj=3)
    check(head, DetectParams(conf=0.05, iou=0.5))


def test_ties_identical_boxes_keep_lowest_anchor():
    A = 16
    head = np.zeros((1, 6, A), np.float32)
    head[0, 0:4] = np.array([100, 100, 50, 40], np.float32)[:, None]  # all boxes identical
    head[0, 4] = 0.5  # all scores equal, class 0 (first max wins over class 1's equal score)
    head[0, 5] = 0.5
    rows, anchors, _ = check(head, DetectParams(conf=0.25, iou=0.5))
    assert anchors[0].tolist() == [0]
    assert rows[0][0, 5] == 0.0
    # per class: two classes each keep their lowest anchor
    head[0, 5, 8:] = 0.6
    rows, anchors, _ = check(head, DetectParams(conf=0.25, iou=0.5))
    assert anchors[0].tolist() == [8, 0]


def test_equal_scores_overlapping_chain():
    # equal scores: stable order decides; chain a-b-c where a suppresses b, b would suppress c
    head = np.zeros((1, 5, 3), np.float32)
    head[0, 0] = [100.0, 110.0, 120.0]
    head[0, 1] = 100.0
    head[0, 2] = 20.0
    head[0, 3] = 20.0
    head[0, 4] = 0.9
    _, anchors, _ = check(head, DetectParams(conf=0.25, iou=0.3))
    assert anchors[0].tolist() == [0, 2]  # greedy; Fast-NMS would drop 2 as well


def test_empty_image_and_empty_batch_member():
    rng = np.random.default_rng(7)
    head = make_head(rng, 2, 2, 32)
    head[1, 4:] = 0.0  # no candidates in image 1
    rows, anchors, totals = check(head, DetectParams(conf=0.25, iou=0.5))
    assert len(rows[0]) > 0 and len(rows[1]) == 0 and totals[1] == 0
    rows, _, totals = check(head, DetectParams(conf=0.999, iou=0.5))  # nothing above conf
    assert all(len(r) == 0 for r in rows) and totals.tolist() == [0, 0]


def test_max_det_truncation():
    rng = np.random.default_rng(8)
    head = make_head(rng, 1, 2, 64, n_obj=12)
    full, _, _ = run_gpu(head, DetectParams(conf=0.05, iou=0.9))
    assert len(full[0]) > 5
    rows, _, _ = check(head, DetectParams(conf=0.05, iou=0.9, max_det=5), max_det_buf=300)
    assert_rows_equal(rows[0], full[0][:5])
    rows, _, _ = check(head, DetectParams(conf=0.05, iou=0.9, max_det=0), max_det_buf=300)
    assert len(rows[0]) == 0


def test_capacity_overflow_keeps_highest_and_reports():
    rng = np.random.default_rng(9)
    head = make_head(rng, 1, 2, 64, n_obj=6)
    params = DetectParams(conf=0.1, iou=0.5)
    cap = 8
    _, scores_all, _, anchor_idx = head_candidates(head[0], params.conf)
    assert len(anchor_idx) > cap
    rows, _, totals = run_gpu(head, params, capacity=cap)
    assert totals[0] == len(anchor_idx)  # total before clipping: > capacity means overflow
    # expected: the reference over the `cap` best candidates (stable score order) only
    order = np.argsort(-scores_all, kind="stable")
    dropped = anchor_idx[order[cap:]]
    clipped = head.copy()
    clipped[0, 4:, dropped] = 0.0
    assert_rows_equal(rows[0], nms_numpy(clipped[0], params))


def test_float16_head():
    rng = np.random.default_rng(10)
    head = make_head(rng, 2, 3, 64).astype(np.float16)
    params = DetectParams(conf=0.25, iou=0.5)
    rows, _, _ = run_gpu(head, params)
    for b in range(2):
        assert_rows_equal(rows[b], nms_numpy(head[b], params))  # reference upcasts to float32


def test_params_change_between_runs_and_partial_batch():
    rng = np.random.default_rng(12)
    head = make_head(rng, 2, 3, 48)
    with GpuNms(2, 3, 48, max_det=300) as nms:
        for params in (DetectParams(conf=0.3, iou=0.5), DetectParams(conf=0.1, iou=0.6, classes=(1,), agnostic=True)):
            rows, _, _ = run_gpu(head, params, nms=nms)
            for b in range(2):
                assert_rows_equal(rows[b], nms_numpy(head[b], params))
        rows, _, _ = run_gpu(head, DetectParams(conf=0.3, iou=0.5), nms=nms, batch=1)
        assert len(rows) == 1
        assert_rows_equal(rows[0], nms_numpy(head[0], DetectParams(conf=0.3, iou=0.5)))


def test_free_is_idempotent_and_validates():
    nms = GpuNms(1, 2, 16, max_det=10)
    with pytest.raises(ValueError):
        nms.set_params(max_det=11)
    with pytest.raises(ValueError):
        GpuNms(1, 2, 16, candidate_capacity=0)
    nms.free()
    nms.free()
    with pytest.raises(RuntimeError):
        nms.run(cuda.to_device(np.zeros((1, 6, 16), np.float32)), 1)


def test_iou_threshold_compares_like_torchvision():
    """An IoU of exactly float32(0.6): torchvision compares it with the *double* 0.6 and
    float32(0.6) > 0.6, so it suppresses the second box. The reference and the kernels agree
    (the threshold goes to the device rounded down to float32, see ``iou_threshold_f32``)."""
    torch = pytest.importorskip("torch")
    tv = pytest.importorskip("torchvision")
    head = np.zeros((1, 5, 2), np.float32)
    head[0, :4, 0] = [5, 5, 10, 10]  # xyxy 0,0,10,10: area 100
    head[0, :4, 1] = [5, 3, 10, 6]  # xyxy 0,0,10,6: area 60, inside the first: IoU = 60/100
    head[0, 4] = [0.9, 0.8]
    params = DetectParams(conf=0.25, iou=0.6)
    rows, anchors, _ = run_gpu(head, params)
    assert_rows_equal(rows[0], nms_numpy(head[0], params))
    boxes = torch.tensor([[0, 0, 10, 10], [0, 0, 10, 6]], dtype=torch.float32)
    assert tv.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.6).tolist() == [0]
    assert anchors[0].tolist() == [0]

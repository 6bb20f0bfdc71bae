"""app.gpu.nms kernels against the NumPy reference and torchvision, in the CUDA simulator.

Sizes are tiny on purpose: the simulator runs every CUDA thread as a Python thread.
``tests/conftest.py`` turns the simulator on unless YOLOPIPE_REAL_GPU=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from app.boxes import head_candidates, iou_one_to_many, nms_numpy
from app.contracts import DetectParams

cuda = pytest.importorskip("numba.cuda")
from app.gpu.nms import WORD_BITS, GpuNms  # noqa: E402


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


def suppressed_only_across_words(pred, params) -> int:
    """Candidates the reference drops only because of kept boxes in an earlier 64-candidate word
    of the score order (none in their own word): what only the removed bitset's later words carry."""
    boxes, scores, cls, anchor_idx = head_candidates(pred, params.conf, params.classes)
    order = np.lexsort((anchor_idx, -scores))  # the kernel's order: score desc, anchor asc
    boxes, cls, anchor_idx = boxes[order], cls[order], anchor_idx[order]
    kept = np.isin(anchor_idx, torchvision_keep(pred, params))
    count = 0
    for j in np.nonzero(~kept)[0]:
        earlier = np.nonzero(kept[:j] & ((cls[:j] == cls[j]) | params.agnostic))[0]
        hits = earlier[iou_one_to_many(boxes[j], boxes[earlier]) > np.float32(params.iou)]
        count += len(hits) > 0 and all(i // WORD_BITS < j // WORD_BITS for i in hits)
    return count


def test_several_words_cross_word_suppression():
    # > 64 candidates: the removed bitset spans several words, and some suppressions cross them
    rng = np.random.default_rng(5)
    head = make_head(rng, 1, 2, 150, n_obj=3)
    params = DetectParams(conf=0.05, iou=0.5)
    _, _, totals = check(head, params)
    assert totals[0] > 2 * WORD_BITS, totals
    assert suppressed_only_across_words(head[0], params) > 0


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


@pytest.mark.parametrize("grid", [(1, 1), (2, 3)], ids=["one-block-per-image", "few-blocks"])
def test_block_stride_loops_with_small_grids(grid):
    """Fewer blocks than work: every block-stride loop (rank chunks, IoU tiles) iterates, and
    the ticket handoff to the last mask block still happens exactly once per image."""
    rng = np.random.default_rng(13)
    head = make_head(rng, 2, 2, 150, n_obj=3)
    params = DetectParams(conf=0.05, iou=0.5)
    with GpuNms(2, 2, 150, max_det=300) as nms:
        nms._grid_blocks = lambda batch: grid  # instead of the SM-count based sizes
        rows, _, totals = run_gpu(head, params, nms=nms)
        counters = nms.cand_count.copy_to_host(), nms.tickets.copy_to_host()
    for b in range(2):
        n = len(head_candidates(head[b], params.conf)[1])
        assert n > 64  # several IoU tile rows and rank chunks
        assert totals[b] == n
        assert_rows_equal(rows[b], nms_numpy(head[b], params))
    assert counters[0].tolist() == [0, 0] and counters[1].tolist() == [0, 0]


def test_counters_are_zero_after_each_run_and_runs_repeat():
    """The last kernel zeroes the candidate and ticket counters (there is no reset launch):
    the same run twice gives the same rows and counts, then a smaller batch still does."""
    rng = np.random.default_rng(14)
    head = make_head(rng, 2, 3, 64)
    params = DetectParams(conf=0.2, iou=0.5)
    want_totals = [len(head_candidates(head[b], params.conf)[1]) for b in range(2)]
    with GpuNms(2, 3, 64) as nms:
        for batch in (2, 2, 1):
            rows, _, totals = run_gpu(head, params, nms=nms, batch=batch)
            assert totals.tolist() == want_totals[:batch]
            for b in range(batch):
                assert_rows_equal(rows[b], nms_numpy(head[b], params))
            assert not nms.cand_count.copy_to_host().any()
            assert not nms.tickets.copy_to_host().any()


def test_failed_launch_does_not_poison_the_next_run(monkeypatch):
    """If a run stops after the candidate kernel (say the next kernel fails to compile), the
    counters hold that run's count: the next run must zero them before counting again."""
    import app.gpu.nms as nms_module

    rng = np.random.default_rng(15)
    head = make_head(rng, 1, 2, 64)
    params = DetectParams(conf=0.2, iou=0.5)

    class Broken:
        def __getitem__(self, config):
            def launch(*args):
                raise RuntimeError("simulated launch failure")

            return launch

    with GpuNms(1, 2, 64) as nms:
        real = nms_module._mask_suppress
        monkeypatch.setattr(nms_module, "_mask_suppress", Broken())
        with pytest.raises(RuntimeError, match="simulated"):
            run_gpu(head, params, nms=nms)
        assert nms.cand_count.copy_to_host()[0] > 0  # the candidate kernel did run
        monkeypatch.setattr(nms_module, "_mask_suppress", real)
        rows, _, totals = run_gpu(head, params, nms=nms)
        assert totals[0] == len(head_candidates(head[0], params.conf)[1])
        assert_rows_equal(rows[0], nms_numpy(head[0], params))


def test_kernels_compile_for_the_real_target():
    """The simulator types nothing like NVVM does (libdevice calls, integer/float widths,
    shared arrays): compile every NMS kernel to PTX for sm_90 in a subprocess without the
    simulator, as the launches type them. Needs no GPU and no driver. Also checks that no
    float32 multiply-add was contracted into an FMA, which would break bit-exactness."""
    if os.environ.get("YOLOPIPE_REAL_GPU") == "1":
        pytest.skip("compile check is for GPU-less CI")
    code = textwrap.dedent(
        """
        import types as pytypes
        import numpy as np
        import numba
        from numba import cuda
        import numba.cuda.dispatcher as dispatcher
        # Device functions are compiled for the current device's CC, and there is none here.
        dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
        import app.gpu.nms as m

        assert not m.SIMULATOR
        B, nc, A, C, D = 2, 3, 100, 90, 10
        W = (C + 63) // 64
        z = np.zeros
        f32, i32, u64 = np.float32, np.int32, np.uint64
        params_i32 = z(2 + nc, i32)  # GpuNms.class_mask is the view params_i32[2:]
        for head_dtype in (np.float32, np.float16):
            head = z((B, 4 + nc, A), head_dtype)
            launches = {  # the arguments GpuNms.run passes, as NumPy twins of its buffers
                "_clear_counters": (z(B, i32), z(B, i32)),
                "_candidates": (head, nc, z(2, f32), params_i32[2:], z(B, i32),
                                z((B, A), f32), z((B, A), i32), z((B, A), i32)),
                "_rank_decode": (head, z(B, i32), z((B, A), f32), z((B, A), i32), z((B, A), i32),
                                 params_i32, C, z((B, C), f32), z((B, C), i32), z((B, C), i32),
                                 z((B, C, 4), f32), z((B, C, 4), f32)),
                "_mask_suppress": (z(B, i32), z(B, i32), C, z(2, f32), params_i32, z((B, C, 4), f32),
                                   z((B, C, W), u64), z((B, W), u64), z((B, C), f32), z((B, C), i32),
                                   z((B, C), i32), z((B, C, 4), f32), z(B, i32), z((B, D, 6), f32),
                                   z((B, D), i32), z(B, i32)),
            }
            for name, args in launches.items():
                sig = tuple(numba.typeof(a) for a in args)
                ptx, _ = cuda.compile_ptx(getattr(m, name).py_func, sig, cc=(9, 0))
                assert ".entry" in ptx, name
                print(name, np.dtype(head_dtype).name, "fma.rn.f32" in ptx)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 8, proc.stdout
    contracted = [line for line in lines if line.endswith("True")]
    assert not contracted, f"float32 arithmetic contracted to FMA: {contracted}"

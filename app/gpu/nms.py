"""Numba CUDA NMS for the raw YOLOv8 head output, capturable in a CUDA graph.

Same keep set, same rows and same order as :func:`app.pipeline.postprocess.nms_numpy` (and
``torchvision.ops.batched_nms`` on the same candidates). Greedy NMS, not Fast-NMS.

Why it looks the way it does:

* **Zero copy.** The head output stays where the engine wrote it. Any object exposing
  ``__cuda_array_interface__`` (torch, CuPy, Numba) is viewed with
  ``cuda.as_cuda_array(obj, sync=False)`` once and the view is cached by its pointer/shape.
* **CUDA-graph friendly.** :meth:`GpuNms.run` only launches kernels: no allocation, no host
  sync, no host read of a device count. Every grid is sized on host-known maxima (anchors,
  capacity, batch) and threads leave early after reading the device counts. The request
  parameters (conf, iou, max_det, class filter, agnostic) live in *device* memory, written
  by :meth:`GpuNms.set_params`, so one captured graph serves any request parameters.
* **Bit-exact float32.** The reference computes in float32 with one rounding per operation.
  NVVM contracts ``a * b + c`` into an FMA by default (even without fastmath), which changes
  the rounding of areas and IoUs, so on the GPU every arithmetic step goes through libdevice's
  ``__nv_f*_rn`` intrinsics, which are never fused. The simulator has no libdevice; there the
  same helpers are plain NumPy float32 operations (NumPy never fuses).

Kernel sequence (all on the caller's stream, only for the first ``batch`` images):

1. ``_reset``: zero the per-image candidate counters.
2. ``_candidates``: per (image, anchor): best class = first maximum of the class rows, score
   = that maximum; a candidate iff ``score > conf`` (float32) and the class is allowed; an
   atomic counter gives it a slot in the unsorted candidate arrays (sized ``anchors``, so no
   candidate is ever lost before sorting).
3. ``_rank_decode``: rank of a candidate = number of candidates before it in a stable
   descending sort (higher score, or equal score and lower anchor). That order is
   deterministic whatever order the atomics handed out slots, and equals NumPy's
   ``argsort(-scores, kind="stable")`` over anchor order. Candidates with rank < capacity are
   written to sorted slot ``rank`` with their decoded xyxy box and class-offset box; the
   lowest-scored are the ones dropped when there are more than ``capacity``.
4. ``_iou_mask``: bit ``j`` of row ``i`` set iff ``j > i`` and IoU(offset_i, offset_j) > iou,
   in torchvision's order of float32 operations.
5. ``_suppress`` (one block per image): exact greedy NMS over the bitmask, 64 candidates at a
   time; kept rows are written in descending score order; stops at ``max_det``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from app.pipeline.postprocess import iou_threshold_f32

try:  # numba-cuda: config lives in numba.cuda.core; plain numba: numba.core
    from numba.cuda.core import config as _cuda_config
except ImportError:  # pragma: no cover - older layouts
    from numba.core import config as _cuda_config

SIMULATOR = bool(_cuda_config.ENABLE_CUDASIM)

MAX_WH = np.float32(7680.0)  # Ultralytics' per-class offset; equal to postprocess.MAX_WH
WORD_BITS = 64  # bits in one word of the IoU bitmask / removed bitset (uint64)

_TPB = 128  # threads per block of the per-anchor / per-candidate kernels
_MASK_TPB = WORD_BITS  # one thread per row of a 64x64 IoU tile
_SUPPRESS_TPB = 128  # threads of the one block per image that runs the greedy walk

# Python literals would be typed float64 / int64 by Numba: module-level NumPy scalars are
# frozen as typed constants, so every comparison below stays float32 / uint64.
_F0 = np.float32(0.0)
_F2 = np.float32(2.0)
_U0 = np.uint64(0)
_U1 = np.uint64(1)

# Layout of the device params arrays (see set_params).
_PF_CONF, _PF_IOU = 0, 1  # params_f32
_PI_MAX_DET, _PI_AGNOSTIC = 0, 1  # params_i32


# --------------------------------------------------------------------------- float32 maths
# One rounding per operation, never fused: see the module docstring.
if SIMULATOR:

    @cuda.jit(device=True)
    def _add(a, b):
        return np.float32(a) + np.float32(b)

    @cuda.jit(device=True)
    def _sub(a, b):
        return np.float32(a) - np.float32(b)

    @cuda.jit(device=True)
    def _mul(a, b):
        return np.float32(a) * np.float32(b)

    @cuda.jit(device=True)
    def _div(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):  # 0/0 -> NaN, as in the reference
            return np.float32(a) / np.float32(b)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _add(a, b):
        return libdevice.fadd_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def _sub(a, b):
        return libdevice.fsub_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def _mul(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def _div(a, b):
        return libdevice.fdiv_rn(a, b)


@cuda.jit(device=True)
def _fmin(a, b):
    return b if b < a else a  # std::min(a, b)


@cuda.jit(device=True)
def _fmax(a, b):
    return b if a < b else a  # std::max(a, b)


# --------------------------------------------------------------------------------- kernels
@cuda.jit
def _reset(batch, num_candidates):
    b = cuda.grid(1)
    if b < batch:
        num_candidates[b] = 0


@cuda.jit
def _candidates(head, num_classes, params_f, class_mask, num_candidates, cand_score, cand_anchor, cand_class):
    """Grid (ceil(A / TPB), batch): one thread per (image, anchor)."""
    b = cuda.blockIdx.y
    a = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if a >= head.shape[2]:
        return
    best = np.float32(head[b, 4, a])
    best_c = 0
    is_nan = best != best
    for c in range(1, num_classes):
        s = np.float32(head[b, 4 + c, a])
        if s != s:  # NumPy's argmax stops at the first NaN, whose score is never > conf
            is_nan = True
        if s > best:  # strict: the FIRST maximum wins, like argmax
            best = s
            best_c = c
    if is_nan:
        return
    if best > params_f[_PF_CONF] and class_mask[best_c] != 0:
        slot = cuda.atomic.add(num_candidates, b, 1)
        cand_score[b, slot] = best
        cand_anchor[b, slot] = a
        cand_class[b, slot] = best_c


@cuda.jit
def _rank_decode(
    head,
    num_candidates,
    cand_score,
    cand_anchor,
    cand_class,
    params_i,
    capacity,
    sorted_score,
    sorted_anchor,
    sorted_class,
    sorted_box,
    sorted_obox,
):
    """Grid (ceil(A / TPB), batch), TPB threads: rank each candidate, then decode it.

    The rank is counted against tiles of the candidates staged in shared memory; every thread
    of a live block takes part in the tile loads, so no thread returns before the loop ends.
    """
    b = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    n = num_candidates[b]
    block_start = cuda.blockIdx.x * cuda.blockDim.x
    if block_start >= n:  # uniform over the block: safe before syncthreads
        return
    i = block_start + tid
    live = i < n
    si = _F0
    ai = 0
    if live:
        si = cand_score[b, i]
        ai = cand_anchor[b, i]
    tile_s = cuda.shared.array(_TPB, np.float32)
    tile_a = cuda.shared.array(_TPB, np.int32)
    rank = 0
    for tile in range(0, n, _TPB):
        j = tile + tid
        if j < n:
            tile_s[tid] = cand_score[b, j]
            tile_a[tid] = cand_anchor[b, j]
        cuda.syncthreads()
        if live:
            for k in range(min(_TPB, n - tile)):
                sj = tile_s[k]
                if sj > si or (sj == si and tile_a[k] < ai):
                    rank += 1
        cuda.syncthreads()
    if not live or rank >= capacity:
        return
    c = cand_class[b, i]
    sorted_score[b, rank] = si
    sorted_anchor[b, rank] = ai
    sorted_class[b, rank] = c
    # xywh -> xyxy exactly as head_candidates: half = w / 2, x1 = x - half, x2 = x + half.
    x = np.float32(head[b, 0, ai])
    y = np.float32(head[b, 1, ai])
    hw = _div(np.float32(head[b, 2, ai]), _F2)
    hh = _div(np.float32(head[b, 3, ai]), _F2)
    x1 = _sub(x, hw)
    y1 = _sub(y, hh)
    x2 = _add(x, hw)
    y2 = _add(y, hh)
    sorted_box[b, rank, 0] = x1
    sorted_box[b, rank, 1] = y1
    sorted_box[b, rank, 2] = x2
    sorted_box[b, rank, 3] = y2
    if params_i[_PI_AGNOSTIC] != 0:
        sorted_obox[b, rank, 0] = x1
        sorted_obox[b, rank, 1] = y1
        sorted_obox[b, rank, 2] = x2
        sorted_obox[b, rank, 3] = y2
    else:  # box + class * MAX_WH, as offset_boxes
        off = _mul(np.float32(c), MAX_WH)
        sorted_obox[b, rank, 0] = _add(x1, off)
        sorted_obox[b, rank, 1] = _add(y1, off)
        sorted_obox[b, rank, 2] = _add(x2, off)
        sorted_obox[b, rank, 3] = _add(y2, off)


@cuda.jit
def _iou_mask(num_candidates, capacity, sorted_obox, params_f, mask):
    """Grid (words, words, batch), 64 threads: one 64x64 tile (row tile y, column tile x).

    Only tiles on or right of the diagonal and inside the live candidates do work; the
    suppression pass never reads the others, so they need no clearing.
    """
    b = cuda.blockIdx.z
    row_tile = cuda.blockIdx.y
    col_tile = cuda.blockIdx.x
    n = min(num_candidates[b], capacity)
    if col_tile < row_tile or col_tile * WORD_BITS >= n:  # uniform over the block
        return
    tid = cuda.threadIdx.x
    cols = cuda.shared.array((WORD_BITS, 4), np.float32)
    j0 = col_tile * WORD_BITS
    if j0 + tid < n:
        for k in range(4):
            cols[tid, k] = sorted_obox[b, j0 + tid, k]
    cuda.syncthreads()
    i = row_tile * WORD_BITS + tid
    if i >= n:
        return
    thr = params_f[_PF_IOU]
    x1 = sorted_obox[b, i, 0]
    y1 = sorted_obox[b, i, 1]
    x2 = sorted_obox[b, i, 2]
    y2 = sorted_obox[b, i, 3]
    area_i = _mul(_sub(x2, x1), _sub(y2, y1))
    bits = _U0
    for k in range(min(WORD_BITS, n - j0)):
        j = j0 + k
        if j <= i:
            continue
        area_j = _mul(_sub(cols[k, 2], cols[k, 0]), _sub(cols[k, 3], cols[k, 1]))
        w = _sub(_fmin(x2, cols[k, 2]), _fmax(x1, cols[k, 0]))
        h = _sub(_fmin(y2, cols[k, 3]), _fmax(y1, cols[k, 1]))
        w = _fmax(_F0, w)
        h = _fmax(_F0, h)
        inter = _mul(w, h)
        iou = _div(inter, _sub(_add(area_i, area_j), inter))
        if iou > thr:  # NaN (0/0 for empty boxes) is never > thr, as in the reference
            bits |= _U1 << np.uint64(k)
    mask[b, i, col_tile] = bits


@cuda.jit
def _suppress(
    num_candidates,
    capacity,
    params_i,
    mask,
    removed,
    sorted_score,
    sorted_anchor,
    sorted_class,
    sorted_box,
    out_rows,
    out_anchor,
    out_count,
):
    """Grid (batch,), one block per image: exact greedy NMS over the sorted candidates.

    Word ``w`` of the removed bitset is final once every kept candidate before it has been
    applied. Thread 0 walks its 64 candidates in score order, keeping the live ones and
    folding each kept row's diagonal word into a local copy (greedy within the word); then
    all threads OR the kept rows into the later words (``cuda.atomic.or_``: the "atomic
    suppression") and write the kept rows out. Two barriers per 64 candidates.
    """
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    n = min(num_candidates[b], capacity)
    max_det = min(params_i[_PI_MAX_DET], out_rows.shape[1])
    nwords = (n + WORD_BITS - 1) // WORD_BITS
    kept_local = cuda.shared.array(WORD_BITS, np.int32)
    shared_k = cuda.shared.array(1, np.int32)
    for w in range(tid, nwords, nthreads):
        removed[b, w] = _U0
    cuda.syncthreads()
    total = 0  # identical in every thread: only ever advanced by the shared count
    for w in range(nwords):
        if total >= max_det:  # uniform: every thread holds the same total
            break
        if tid == 0:
            cur = removed[b, w]
            base = w * WORD_BITS
            k = 0
            for bit in range(min(WORD_BITS, n - base)):
                if total + k >= max_det:
                    break
                if ((cur >> np.uint64(bit)) & _U1) == _U0:
                    i = base + bit
                    kept_local[k] = i
                    k += 1
                    cur |= mask[b, i, w]  # bits j > i of this word that i suppresses
            shared_k[0] = k
        cuda.syncthreads()
        k = shared_k[0]
        for t in range(tid, k, nthreads):  # kept rows, still in descending score order
            i = kept_local[t]
            r = total + t
            out_rows[b, r, 0] = sorted_box[b, i, 0]
            out_rows[b, r, 1] = sorted_box[b, i, 1]
            out_rows[b, r, 2] = sorted_box[b, i, 2]
            out_rows[b, r, 3] = sorted_box[b, i, 3]
            out_rows[b, r, 4] = sorted_score[b, i]
            out_rows[b, r, 5] = np.float32(sorted_class[b, i])
            out_anchor[b, r] = sorted_anchor[b, i]
        for w2 in range(w + 1 + tid, nwords, nthreads):
            acc = _U0
            for t in range(k):
                acc |= mask[b, kept_local[t], w2]
            if acc != _U0:
                cuda.atomic.or_(removed, (b, w2), acc)
        total += k
        cuda.syncthreads()  # removed words final, kept_local free for the next word
    if tid == 0:
        out_count[b] = total


# ------------------------------------------------------------------------------- launcher
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GpuNms:
    """Owner of every device buffer the NMS kernels use, and their launcher.

    Construct once per (model, max batch); then per request ``set_params`` and ``run`` on the
    engine's stream, then copy ``out_rows`` / ``out_count`` to the host. ``run`` allocates
    nothing and never syncs, so it can be captured into a CUDA graph (call it once eagerly
    first, so the kernels are compiled and loaded before capture).

    Device buffers (``B = max_batch``, ``A = num_anchors``, ``C = candidate_capacity``,
    ``W = ceil(C / 64)``):

    ========================  ==================  ==========================================
    ``out_rows``              ``[B, max_det, 6]`` float32 x1, y1, x2, y2, score, class (as
                                                  float), descending score; rows past
                                                  ``out_count[b]`` are stale
    ``out_count``             ``[B]`` int32       kept rows per image
    ``out_anchor``            ``[B, max_det]``    int32 anchor index of each kept row
    ``num_candidates``        ``[B]`` int32       candidates above conf *before* capacity
                                                  clipping (``overflow`` is an alias); more
                                                  than ``capacity`` means the lowest-scored
                                                  ones were dropped
    ``cand_score/anchor/class``  ``[B, A]``       unsorted candidates (atomic slots)
    ``sorted_score/anchor/class`` ``[B, C]``      candidates in NMS order
    ``sorted_box/sorted_obox``   ``[B, C, 4]``    float32 xyxy / class-offset xyxy
    ``mask``                  ``[B, C, W]`` uint64 IoU bitmask
    ``removed``               ``[B, W]`` uint64   suppressed bitset
    ``params_f32``            ``[2]`` float32     conf, iou
    ``params_i32``            ``[2 + nc]`` int32  max_det, agnostic, class mask ``[nc]``
    ========================  ==================  ==========================================
    """

    def __init__(
        self,
        max_batch: int,
        num_classes: int,
        num_anchors: int,
        max_det: int = 300,
        candidate_capacity: int | None = None,
    ) -> None:
        if max_batch < 1 or num_classes < 1 or num_anchors < 1 or max_det < 1:
            raise ValueError("max_batch, num_classes, num_anchors and max_det must be >= 1")
        capacity = num_anchors if candidate_capacity is None else int(candidate_capacity)
        if capacity < 1:
            raise ValueError("candidate_capacity must be >= 1")
        self.max_batch = int(max_batch)
        self.num_classes = int(num_classes)
        self.num_anchors = int(num_anchors)
        self.max_det = int(max_det)
        self.capacity = capacity
        self.words = _cdiv(capacity, WORD_BITS)
        self._views: dict[tuple, object] = {}
        self._freed = False

        B, A, C, W, nc = self.max_batch, self.num_anchors, capacity, self.words, self.num_classes
        da = cuda.device_array
        self.num_candidates = da(B, np.int32)
        self.cand_score = da((B, A), np.float32)
        self.cand_anchor = da((B, A), np.int32)
        self.cand_class = da((B, A), np.int32)
        self.sorted_score = da((B, C), np.float32)
        self.sorted_anchor = da((B, C), np.int32)
        self.sorted_class = da((B, C), np.int32)
        self.sorted_box = da((B, C, 4), np.float32)
        self.sorted_obox = da((B, C, 4), np.float32)
        self.mask = da((B, C, W), np.uint64)
        self.removed = da((B, W), np.uint64)
        self.out_rows = da((B, self.max_det, 6), np.float32)
        self.out_anchor = da((B, self.max_det), np.int32)
        self.out_count = da(B, np.int32)
        self.params_f32 = da(2, np.float32)
        self.params_i32 = da(2 + nc, np.int32)
        self.class_mask = self.params_i32[2:]  # a view: written together with max_det/agnostic
        # Pinned staging for set_params; the event guards it against being rewritten while
        # the previous asynchronous copy may still be reading it.
        self._host_f32 = cuda.pinned_array(2, np.float32)
        self._host_i32 = cuda.pinned_array(2 + nc, np.int32)
        self._params_copied = cuda.event() if SIMULATOR else cuda.event(timing=False)
        self._params_pending = False
        self.set_params(stream=0)  # defaults, so a run before any set_params is well defined
        self._params_copied.synchronize()
        self._params_pending = False

    # -- parameters ------------------------------------------------------------------------
    def set_params(
        self,
        conf: float = 0.25,
        iou: float = 0.7,
        max_det: int | None = None,
        classes: tuple[int, ...] | list[int] | None = None,
        agnostic: bool = False,
        stream=0,
    ) -> None:
        """Write the request parameters to device memory, asynchronously on ``stream``.

        Kernels read them from there, so a captured graph picks up new values on replay.
        Enqueue on the stream that runs (or replays) the NMS so the copy is ordered before it.
        """
        self._check_alive()
        max_det = self.max_det if max_det is None else int(max_det)
        if not 0 <= max_det <= self.max_det:
            raise ValueError(f"max_det must be in [0, {self.max_det}], got {max_det}")
        if self._params_pending:  # host waits only for our own previous small copy
            self._params_copied.synchronize()
        self._host_f32[_PF_CONF] = np.float32(conf)
        self._host_f32[_PF_IOU] = iou_threshold_f32(iou)  # torchvision's double comparison, in float32
        self._host_i32[_PI_MAX_DET] = max_det
        self._host_i32[_PI_AGNOSTIC] = 1 if agnostic else 0
        allowed = self._host_i32[2:]
        if classes is None:
            allowed[:] = 1
        else:
            allowed[:] = 0
            for c in classes:  # ids outside [0, nc) can never be a best class: ignore them
                if 0 <= int(c) < self.num_classes:
                    allowed[int(c)] = 1
        self.params_f32.copy_to_device(self._host_f32, stream=stream)
        self.params_i32.copy_to_device(self._host_i32, stream=stream)
        self._params_copied.record(stream)
        self._params_pending = True

    # -- input views -----------------------------------------------------------------------
    def head_view(self, head):
        """The Numba view of ``head`` (made once per pointer/shape/strides/dtype, zero copy)."""
        if SIMULATOR:  # the simulator has no as_cuda_array: take its device arrays as they are
            key, make = (id(head),), lambda: head
        else:
            cai = head.__cuda_array_interface__
            key = (cai["data"][0], tuple(cai["shape"]), cai.get("strides"), cai["typestr"])
            make = lambda: cuda.as_cuda_array(head, sync=False)  # noqa: E731
        view = self._views.get(key)
        if view is None:
            view = make()
            if view.ndim != 3 or view.shape[1] != 4 + self.num_classes or view.shape[2] != self.num_anchors:
                raise ValueError(
                    f"head must be [B, {4 + self.num_classes}, {self.num_anchors}], got {view.shape}"
                )
            if view.dtype not in (np.float32, np.float16):
                raise ValueError(f"head must be float32 or float16, got {view.dtype}")
            if len(self._views) >= 16:  # a few engine buffers at most; do not pin old ones forever
                self._views.clear()
            self._views[key] = view  # the view keeps the owner alive, so the pointer stays valid
        return view

    # -- launch ----------------------------------------------------------------------------
    def run(self, head, batch: int | None = None, stream=0) -> None:
        """Launch the NMS of the first ``batch`` images of ``head`` on ``stream``. No sync.

        ``stream`` is a Numba stream (``cuda.external_stream(torch_stream.cuda_stream)`` for a
        torch stream) or 0 for the default stream. Results: ``out_rows``, ``out_count``.
        """
        self._check_alive()
        view = self.head_view(head)
        batch = view.shape[0] if batch is None else int(batch)
        if not 1 <= batch <= min(self.max_batch, view.shape[0]):
            raise ValueError(f"batch must be in [1, {min(self.max_batch, view.shape[0])}], got {batch}")
        A, C, W = self.num_anchors, self.capacity, self.words
        _reset[_cdiv(batch, _TPB), _TPB, stream](batch, self.num_candidates)
        _candidates[(_cdiv(A, _TPB), batch), _TPB, stream](
            view,
            self.num_classes,
            self.params_f32,
            self.class_mask,
            self.num_candidates,
            self.cand_score,
            self.cand_anchor,
            self.cand_class,
        )
        _rank_decode[(_cdiv(A, _TPB), batch), _TPB, stream](
            view,
            self.num_candidates,
            self.cand_score,
            self.cand_anchor,
            self.cand_class,
            self.params_i32,
            C,
            self.sorted_score,
            self.sorted_anchor,
            self.sorted_class,
            self.sorted_box,
            self.sorted_obox,
        )
        _iou_mask[(W, W, batch), _MASK_TPB, stream](
            self.num_candidates, C, self.sorted_obox, self.params_f32, self.mask
        )
        _suppress[batch, _SUPPRESS_TPB, stream](
            self.num_candidates,
            C,
            self.params_i32,
            self.mask,
            self.removed,
            self.sorted_score,
            self.sorted_anchor,
            self.sorted_class,
            self.sorted_box,
            self.out_rows,
            self.out_anchor,
            self.out_count,
        )

    @property
    def overflow(self):
        """Alias of ``num_candidates``: total candidates per image before capacity clipping."""
        return self.num_candidates

    # -- host helpers (sync; for tests and the non-graph path) ------------------------------
    def results(self, batch: int, stream=0) -> list[np.ndarray]:
        """Copy the kept rows of the first ``batch`` images to the host (synchronizes)."""
        counts = self.out_count.copy_to_host(stream=stream)
        rows = self.out_rows.copy_to_host(stream=stream)
        if not (isinstance(stream, int) and stream == 0):
            stream.synchronize()
        return [rows[b, : counts[b]].copy() for b in range(batch)]

    # -- lifetime --------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._freed:
            raise RuntimeError("GpuNms was freed")

    def free(self) -> None:
        """Drop every device and pinned buffer (idempotent). Numba frees them when unreferenced."""
        if self._freed:
            return
        self._freed = True
        if self._params_pending:
            self._params_copied.synchronize()  # the pinned staging must outlive its copy
        self._views.clear()
        for name in (
            "num_candidates cand_score cand_anchor cand_class sorted_score sorted_anchor "
            "sorted_class sorted_box sorted_obox mask removed out_rows out_anchor out_count "
            "params_f32 params_i32 class_mask _host_f32 _host_i32"
        ).split():
            setattr(self, name, None)

    def __enter__(self) -> GpuNms:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __del__(self) -> None:  # best effort; free() is the contract
        try:
            self.free()
        except Exception:
            pass


def device_bytes(max_batch: int, num_classes: int, num_anchors: int, max_det: int = 300,
                 candidate_capacity: int | None = None) -> int:
    """Device memory a :class:`GpuNms` of these sizes allocates (for sizing decisions)."""
    B, A = max_batch, num_anchors
    C = num_anchors if candidate_capacity is None else candidate_capacity
    W = math.ceil(C / WORD_BITS)
    return (
        4 * B
        + 3 * 4 * B * A
        + 3 * 4 * B * C
        + 2 * 16 * B * C
        + 8 * B * C * W
        + 8 * B * W
        + 24 * B * max_det
        + 4 * B * max_det
        + 4 * B
        + 8
        + 4 * (2 + num_classes)
    )

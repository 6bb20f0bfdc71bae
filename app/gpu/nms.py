"""Numba CUDA NMS for the raw YOLOv8 head output, capturable in a CUDA graph.

Same keep set, same rows and same order as :func:`app.boxes.nms_numpy` (and
``torchvision.ops.batched_nms`` on the same candidates). Greedy NMS, not Fast-NMS.

Why it looks the way it does:

* **Zero copy.** The head output stays where the engine wrote it. Any object exposing
  ``__cuda_array_interface__`` (torch, CuPy, Numba) is viewed with
  ``cuda.as_cuda_array(obj, sync=False)`` once and the view is cached by its pointer/shape
  (the view keeps its owner alive: ``forget_views`` lets a caller done with a head free it).
* **CUDA-graph friendly.** :meth:`GpuNms.run` only launches kernels: no allocation, no host
  sync, no host read of a device count. Grid sizes depend only on host-known values (batch,
  anchors, capacity, SM count), so they are fixed at capture time; the request parameters
  (conf, iou, max_det, class filter, agnostic) live in *device* memory, written by
  :meth:`GpuNms.set_params`, so one captured graph serves any request parameters.
* **Cost follows the candidates, not the capacity.** Past the per-anchor filter, every kernel
  runs a small fixed grid (a few blocks per SM over the whole batch) whose blocks loop over
  the work that exists for the device count ``n`` of their image (block-stride loops), and
  blocks with nothing to do leave at once. Three launches per run.
* **Bit-exact float32.** The reference computes in float32 with one rounding per operation.
  NVVM contracts ``a * b + c`` into an FMA by default (even without fastmath), which changes
  the rounding of areas and IoUs, so on the GPU every arithmetic step goes through libdevice's
  ``__nv_f*_rn`` intrinsics, which are never fused. The simulator has no libdevice; there the
  same helpers are plain NumPy float32 operations (NumPy never fuses).

Kernel sequence (all on the caller's stream, only for the first ``batch`` images):

1. ``_candidates``: per (image, anchor): best class = first maximum of the class rows, score
   = that maximum; a candidate iff ``score > conf`` (float32) and the class is allowed; an
   atomic counter gives it a slot in the unsorted candidate arrays (sized ``anchors``, so no
   candidate is ever lost before sorting). The counter is zero on entry: the constructor
   zeroes it and the last kernel of every run zeroes it again.
2. ``_rank_decode``: rank of a candidate = number of candidates before it in a stable
   descending sort (higher score, or equal score and lower anchor). That order is
   deterministic whatever order the atomics handed out slots, and equals NumPy's
   ``argsort(-scores, kind="stable")`` over anchor order. Candidates with rank < capacity are
   written to sorted slot ``rank`` with their decoded xyxy box and class-offset box; the
   lowest-scored are the ones dropped when there are more than ``capacity``.
3. ``_mask_suppress``: the IoU bitmask (64x64 tiles on or right of the diagonal, shared out
   over the image's blocks); the block that finishes last (ticket counter) then runs the
   exact greedy NMS over the bitmask, 64 candidates at a time, writes the kept rows in
   descending score order up to ``max_det``, publishes ``num_candidates`` and zeroes the
   counters for the next run.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from app.boxes import MAX_WH, iou_threshold_f32
from app.gpu.kernel_cache import configure as configure_kernel_cache
from app.gpu.rounding import SIMULATOR, fadd, fdiv, fmul, fsub, quiet_low_occupancy_warnings

configure_kernel_cache()  # before the kernels below are defined: they load from it (cache=True)

quiet_low_occupancy_warnings()

WORD_BITS = 64  # bits in one word of the IoU bitmask / removed bitset (uint64)

_TPB = 128  # threads per block of the per-anchor kernel (_candidates)
# Threads per block of _rank_decode (one candidate each per chunk). The simulator runs every
# thread as a Python thread: smaller blocks there keep it fast and exercise the chunk and tile
# loops with few candidates.
_RANK_TPB = 64 if SIMULATOR else 128
_CLEAR_TPB = 32  # _clear_counters: one thread per image
_MASK_TPB = WORD_BITS  # one thread per row of a 64x64 IoU tile; the greedy walk uses the same block
# Blocks per SM the fixed grids aim for, summed over the batch. Enough to fill the GPU in the
# worst case (every anchor a candidate); blocks without work leave after reading one counter.
_RANK_BLOCKS_PER_SM = 4
_MASK_BLOCKS_PER_SM = 8

# Python literals would be typed float64 / int64 by Numba: module-level NumPy scalars are
# frozen as typed constants, so every comparison below stays float32 / uint64.
_F0 = np.float32(0.0)
_F2 = np.float32(2.0)
_U0 = np.uint64(0)
_U1 = np.uint64(1)

# Layout of the device params arrays (see set_params).
_PF_CONF, _PF_IOU = 0, 1  # params_f32
_PI_MAX_DET, _PI_AGNOSTIC = 0, 1  # params_i32


# float32 maths with one rounding per operation, never fused: app/gpu/rounding.py


@cuda.jit(device=True)
def _fmin(a, b):
    return b if b < a else a  # std::min(a, b)


@cuda.jit(device=True)
def _fmax(a, b):
    return b if a < b else a  # std::max(a, b)


# --------------------------------------------------------------------------------- kernels
@cuda.jit(cache=True)
def _clear_counters(cand_count, tickets):
    """Zero the per-image counters: recovery after a ``run`` that failed half-launched.

    Not part of ``run``: the last kernel of every run leaves them zero for the next one.
    """
    b = cuda.grid(1)
    if b < cand_count.shape[0]:
        cand_count[b] = 0
        tickets[b] = 0


@cuda.jit(cache=True)
def _candidates(head, num_classes, params_f, class_mask, cand_count, cand_score, cand_anchor, cand_class):
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
        slot = cuda.atomic.add(cand_count, b, 1)
        cand_score[b, slot] = best
        cand_anchor[b, slot] = a
        cand_class[b, slot] = best_c


@cuda.jit(cache=True)
def _rank_decode(
    head,
    cand_count,
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
    """Grid (G, batch), _RANK_TPB threads: rank each candidate, then decode it.

    The G blocks of an image take chunks of _RANK_TPB candidates in turn (block-stride loop
    over the live count), so only ceil(n / _RANK_TPB) blocks do any work. The rank is counted
    against tiles of the candidates staged in shared memory; the chunk loop bound is uniform
    over the block and every thread takes part in the tile loads, so the barriers are safe.
    """
    b = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    n = cand_count[b]
    tile_s = cuda.shared.array(_RANK_TPB, np.float32)
    tile_a = cuda.shared.array(_RANK_TPB, np.int32)
    for chunk in range(cuda.blockIdx.x * _RANK_TPB, n, cuda.gridDim.x * _RANK_TPB):
        i = chunk + tid
        live = i < n
        si = _F0
        ai = 0
        if live:
            si = cand_score[b, i]
            ai = cand_anchor[b, i]
        rank = 0
        for tile in range(0, n, _RANK_TPB):
            j = tile + tid
            if j < n:
                tile_s[tid] = cand_score[b, j]
                tile_a[tid] = cand_anchor[b, j]
            cuda.syncthreads()
            if live:
                for k in range(min(_RANK_TPB, n - tile)):
                    sj = tile_s[k]
                    if sj > si or (sj == si and tile_a[k] < ai):
                        rank += 1
            cuda.syncthreads()  # the tile is free again (next tile, or the next chunk)
        if live and rank < capacity:
            c = cand_class[b, i]
            sorted_score[b, rank] = si
            sorted_anchor[b, rank] = ai
            sorted_class[b, rank] = c
            # xywh -> xyxy exactly as head_candidates: half = w / 2, x1 = x - half, x2 = x + half.
            x = np.float32(head[b, 0, ai])
            y = np.float32(head[b, 1, ai])
            hw = fdiv(np.float32(head[b, 2, ai]), _F2)
            hh = fdiv(np.float32(head[b, 3, ai]), _F2)
            x1 = fsub(x, hw)
            y1 = fsub(y, hh)
            x2 = fadd(x, hw)
            y2 = fadd(y, hh)
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
                off = fmul(np.float32(c), MAX_WH)
                sorted_obox[b, rank, 0] = fadd(x1, off)
                sorted_obox[b, rank, 1] = fadd(y1, off)
                sorted_obox[b, rank, 2] = fadd(x2, off)
                sorted_obox[b, rank, 3] = fadd(y2, off)


@cuda.jit(device=True)
def _next_tile(row, col, tiles_per_row):
    """Carry ``col`` past the end of row ``row`` into the next rows of the upper triangle.

    Row ``r`` of the upper-triangular tile grid holds columns ``r .. tiles_per_row - 1``, so
    the first ``e`` columns past its end are columns ``r + 1 .. r + e`` of row ``r + 1``.
    Returns ``row == tiles_per_row`` once past the last tile.
    """
    while row < tiles_per_row and col >= tiles_per_row:
        col = col - tiles_per_row + row + 1
        row += 1
    return row, col


@cuda.jit(cache=True)
def _mask_suppress(
    cand_count,
    tickets,
    capacity,
    params_f,
    params_i,
    sorted_obox,
    mask,
    removed,
    sorted_score,
    sorted_anchor,
    sorted_class,
    sorted_box,
    num_candidates,
    out_rows,
    out_anchor,
    out_count,
):
    """Grid (G, batch), 64 threads: the IoU bitmask, then (last block of each image) the greedy walk.

    IoU mask: bit ``j`` of row ``i`` set iff ``j > i`` and IoU(offset_i, offset_j) > iou, in
    torchvision's order of float32 operations. Only the ``T = t (t + 1) / 2`` tiles of 64x64
    on or right of the diagonal, for ``t = ceil(n / 64)`` and the live count ``n``, exist;
    the first ``min(G, T)`` blocks of the image ("workers") share them out with a block-stride
    loop, the other blocks leave at once. The suppression never reads any other tile.

    Suppression: each worker, once its tiles are written, fences and takes a ticket from the
    image's counter; the worker that draws the last ticket sees every tile of its image
    (threadfence on both sides, as in CUDA's threadFenceReduction sample and cooperative
    groups' grid sync) and runs the exact greedy NMS over the bitmask, 64 candidates at a
    time: word ``w`` of the removed bitset is final once every kept candidate before it has
    been applied. Thread 0 walks its 64 candidates in score order (their diagonal mask words
    staged in shared memory), keeping the live ones and folding each kept row's diagonal word
    into a local copy (greedy within the word); then all threads OR the kept rows into the
    later words and write the kept rows out, in descending score order, up to ``max_det``.
    Finally it publishes ``num_candidates`` and zeroes the image's candidate counter and
    ticket counter for the next run (so no separate reset launch is needed).

    Why every worker computes the same ``workers``: a worker reads the candidate count before
    taking its ticket, and the count is zeroed only after the last ticket. A non-worker may read
    the zeroed count, but then it computes ``workers == 1`` and, its index being >= 1, still
    leaves.
    """
    b = cuda.blockIdx.y
    blk = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    total_candidates = cand_count[b]
    n = min(total_candidates, capacity)
    tiles_per_row = (n + WORD_BITS - 1) // WORD_BITS
    num_tiles = tiles_per_row * (tiles_per_row + 1) // 2
    workers = max(1, min(cuda.gridDim.x, num_tiles))  # block 0 always works: someone finishes
    if blk >= workers:  # uniform over the block
        return

    # -- IoU bitmask: tiles blk, blk + workers, ... in row-major upper-triangle order
    cols = cuda.shared.array((WORD_BITS, 4), np.float32)
    thr = params_f[_PF_IOU]
    row_tile, col_tile = _next_tile(0, blk, tiles_per_row)
    while row_tile < tiles_per_row:  # uniform: depends on blk, n and the grid only
        j0 = col_tile * WORD_BITS
        cuda.syncthreads()  # the previous tile's readers are done with cols
        for t in range(tid, WORD_BITS, nthreads):
            if j0 + t < n:
                for k in range(4):
                    cols[t, k] = sorted_obox[b, j0 + t, k]
        cuda.syncthreads()
        for r in range(tid, WORD_BITS, nthreads):
            i = row_tile * WORD_BITS + r
            if i < n:
                x1 = sorted_obox[b, i, 0]
                y1 = sorted_obox[b, i, 1]
                x2 = sorted_obox[b, i, 2]
                y2 = sorted_obox[b, i, 3]
                area_i = fmul(fsub(x2, x1), fsub(y2, y1))
                bits = _U0
                for k in range(min(WORD_BITS, n - j0)):
                    j = j0 + k
                    if j <= i:
                        continue
                    area_j = fmul(fsub(cols[k, 2], cols[k, 0]), fsub(cols[k, 3], cols[k, 1]))
                    w = fsub(_fmin(x2, cols[k, 2]), _fmax(x1, cols[k, 0]))
                    h = fsub(_fmin(y2, cols[k, 3]), _fmax(y1, cols[k, 1]))
                    w = _fmax(_F0, w)
                    h = _fmax(_F0, h)
                    inter = fmul(w, h)
                    iou = fdiv(inter, fsub(fadd(area_i, area_j), inter))
                    if iou > thr:  # NaN (0/0 for empty boxes) is never > thr, as in the reference
                        bits |= _U1 << np.uint64(k)
                mask[b, i, col_tile] = bits
        row_tile, col_tile = _next_tile(row_tile, col_tile + workers, tiles_per_row)

    # -- last worker of the image? (release: every thread's mask writes, then one ticket)
    is_last = cuda.shared.array(1, np.int32)
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        cuda.threadfence()
        ticket = cuda.atomic.add(tickets, b, 1)
        is_last[0] = 1 if ticket == workers - 1 else 0
        cuda.threadfence()  # acquire: the other workers' tiles, before the block reads them
    cuda.syncthreads()
    if is_last[0] == 0:  # uniform over the block
        return

    # -- exact greedy NMS of image b over the bitmask (this block only)
    max_det = min(params_i[_PI_MAX_DET], out_rows.shape[1])
    nwords = tiles_per_row
    diag = cuda.shared.array(WORD_BITS, np.uint64)
    kept_local = cuda.shared.array(WORD_BITS, np.int32)
    shared_k = cuda.shared.array(1, np.int32)
    for w in range(tid, nwords, nthreads):
        removed[b, w] = _U0
    cuda.syncthreads()
    total = 0  # identical in every thread: only ever advanced by the shared count
    for w in range(nwords):
        if total >= max_det:  # uniform: every thread holds the same total
            break
        base = w * WORD_BITS
        for t in range(tid, WORD_BITS, nthreads):  # the diagonal words, loaded in parallel
            if base + t < n:
                diag[t] = mask[b, base + t, w]
        cuda.syncthreads()
        if tid == 0:
            cur = removed[b, w]
            k = 0
            for bit in range(min(WORD_BITS, n - base)):
                if total + k >= max_det:
                    break
                if ((cur >> np.uint64(bit)) & _U1) == _U0:
                    kept_local[k] = base + bit
                    k += 1
                    cur |= diag[bit]  # bits j > i of this word that i suppresses
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
        # OR the kept rows into the later words. With few words left, several threads share a
        # word (each ORs every split-th kept row), so the dependent loads per thread stay few.
        later = nwords - w - 1
        split = max(1, nthreads // max(later, 1))  # threads per later word
        for q in range(tid, later * split, nthreads):
            w2 = w + 1 + q % later
            acc = _U0
            for t in range(q // later, k, split):
                acc |= mask[b, kept_local[t], w2]
            if acc != _U0:
                cuda.atomic.or_(removed, (b, w2), acc)
        total += k
        cuda.syncthreads()  # removed words final; diag and kept_local free for the next word
    if tid == 0:
        out_count[b] = total
        num_candidates[b] = total_candidates
        cand_count[b] = 0  # ready for the next run: every reader of this run has read it
        tickets[b] = 0


# ------------------------------------------------------------------------------- launcher
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _multiprocessor_count() -> int:
    """SMs of the current device; the simulator has none, so a small grid keeps it fast."""
    if SIMULATOR:
        return 1
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


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
                                                  ones were dropped; written at the end of
                                                  ``run``
    ``cand_count``            ``[B]`` int32       the atomic slot counter while a run is in
                                                  flight; zero between runs
    ``tickets``               ``[B]`` int32       finished mask blocks; zero between runs
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
        self._sm_count = _multiprocessor_count()
        self._counters_dirty = False  # a run failed half-launched: zero the counters first

        B, A, C, W, nc = self.max_batch, self.num_anchors, capacity, self.words, self.num_classes
        da = cuda.device_array
        self.num_candidates = da(B, np.int32)
        self.cand_count = da(B, np.int32)
        self.tickets = da(B, np.int32)
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
        zeros = np.zeros(B, np.int32)
        for counts in (self.cand_count, self.tickets, self.num_candidates, self.out_count):
            counts.copy_to_device(zeros)  # synchronous: zero before a first run on any stream
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

    def forget_views(self) -> None:
        """Drop the cached head views, and with them the heads they keep alive: a graph replays
        its kernels without ``run``, so once captured its head (which its owner keeps) needs no
        view here, and an eager head (a warm-up's) would otherwise hold its device memory."""
        self._views.clear()

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
        if self._counters_dirty:  # only after a failed run: never on the captured path
            self._zero_counters(stream)
            self._counters_dirty = False
        rank_blocks, mask_blocks = self._grid_blocks(batch)
        try:
            _candidates[(_cdiv(self.num_anchors, _TPB), batch), _TPB, stream](
                view,
                self.num_classes,
                self.params_f32,
                self.class_mask,
                self.cand_count,
                self.cand_score,
                self.cand_anchor,
                self.cand_class,
            )
            _rank_decode[(rank_blocks, batch), _RANK_TPB, stream](
                view,
                self.cand_count,
                self.cand_score,
                self.cand_anchor,
                self.cand_class,
                self.params_i32,
                self.capacity,
                self.sorted_score,
                self.sorted_anchor,
                self.sorted_class,
                self.sorted_box,
                self.sorted_obox,
            )
            _mask_suppress[(mask_blocks, batch), _MASK_TPB, stream](
                self.cand_count,
                self.tickets,
                self.capacity,
                self.params_f32,
                self.params_i32,
                self.sorted_obox,
                self.mask,
                self.removed,
                self.sorted_score,
                self.sorted_anchor,
                self.sorted_class,
                self.sorted_box,
                self.num_candidates,
                self.out_rows,
                self.out_anchor,
                self.out_count,
            )
        except BaseException:
            # A launch that never happened (e.g. a compile error) would leave the counters
            # non-zero, and the next run would count on top of them.
            self._counters_dirty = True
            raise

    def _grid_blocks(self, batch: int) -> tuple[int, int]:
        """Blocks per image of _rank_decode and _mask_suppress for a run of ``batch`` images.

        A few blocks per SM over the whole batch fill the GPU even when every anchor is a
        candidate; no more than the most work an image can have (chunks of candidates, upper
        triangle tiles), so small capacities do not launch idle blocks.
        """
        max_chunks = _cdiv(self.num_anchors, _RANK_TPB)
        max_tiles = self.words * (self.words + 1) // 2
        rank_blocks = max(1, min(max_chunks, _cdiv(self._sm_count * _RANK_BLOCKS_PER_SM, batch)))
        mask_blocks = max(1, min(max_tiles, _cdiv(self._sm_count * _MASK_BLOCKS_PER_SM, batch)))
        return rank_blocks, mask_blocks

    def _zero_counters(self, stream=0) -> None:
        _clear_counters[_cdiv(self.max_batch, _CLEAR_TPB), _CLEAR_TPB, stream](self.cand_count, self.tickets)

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
            "num_candidates cand_count tickets cand_score cand_anchor cand_class sorted_score sorted_anchor "
            "sorted_class sorted_box sorted_obox mask removed out_rows out_anchor out_count "
            "params_f32 params_i32 class_mask _host_f32 _host_i32"
        ).split():
            setattr(self, name, None)

    def __enter__(self) -> GpuNms:
        return self

    def __exit__(self, *exc) -> None:
        self.free()


"""The calibration's inner loops, compiled with Numba for the CPU (build time only).

Kept apart so that importing ``app.builder.int8`` does not load Numba; the functions here are
the plain loops of the algorithms in ``histograms.py`` and ``thresholds.py``, which say why.
Single-threaded and without the GIL: the calibration pass histograms one image in a worker
thread while ONNX Runtime runs the next on the cores (parallel loops spin-waited badly on a
loaded 2-core machine).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def add_abs_histogram(flat, start, inv_width, counts):  # pragma: no cover - compiled
    """``counts[floor(|v| * inv_width)] += 1`` from ``flat[start]`` on, with the min and max.

    One pass over the values. Returns ``(stop, lo, hi)``: ``stop`` is the index of the first
    value beyond the last bin (``flat.size`` when none is), ``lo``/``hi`` the extremes of the
    values before it (NaN ignored). The caller grows the bins and continues from ``stop``: the
    counts so far stay valid, since growing only adds bins or merges whole ones.
    """
    last = counts.size - 1
    limit = counts.size
    lo, hi = np.inf, -np.inf
    for k in range(start, flat.size):
        v = flat[k]
        if np.isnan(v):
            continue
        b = int(abs(v) * inv_width)
        if b >= limit:
            if abs(v) * inv_width > limit:
                return k, lo, hi
            b = last  # exactly on the top edge
        counts[b] += 1
        lo = min(lo, v)
        hi = max(hi, v)
    return flat.size, lo, hi


@njit(nogil=True, cache=True)
def value_extremes(flat, start):  # pragma: no cover - compiled
    """``(min, max)`` of ``flat[start:]``; NaN ignored, ``(inf, -inf)`` if nothing is left."""
    lo, hi = np.inf, -np.inf
    for k in range(start, flat.size):
        v = flat[k]
        lo = min(lo, v) if not np.isnan(v) else lo
        hi = max(hi, v) if not np.isnan(v) else hi
    return lo, hi


@njit(cache=True)
def kl_divergences(hist, start, levels, eps):  # pragma: no cover - compiled
    """KL(P || Q) for every candidate ``i`` in ``[start, len(hist)]`` (``inf`` when undefined).

    P: the first ``i`` bins, the clipped tail added to the last one. Q: the first ``i`` bins
    merged into ``levels`` levels (bin ``j`` → level ``j * levels // i``), each level's count
    spread evenly over its non-empty bins, empty bins left empty. Both smoothed (empty bins get
    ``eps``, taken evenly from the others), then normalised.
    """
    n = hist.size
    total = 0.0
    for j in range(n):
        total += hist[j]
    out = np.full(n + 1, np.inf)
    q = np.zeros(n)
    kept = 0.0  # count in the first i bins
    nonzero = 0  # non-empty bins among the first i
    for j in range(start - 1):
        kept += hist[j]
        if hist[j] != 0:
            nonzero += 1
    for i in range(start, n + 1):
        kept += hist[i - 1]
        if hist[i - 1] != 0:
            nonzero += 1
        tail = total - kept
        if nonzero == 0:
            continue
        for g in range(levels):  # level g holds bins [ceil(g i / levels), ceil((g + 1) i / levels))
            lo = (g * i + levels - 1) // levels
            hi = ((g + 1) * i + levels - 1) // levels
            level_sum = 0.0
            level_nonzero = 0
            for j in range(lo, hi):
                if hist[j] != 0:
                    level_sum += hist[j]
                    level_nonzero += 1
            for j in range(lo, hi):
                q[j] = level_sum / level_nonzero if hist[j] != 0 else 0.0
        last_p = hist[i - 1] + tail
        p_nonzero = nonzero + (1 if hist[i - 1] == 0 and last_p != 0 else 0)
        p_take = eps * (i - p_nonzero) / p_nonzero  # what smoothing takes from each non-empty bin
        q_take = eps * (i - nonzero) / nonzero
        # Smoothing moves mass between bins, so the sums stay: P sums to total, Q to kept.
        kl = 0.0
        ok = True
        for j in range(i):
            p = hist[j] if j < i - 1 else last_p
            ps = (p - p_take if p != 0 else eps) / total
            qs = (q[j] - q_take if q[j] != 0 else eps) / kept
            if ps <= 0.0 or qs <= 0.0:
                ok = False
                break
            kl += ps * np.log(ps / qs)
        if ok:
            out[i] = kl
    return out

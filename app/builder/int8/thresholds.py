"""Clipping thresholds from ``|x|`` histograms: entropy (TensorRT's KL search), percentile, max.

Entropy, as NVIDIA describes TensorRT's entropy calibration ("8-bit Inference with TensorRT",
GTC 2017; the same search as pytorch-quantization's ``_compute_amax_entropy``):

* start from the histogram of ``|x|`` (2048 bins over ``[0, max |x|]``, ``histograms.py``);
* for every candidate ``i`` from bin 128 to the last bin: the reference distribution ``P`` is
  the first ``i`` bins with everything beyond (the clipped outliers) added to the last of them;
  the candidate ``Q`` is the same ``i`` bins quantized to 128 levels (the positive half of
  symmetric int8): bins merged into 128 equal groups, each group's count spread evenly back over
  its non-empty bins, empty bins kept empty; ``Q`` carries no outliers;
* both smoothed (empty bins get 1e-4 counts, taken evenly from the others, so the divergence
  stays finite), normalised, and ``KL(P || Q)`` computed;
* the threshold is the upper edge of bin ``i`` with the smallest divergence.

What the previous implementation (ONNX Runtime's ``HistogramCollector``) did differently, each
of which moved its thresholds: a *signed* histogram whose 2048 bins cover ``[-max, max]`` (half
of them on the negative side, nearly empty after SiLU: 1024 bins of resolution left), windows
symmetric around zero quantized to 256 levels, a search starting at 1/8 of the range instead of
1/16, ``Q`` as integer counts (floor division loses mass), every 7th value sampled, and a
range fixed by the first image (see ``histograms.py``).

Percentile: the smallest bin edge with at least ``percentile`` % of ``|x|`` below it. Max: the
largest ``|x|``. MSE: the threshold with the least rounding-plus-clipping squared error on the grid the
tensor gets. Every threshold ``T`` becomes the range ``[max(min x, -T), min(max x, T)]``:
symmetric int8 (TensorRT) uses ``max(|lo|, |hi|) = T``; the CPU model's u8 keeps the one-sided
range of post-SiLU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.builder.int8.histograms import AbsHistogram
from app.errors import CalibrationError

METHODS = ("entropy", "max", "mse", "percentile")
ENTROPY_START_BIN = 128
ENTROPY_LEVELS = 128  # 2**7: the magnitude levels of symmetric int8
SMOOTHING_EPS = 1e-4
PERCENTILE = 99.999
MSE_CANDIDATES = 200  # thresholds tried, evenly over (0, max |x|]


def entropy_threshold(h: AbsHistogram, *, start_bin: int = ENTROPY_START_BIN, levels: int = ENTROPY_LEVELS) -> float:
    """The clipping threshold of least KL divergence (TensorRT's entropy calibration)."""
    from app.builder.int8.kernels import kl_divergences

    if h.width == 0.0 or h.counts.size <= start_bin:
        return h.amax
    divergences = kl_divergences(h.counts.astype(np.int64), start_bin, levels, SMOOTHING_EPS)
    if not np.isfinite(divergences).any():
        return h.amax
    best = int(np.argmin(divergences))
    return min(best * h.width, h.amax)


def percentile_threshold(h: AbsHistogram, percentile: float = PERCENTILE) -> float:
    """The smallest bin edge with ``percentile`` % of the ``|x|`` values at or below it."""
    total = h.counts.sum()
    if h.width == 0.0 or total == 0:
        return h.amax
    cdf = np.cumsum(h.counts) / total
    index = int(np.searchsorted(cdf, percentile / 100.0))  # first bin reaching it
    return min((index + 1) * h.width, h.amax)


def mse_threshold(h: AbsHistogram, *, own_range: bool = False, steps: int = 254) -> float:
    """The threshold ``T`` of least mean squared error, rounding inside plus clipping beyond, every
    bin's values taken at its centre. ``own_range``: the tensor is quantized over its own range
    ``[max(lowest, -T), min(highest, T)]`` in ``steps`` steps, as the TensorRT model's shifted s8
    does (``shift.py``); else over ``[-T, T]`` (plain s8, ``T / 127`` steps)."""
    total = h.counts.sum()
    if h.width == 0.0 or total == 0:
        return h.amax
    counts = h.counts.astype(np.float64)
    centres = (np.arange(counts.size) + 0.5) * h.width
    below, above = (max(0.0, -h.lowest), max(0.0, h.highest)) if own_range else (np.inf, np.inf)
    best, best_t = np.inf, h.amax
    for t in np.linspace(h.amax / MSE_CANDIDATES, h.amax, MSE_CANDIDATES):
        step = (min(below, t) + min(above, t)) / steps
        error = np.where(centres <= t, centres - np.round(centres / step) * step, centres - t)
        mse = float((counts * error**2).sum())
        if mse < best:
            best, best_t = mse, float(t)
    return best_t


def threshold(h: AbsHistogram, method: str, *, own_range: bool = False) -> float:
    if method == "entropy":
        return entropy_threshold(h)
    if method == "percentile":
        return percentile_threshold(h)
    if method == "mse":
        return mse_threshold(h, own_range=own_range)
    if method == "max":
        return h.amax
    raise CalibrationError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")


def tensor_range(h: AbsHistogram, method: str, *, own_range: bool = False) -> tuple[float, float]:
    """``[lo, hi]`` for one tensor: the seen range clipped to ``±threshold``."""
    t = threshold(h, method, own_range=own_range)
    return max(h.lowest, -t), min(h.highest, t)


def compute_ranges(histograms: dict[str, AbsHistogram], method: str, *,
                   full_range: Sequence[str] = (), own_range: bool = False) -> dict[str, tuple[float, float]]:
    """Every tensor's range by ``method``; the ``full_range`` tensors (the model input) keep all
    they span. ``own_range``: mse fits each tensor quantized over its own range (the TensorRT model's
    shifted s8), not over ``[-T, T]``. The input is a letterboxed image in [0, 1] whose pad value, 114/255 = 0.447, is the
    largest spike of its histogram: the KL search clips right there, and every brighter pixel
    would saturate."""
    keep = set(full_range)
    return {name: tensor_range(h, "max" if name in keep else method, own_range=own_range)
            for name, h in histograms.items()}


def silu_floor(step: float) -> float:
    """The smallest ``c`` with ``|SiLU(-c)| = c / (1 + e^c)`` below ``step / 2`` (past the minimum
    at -1.28): a pre-activation clipped at ``-c`` changes the SiLU output by less than its rounding."""
    c = 1.28
    while c < 40.0 and c / (1.0 + np.exp(c)) > step / 2:
        c += 0.01
    return c


def silu_preactivation_ranges(ranges: dict[str, tuple[float, float]], pairs: dict[str, str],
                              levels: int = 255) -> dict[str, tuple[float, float]]:
    """The ranges of the tensors that enter a SiLU (``pairs``: pre-activation → SiLU output),
    fitted to what SiLU makes of them; for the CPU model, which quantizes Conv outputs to fuse.

    A pre-activation's |x| threshold is set by its large negative values (down to -45 after the
    first Conv), which SiLU squashes to ~0: u8 over ``[-T, T]`` spends half its steps there. Its
    range becomes ``[-c, hi]``: ``-c`` where clipping changes SiLU's output by less than half the
    output's u8 step, ``hi`` the SiLU output's (SiLU(x) ≈ x up there). About 2x finer steps (bench:
    F1 0.939 → 0.964 against FP32 on another distribution)."""
    out = dict(ranges)
    for pre, post in pairs.items():
        if pre not in ranges or post not in ranges:
            continue
        lo, hi = ranges[pre]
        post_lo, post_hi = ranges[post]
        if post_hi <= post_lo:
            continue
        out[pre] = (max(lo, -silu_floor((post_hi - post_lo) / levels)), min(hi, post_hi) if post_hi > 0 else hi)
    return out


def to_tensors_data(ranges: dict[str, tuple[float, float]], method: str):
    """ONNX Runtime's ``TensorsData`` (what ``quantize_static`` reads from a calibration cache)."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    ort_method = {"entropy": CalibrationMethod.Entropy, "percentile": CalibrationMethod.Percentile,
                  "max": CalibrationMethod.MinMax, "mse": CalibrationMethod.MinMax}[method]  # a label: ranges given
    return TensorsData(ort_method, {
        name: TensorData(lowest=np.asarray(lo, np.float32), highest=np.asarray(hi, np.float32))
        for name, (lo, hi) in ranges.items()
    })

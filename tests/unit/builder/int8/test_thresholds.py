"""Entropy, percentile and max thresholds against references written here, plainly.

The entropy reference follows NVIDIA's description of TensorRT's entropy calibration step by
step (GTC 2017, "8-bit Inference with TensorRT"): for each candidate ``i`` from bin 128, P = the
first ``i`` bins with the outliers added to the last one, Q = those bins quantized to 128 levels
and expanded back (empty bins stay empty), both smoothed, KL(P || Q); the threshold is the upper
edge of the best candidate. It is slow and obvious; the library's compiled search must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.builder.int8 import thresholds as th
from app.builder.int8.histograms import AbsHistogram, ActivationHistograms


def smooth(dist: np.ndarray, eps: float = 1e-4) -> np.ndarray | None:
    zero = dist == 0
    if zero.all():
        return None
    taken = eps * zero.sum() / (~zero).sum()
    return np.where(zero, eps, dist - taken)


def reference_divergences(counts: np.ndarray, start: int = 128, levels: int = 128) -> dict[int, float]:
    counts = counts.astype(np.float64)
    out = {}
    for i in range(start, counts.size + 1):
        p = counts[:i].copy()
        p[-1] += counts[i:].sum()  # the clipped outliers, folded into the last bin
        level = (np.arange(i) * levels) // i  # bin j belongs to level floor(j * 128 / i)
        level_total = np.bincount(level, weights=counts[:i], minlength=levels)
        level_nonempty = np.bincount(level, weights=counts[:i] > 0, minlength=levels)
        q = np.where(counts[:i] > 0, level_total[level] / np.maximum(level_nonempty[level], 1), 0.0)
        ps, qs = smooth(p), smooth(q)
        if ps is None or qs is None:
            continue
        ps, qs = ps / ps.sum(), qs / qs.sum()
        out[i] = float(np.sum(ps * np.log(ps / qs)))
    return out


def reference_threshold(h: AbsHistogram) -> float:
    divergences = reference_divergences(h.counts)
    best = min(divergences, key=lambda i: (divergences[i], i))
    return min(best * h.width, h.amax)


def histogram_of(values: np.ndarray, batches: int = 3) -> AbsHistogram:
    collector = ActivationHistograms()
    for part in np.array_split(values.astype(np.float32), batches):
        collector.add("t", part)
    return collector.finish()["t"]


def _silu(x):
    return x / (1 + np.exp(-x))


SYNTHETIC = {
    "gaussian": lambda rng: rng.normal(0, 1, 400_000),
    "laplace": lambda rng: rng.laplace(0, 1, 400_000),
    "student-t3": lambda rng: rng.standard_t(3, 400_000),  # heavy-tailed
    "relu": lambda rng: np.maximum(rng.normal(0.2, 1, 400_000), 0),  # one-sided, many exact zeros
    "silu": lambda rng: _silu(rng.normal(0, 2, 400_000)),  # one-sided, ≥ -0.28
}


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_entropy_search_equals_the_plain_reference(name):
    from app.builder.int8.kernels import kl_divergences

    h = histogram_of(SYNTHETIC[name](np.random.default_rng(7)))
    assert 2048 <= h.counts.size <= 2112
    expected = reference_divergences(h.counts)
    got = kl_divergences(h.counts, th.ENTROPY_START_BIN, th.ENTROPY_LEVELS, th.SMOOTHING_EPS)
    candidates = sorted(expected)
    np.testing.assert_allclose(got[candidates], [expected[i] for i in candidates], rtol=1e-9, atol=1e-12)
    assert np.isinf(got[: th.ENTROPY_START_BIN]).all()
    assert th.entropy_threshold(h) == pytest.approx(reference_threshold(h), rel=1e-12)
    # never below bin 128 (1/16 of the range); a sparse tail costs Q nothing (its empty bins stay
    # empty), so only the heavy tails are clipped
    assert h.amax / 17 < th.entropy_threshold(h) <= h.amax
    if name == "student-t3":
        assert th.entropy_threshold(h) < h.amax / 2


def test_entropy_keeps_a_uniform_distribution_whole():
    # Uniform: merging bins into levels loses nothing, while any clip folds a big share of the
    # mass into one bin. The best candidate is the last one: the maximum.
    body = np.random.default_rng(1).uniform(0, 1, 500_000)
    assert th.entropy_threshold(histogram_of(body)) == pytest.approx(body.max(), rel=1e-3)


def test_heavier_tails_are_clipped_further_out_in_units_of_the_spread():
    rng = np.random.default_rng(2)
    gauss = th.entropy_threshold(histogram_of(rng.normal(0, 1, 400_000)))
    laplace = th.entropy_threshold(histogram_of(rng.laplace(0, 1 / np.sqrt(2), 400_000)))  # same variance
    assert 3.0 < gauss < 5.5 and laplace > 1.3 * gauss


def test_percentile_and_max_against_numpy():
    rng = np.random.default_rng(3)
    values = rng.standard_t(3, 300_000).astype(np.float32)
    h = histogram_of(values)
    assert th.threshold(h, "max") == pytest.approx(np.abs(values).max())
    expected = np.percentile(np.abs(values), th.PERCENTILE)
    got = th.percentile_threshold(h)
    assert expected - 1e-6 <= got <= expected + h.width + 1e-6  # the upper edge of the bin it falls in
    assert (np.abs(values) <= got).mean() >= th.PERCENTILE / 100


def test_mse_threshold_is_the_best_s8_clip_on_the_samples_themselves():
    rng = np.random.default_rng(5)
    for values in (rng.normal(0, 1, 300_000), rng.laplace(0, 1, 300_000), _silu(rng.normal(0, 3, 300_000))):
        values = values.astype(np.float32)
        h = histogram_of(values)

        def sample_mse(t: float, values=values) -> float:  # s8 symmetric fake-quantization of the values
            step = t / 127
            return float(np.mean((np.clip(np.round(values / step), -127, 127) * step - values) ** 2))

        got = th.mse_threshold(h)
        grid = np.linspace(h.amax / 200, h.amax, 200)
        assert sample_mse(got) <= 1.02 * min(sample_mse(t) for t in grid)
        assert got < h.amax  # clipping the far tail pays


def test_own_range_mse_is_the_best_clip_for_the_shifted_grid():
    """A one-sided tensor (SiLU output) quantized over its own range [lo, T] in 254 steps, as the
    TensorRT model's shifted s8 does: the threshold is the best on the samples themselves, and
    higher than plain s8's (finer steps make clipping the dearer error)."""
    rng = np.random.default_rng(6)
    values = _silu(rng.normal(0, 3, 300_000)).astype(np.float32)
    h = histogram_of(values)

    def shifted_mse(t: float) -> float:
        lo = max(float(values.min()), -t)
        step = (t - lo) / 254
        mid = (t + lo) / 2
        q = np.clip(np.round((values - mid) / step), -127, 127) * step + mid
        return float(np.mean((q - values) ** 2))

    got = th.mse_threshold(h, own_range=True)
    grid = np.linspace(h.amax / 200, h.amax, 200)
    assert shifted_mse(got) <= 1.02 * min(shifted_mse(t) for t in grid)
    assert got > th.mse_threshold(h)
    symmetric = histogram_of(rng.normal(0, 1, 300_000).astype(np.float32))
    assert th.mse_threshold(symmetric, own_range=True) == th.mse_threshold(symmetric)  # ±T is its own range


def test_silu_fitted_preactivation_range():
    """Clipping a pre-activation at -c moves SiLU's output by under half its output step; the top
    follows SiLU's output; tensors outside the pairs are untouched."""
    ranges = {"pre": (-40.0, 30.0), "post": (-0.28, 20.0), "other": (-3.0, 3.0)}
    out = th.silu_preactivation_ranges(ranges, {"pre": "post"})
    step = (20.0 + 0.28) / 255
    lo, hi = out["pre"]
    assert hi == 20.0 and out["other"] == (-3.0, 3.0) and out["post"] == ranges["post"]
    xs = np.linspace(-40, lo, 1000)
    assert np.abs(_silu(xs) - _silu(np.full_like(xs, lo))).max() <= step / 2 + 1e-6
    assert lo > -10  # far finer steps than over [-40, 30]
    assert th.silu_preactivation_ranges({"pre": (-2.0, 5.0), "post": (-0.28, 5.0)}, {"pre": "post"})["pre"][0] == -2.0


def test_ranges_keep_one_sided_tensors_one_sided():
    rng = np.random.default_rng(4)
    values = _silu(rng.normal(0, 3, 200_000)).astype(np.float32)
    h = histogram_of(values)
    for method in th.METHODS:
        lo, hi = th.tensor_range(h, method)
        t = th.threshold(h, method)
        assert lo == pytest.approx(values.min()) and hi == pytest.approx(min(values.max(), t))
    assert th.tensor_range(histogram_of(np.zeros(1000)), "entropy") == (0.0, 0.0)


def test_unknown_method_is_a_calibration_error():
    from app.errors import CalibrationError

    with pytest.raises(CalibrationError, match="entropy, max, mse, percentile"):
        th.threshold(histogram_of(np.ones(10)), "kl")

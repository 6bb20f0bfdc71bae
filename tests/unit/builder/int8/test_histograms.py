"""The |x| histograms: every value counted, growth exact, ~2048 bins over [0, max |x|], the cache."""

from __future__ import annotations

import numpy as np
import pytest

from app.builder.int8.histograms import (
    HISTOGRAM_BINS,
    OVERSAMPLE,
    ActivationHistograms,
    load_histograms,
    save_histograms,
)


def _batches():
    """Three 'images' of one tensor; later ones reach further, so the bins grow twice."""
    rng = np.random.default_rng(3)
    return [rng.normal(0, s, (1, 16, 40, 40)).astype(np.float32) for s in (1.0, 3.0, 0.5, 6.0)]


def test_counts_equal_a_one_shot_histogram_over_the_final_bins():
    batches = _batches()
    collector = ActivationHistograms()
    for batch in batches:
        collector.add("t", batch)
    h = collector.finish()["t"]
    values = np.abs(np.concatenate([b.ravel() for b in batches])).astype(np.float64)
    # The fine bins' width is fixed by the first batch; the final bins group whole fine bins.
    fine_width = float(np.abs(batches[0]).max()) / (HISTOGRAM_BINS * OVERSAMPLE)
    group = round(h.width / fine_width)
    fine = np.floor(values * (1.0 / fine_width)).astype(np.int64)
    expected = np.bincount(fine // group, minlength=h.counts.size)
    np.testing.assert_array_equal(h.counts, expected)
    assert h.counts.sum() == values.size
    assert HISTOGRAM_BINS <= h.counts.size <= HISTOGRAM_BINS * (1 + 1 / OVERSAMPLE)
    assert (h.counts.size - 1) * h.width <= values.max() < h.counts.size * h.width  # the last bin holds the max
    assert h.lowest == min(float(b.min()) for b in batches) and h.highest == max(float(b.max()) for b in batches)


def test_huge_growth_halves_the_resolution_instead_of_the_memory():
    collector = ActivationHistograms()
    collector.add("t", np.linspace(-1, 1, 1000, dtype=np.float32))
    collector.add("t", np.array([5000.0], np.float32))  # 5000x the first range
    h = collector.finish()["t"]
    assert h.counts.sum() == 1001 and h.counts.size <= HISTOGRAM_BINS * 2
    assert h.counts[-1] == 1 and h.amax == 5000.0


def test_nan_is_ignored_and_zeros_before_the_first_range_are_kept():
    collector = ActivationHistograms()
    collector.add("t", np.zeros(10, np.float32))
    collector.add("t", np.array([np.nan, 1.0, -2.0], np.float32))
    h = collector.finish()["t"]
    assert h.counts.sum() == 12 and h.counts[0] == 10
    assert (h.lowest, h.highest) == (-2.0, 1.0)


def test_cache_round_trip(tmp_path):
    collector = ActivationHistograms()
    for k, batch in enumerate(_batches()):
        collector.add(f"t{k % 2}", batch)
    before = collector.finish()
    path = tmp_path / "h.npz"
    save_histograms(path, before)
    after = load_histograms(path)
    assert sorted(after) == sorted(before)
    for name, h in before.items():
        np.testing.assert_array_equal(after[name].counts, h.counts)
        assert (after[name].width, after[name].lowest, after[name].highest) == pytest.approx(
            (h.width, h.lowest, h.highest))

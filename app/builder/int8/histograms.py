"""Per-tensor histograms of absolute activation values, collected image by image.

TensorRT's entropy calibration starts from a histogram of ``|x|`` with 2048 bins over
``[0, max |x|]``. The maximum is only known after the last image, so the bins are collected
finer (``oversample`` × 2048 bins over the first image's ``[0, max |x|]``) and more bins of the
same width are appended when a later image reaches further (exact, as in TensorRT's
pytorch-quantization ``HistogramCalibrator``). ``finish`` then merges whole groups of those
fine bins into 2048–2112 bins whose last one holds the maximum: the same histogram whatever
the image order, with no re-binning error. (The previous collector fixed a signed range from
the first image and grew it by whole bins, so the search's start and resolution depended on
which image came first.)

Every value is counted (compiled loops, ``kernels.py``); the exact minimum and maximum are kept too, for
the ``max`` method and for one-sided tensors (post-SiLU activations are ≥ -0.28).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HISTOGRAM_BINS = 2048  # TensorRT's
OVERSAMPLE = 32  # fine bins per final bin while collecting: finish() leaves 2048–2112 bins
MAX_GROWTH = 8  # a tensor's fine bins may grow 8x before pairs are merged (bounds memory)


@dataclass
class AbsHistogram:
    """One tensor's ``|x|`` histogram: ``counts[b]`` values in ``[b * width, (b + 1) * width)``."""

    counts: np.ndarray  # int64
    width: float
    lowest: float  # smallest signed value seen
    highest: float  # largest signed value seen

    @property
    def amax(self) -> float:
        return max(abs(self.lowest), abs(self.highest))


class _Collecting:
    __slots__ = ("counts", "highest", "lowest", "width", "zeros")

    def __init__(self) -> None:
        self.counts: np.ndarray | None = None
        self.width = 0.0
        self.lowest, self.highest = np.inf, -np.inf
        self.zeros = 0  # values counted before any non-zero one fixed the bin width


class ActivationHistograms:
    """Collects an ``AbsHistogram`` per tensor name over any number of ``add`` calls."""

    def __init__(self, bins: int = HISTOGRAM_BINS, oversample: int = OVERSAMPLE) -> None:
        self.bins = bins
        self.fine_bins = bins * oversample
        self._tensors: dict[str, _Collecting] = {}

    def add(self, name: str, values: np.ndarray) -> None:
        from app.builder.int8.kernels import add_abs_histogram, value_extremes

        flat = np.ascontiguousarray(values, dtype=np.float32).ravel()
        state = self._tensors.setdefault(name, _Collecting())
        start = 0
        while start < flat.size:
            if state.counts is None:  # the first non-zero value sets the bin width
                lo, hi = value_extremes(flat, start)
                if lo > hi:  # all NaN
                    return
                amax = max(abs(float(lo)), abs(float(hi)))
                if amax == 0.0:
                    state.zeros += flat.size - start
                    self._extremes(state, lo, hi)
                    return
                state.width = amax / self.fine_bins
                state.counts = np.zeros(self.fine_bins, np.int64)
                state.counts[0] += state.zeros
            stop, lo, hi = add_abs_histogram(flat, start, 1.0 / state.width, state.counts)
            self._extremes(state, lo, hi)
            if stop < flat.size:  # a value beyond the bins: grow them to the rest's maximum
                lo, hi = value_extremes(flat, stop)
                self._grow(state, max(abs(float(lo)), abs(float(hi))))
            start = stop

    @staticmethod
    def _extremes(state: _Collecting, lo: float, hi: float) -> None:
        state.lowest, state.highest = min(state.lowest, float(lo)), max(state.highest, float(hi))

    def _grow(self, state: _Collecting, amax: float) -> None:
        needed = int(np.ceil(amax / state.width))
        while needed > self.fine_bins * MAX_GROWTH:  # halve the resolution: merge bin pairs
            counts = state.counts
            if counts.size % 2:
                counts = np.append(counts, 0)
            state.counts = counts.reshape(-1, 2).sum(axis=1)
            state.width *= 2
            needed = int(np.ceil(amax / state.width))
        state.counts = np.concatenate([state.counts, np.zeros(needed - state.counts.size, np.int64)])

    def finish(self) -> dict[str, AbsHistogram]:
        """Each tensor's histogram with ~``bins`` bins over ``[0, max |x|]``."""
        out = {}
        for name, state in self._tensors.items():
            if state.counts is None:  # nothing, or only zeros
                lowest = state.lowest if state.lowest <= state.highest else 0.0
                highest = state.highest if state.lowest <= state.highest else 0.0
                out[name] = AbsHistogram(np.array([state.zeros], np.int64), 0.0, lowest, highest)
                continue
            used = int(np.flatnonzero(state.counts)[-1]) + 1
            group = max(1, used // self.bins)
            counts = state.counts[:used]
            pad = (-used) % group
            if pad:
                counts = np.append(counts, np.zeros(pad, np.int64))
            out[name] = AbsHistogram(counts.reshape(-1, group).sum(axis=1), state.width * group,
                                     state.lowest, state.highest)
        return out


def save_histograms(path, histograms: dict[str, AbsHistogram]) -> None:
    """One ``.npz``: per tensor its counts and ``(width, lowest, highest)``."""
    arrays = {}
    for k, (name, h) in enumerate(sorted(histograms.items())):
        arrays[f"counts{k}"] = h.counts
        arrays[f"stats{k}"] = np.array([h.width, h.lowest, h.highest], np.float64)
        arrays[f"name{k}"] = np.array(name)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def load_histograms(path) -> dict[str, AbsHistogram]:
    with np.load(path) as data:
        count = sum(1 for key in data.files if key.startswith("name"))
        out = {}
        for k in range(count):
            width, lowest, highest = (float(v) for v in data[f"stats{k}"])
            out[str(data[f"name{k}"])] = AbsHistogram(data[f"counts{k}"], width, lowest, highest)
    return out

"""``model.onnx`` → INT8 Q/DQ models calibrated on the user's images (build time only).

Why explicit Q/DQ: TensorRT removed its INT8 calibrators in 11.0, so the scales have to be in
the ONNX model, and a strongly typed TensorRT network is built from it (``trt_build.py``).

Steps, with ONNX Runtime's quantization tools doing the graph work:

1. Export (or reuse) the FP32 model; list the images; set held-out images aside (never
   calibrated on) for the accuracy report.
2. Calibrate: run ORT's augmented model (every float tensor made an output) over the images,
   preprocessed exactly as at inference (``decode_image`` → ``letterbox`` → ``to_input``), and
   collect per-tensor statistics with ORT's collectors, one image at a time (ORT keeps every
   activation of a ``collect_data`` call in memory; one image is ~400 MB on a 640 model).
   Entropy and percentile: ORT's histograms (``ActivationHistograms``: same bins and range
   growth, every 7th value sampled, ~3x faster) and ORT's threshold rules, computed here.
   Entropy: ORT's KL search, but with 2048 histogram bins and 256 quantized bins. Through
   ``quantize_static`` the entropy calibrator gets its defaults (128/128), with which the
   search has a single candidate, the full range: "entropy" is then MinMax. ORT 1.32 passes
   no bin options through ``quantize_static`` (only ``CalibTensorRangeSymmetric``,
   ``CalibMovingAverage(Constant)``, ``CalibMaxIntermediateOutputs``, ``CalibPercentile``),
   so we drive ``create_calibrator`` ourselves. ORT's threshold search itself is pure-Python
   loops (222 s for the 242 tensors of YOLOv8s with 2048 bins on this CPU); ``entropy_threshold``
   below is the same search vectorised (checked equal to ORT's in the tests).
3. The ranges are saved in ORT's calibration-cache format under ``calibration/cache/``, keyed
   by the model's sha256, the method and the images' contents; ``quantize_static`` writes the
   Q/DQ models from that file (``calibration_cache_path``), so a rerun skips step 2.
4. Two models from the same ranges (one calibration pass):
   * ``model.int8.onnx`` for TensorRT: s8 symmetric activations and weights (zero point 0),
     per-channel weights, Q/DQ on the inputs (not the outputs) of Conv, Add, Concat, MaxPool
     and Resize (the placement NVIDIA's ModelOpt uses; SiLU stays float), float
     weights with a Q→DQ pair and float bias: TensorRT's parser refuses a DequantizeLinear
     fed by an int32 bias (onnx-tensorrt#850, onnxruntime#14229).
   * ``model.int8-cpu.onnx`` for ONNX Runtime on a CPU: u8 asymmetric activations (ORT's fast
     kernels; s8 symmetric Q/DQ runs ~2x slower than FP32 on CPU), s8 per-channel weights,
     Q/DQ on every op ORT quantizes, so it fuses QLinearConv and friends.
   Both leave the head tail float (``head_tail_nodes``) and, by default, the head's six last
   Convs (``head_output_convs``).
5. Compare both with FP32 on the held-out images (``int8_report``); below ``min_f1`` the run
   fails (the new models are not installed) unless ``allow_low_accuracy``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.artifacts.int8 import (
    CALIBRATION_ROOT,
    calibration_cache_path,
    images_digest,
    int8_cpu_model_path,
    int8_qdq_model_path,
    int8_report_path,
)
from app.builder.int8_report import Int8Report, compare_models, print_report, save_report
from app.errors import CalibrationError, YolopipeError
from app.imaging.decode import decode_image
from app.imaging.letterbox import letterbox, to_input

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
METHODS = ("entropy", "max", "percentile")
# Chosen by bench/results/*-int8-calibration-cpu.json (12 held-out photos, 43 FP32 boxes, 74
# calibration images, head tail and head output convs float): percentile F1 0.914 (TensorRT
# model) / 0.927 (CPU model), score drift 0.02; max 0.954 / 0.884 (the CPU model fails the 0.90
# gate); entropy 0.833 / 0.871. Percentile is the only one passing the gate for both models;
# entropy loses on both.
DEFAULT_METHOD = "percentile"
ADVISED_IMAGES = 64  # below this the ranges depend too much on the particular images
MIN_IMAGES = 8  # below this calibration is refused
MIN_HOLDOUT = 2
MAX_HOLDOUT = 50  # held-out images cost three model runs each; 50 is plenty for the report
ENTROPY_NUM_BINS = 2048
ENTROPY_QUANTIZED_BINS = 256
PERCENTILE = 99.999
HISTOGRAM_SAMPLE_STRIDE = 7  # every 7th activation value goes into the histograms (ActivationHistograms)
SPLIT_SEED = 0

# Ops whose inputs get Q/DQ in the TensorRT model (ModelOpt's INT8 placement for CNNs).
TENSORRT_OP_TYPES = ("Conv", "Add", "Concat", "MaxPool", "Resize")


@dataclass
class CalibrationResult:
    model_dir: Path
    onnx_path: Path  # the FP32 model calibrated
    int8_path: Path  # TensorRT-ready Q/DQ (s8 symmetric)
    int8_cpu_path: Path  # ONNX Runtime CPU (u8 activations)
    report_path: Path
    report: Int8Report  # the TensorRT-ready model vs FP32 (run on ORT CPU)
    cpu_report: Int8Report  # the CPU model vs FP32
    method: str
    calibration_images: list[str]
    heldout_images: list[str]
    cache_path: Path
    cache_hit: bool
    timings_s: dict[str, float] = field(default_factory=dict)


# --- images -----------------------------------------------------------------------------
def list_images(images_dir: Path) -> list[Path]:
    """Image files under ``images_dir`` (recursive), sorted; clear errors for a bad folder."""
    images_dir = Path(images_dir)
    if not images_dir.is_dir():
        raise CalibrationError(f"calibration image folder not found: {images_dir}")
    files = sorted(p for p in images_dir.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise CalibrationError(
            f"no images in {images_dir} (looked for {', '.join(IMAGE_SUFFIXES)}, recursively)",
            hint=f"put {ADVISED_IMAGES}+ photos like the ones you will serve there",
        )
    return files


def split_images(
    files: Sequence[Path], *, num_images: int, holdout: float = 0.2
) -> tuple[list[Path], list[Path]]:
    """Deterministic shuffle → (calibration images, held-out images), disjoint.

    ``holdout`` below 1 is a fraction of the files (at least 2, at most 50 images), otherwise a
    count. Calibration takes up to ``num_images`` of the rest.
    """
    order = np.random.default_rng(SPLIT_SEED).permutation(len(files))
    shuffled = [files[i] for i in order]
    if holdout >= 1:
        n_hold = int(holdout)
    else:
        n_hold = min(max(MIN_HOLDOUT, round(holdout * len(files))), MAX_HOLDOUT)
    n_hold = min(n_hold, max(len(files) - MIN_IMAGES, 0))
    heldout, rest = shuffled[:n_hold], shuffled[n_hold:]
    return sorted(rest[:num_images]), sorted(heldout)


def read_images(paths: Sequence[Path], console=None) -> tuple[list[Path], list[np.ndarray]]:
    """Decode with the serving decoder; unreadable files are skipped with a warning."""
    good, arrays = [], []
    for path in paths:
        try:
            arrays.append(decode_image(Path(path).read_bytes()))
            good.append(Path(path))
        except (OSError, YolopipeError) as exc:
            _warn(console, f"skipping {path}: {exc}")
    return good, arrays


def _warn(console, message: str) -> None:
    if console is not None:
        console.print(f"[yellow]warning:[/yellow] {message}")
    else:
        logging.getLogger(__name__).warning(message)


def model_input(img_bgr: np.ndarray, imgsz: int) -> np.ndarray:
    """One decoded image → the ``[1, 3, S, S]`` float32 the model sees at inference."""
    return to_input([letterbox(img_bgr, imgsz)[0]])


# --- the head tail ----------------------------------------------------------------------
def head_tail_nodes(model) -> list[str]:
    """Names of the nodes after the detection head's last convolutions, to keep float.

    YOLOv8's Detect head ends each branch (box distribution ``cv2`` and class logits ``cv3``,
    at each of the three pyramid levels) with a plain Conv. After those comes bookkeeping over
    all anchors: flatten H×W into the anchor axis (Reshape to rank 3), concat the levels, the
    DFL softmax and its fixed 16-tap conv, the distance→box decode with anchor and stride
    constants, the class sigmoid, and the final concat of box pixels (0..imgsz) with scores
    (0..1). Quantized, that last concat shares one scale between both, and with a scale fit
    for 640-pixel boxes every score rounds to 0: zero detections. The decode arithmetic is
    equally scale-sensitive, and it is cheap, so all of it stays float.

    Found from the structure, not from names: the "flatten" nodes are the Reshapes that turn a
    rank-4 map into a rank-3 tensor; the tail is every node reachable from them, plus the
    non-Conv nodes between a head Conv and its flatten (older exports concat the box and class
    maps of a level before flattening).
    """
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        if vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    nodes = list(model.graph.node)
    producer = {out: n for n in nodes for out in n.output}
    consumers: dict[str, list] = {}
    for n in nodes:
        for name in n.input:
            consumers.setdefault(name, []).append(n)

    flattens = [
        n for n in nodes
        if n.op_type in ("Reshape", "Flatten") and ranks.get(n.input[0]) == 4 and ranks.get(n.output[0]) == 3
    ]
    if not flattens:
        raise CalibrationError("cannot find the detection head in this ONNX model (no rank-4 → rank-3 reshape)")
    tail: dict[str, Any] = {}
    pending = deque(flattens)
    while pending:  # everything downstream of the flattens
        node = pending.popleft()
        if node.name in tail:
            continue
        tail[node.name] = node
        for out in node.output:
            pending.extend(consumers.get(out, []))
    for node in flattens:  # and the per-level concats between the last Convs and the flattens
        up = producer.get(node.input[0])
        while up is not None and up.op_type in ("Concat", "Reshape", "Transpose") and up.name not in tail:
            tail[up.name] = up
            up = producer.get(up.input[0])
    return [n.name for n in nodes if n.name in tail]


def head_output_convs(model) -> list[str]:
    """The detection head's last Convs (``cv2.*.2`` box distributions, ``cv3.*.2`` class logits).

    Found from the structure: the Convs outside the head tail whose outputs feed it.
    """
    tail = set(head_tail_nodes(model))
    producer = {out: n for n in model.graph.node for out in n.output}
    found = {
        producer[name].name
        for n in model.graph.node if n.name in tail
        for name in n.input
        if name in producer and producer[name].name not in tail and producer[name].op_type == "Conv"
    }
    return [n.name for n in model.graph.node if n.name in found]


def head_branch_nodes(model) -> list[str]:
    """Every node of the head's box and class branches (``cv2.*``, ``cv3.*``: Conv-SiLU, Conv-SiLU, Conv).

    Walks up from ``head_output_convs`` to the neck feature maps where the branches split: the
    tensors read by two or more Convs (each level's ``cv2`` and ``cv3`` start there).
    """
    nodes = list(model.graph.node)
    producer = {out: n for n in nodes for out in n.output}
    conv_readers: dict[str, int] = {}
    for n in nodes:
        if n.op_type == "Conv":
            for name in n.input:
                conv_readers[name] = conv_readers.get(name, 0) + 1
    branch: set[str] = set()
    by_name = {n.name: n for n in nodes}
    pending = deque(by_name[name] for name in head_output_convs(model))
    while pending:
        node = pending.popleft()
        if node.name in branch:
            continue
        branch.add(node.name)
        for name in node.input:
            if name in producer and conv_readers.get(name, 0) < 2:
                pending.append(producer[name])
    return [n.name for n in nodes if n.name in branch]


# --- calibration ------------------------------------------------------------------------
def entropy_threshold(hist: np.ndarray, edges: np.ndarray, lowest, highest, num_quantized_bins: int):
    """ORT's ``HistogramCollector.get_entropy_threshold``, vectorised over each candidate's bins.

    Same candidates (symmetric windows around the zero bin, growing one bin per side), same
    reference ``p`` (outliers folded into the end bins), same ``q`` (merge into
    ``num_quantized_bins``, spread back over the non-empty bins with ORT's integer division),
    same smoothing and KL divergence; the first minimum wins, as with ``np.argmin``.
    """
    num_bins = hist.size
    zero = num_bins // 2
    half_q = num_quantized_bins // 2
    hist = hist.astype(np.int64)
    cumsum = np.concatenate([[0], np.cumsum(hist)])
    dtype = edges.dtype
    best_kl, best = np.inf, None
    for i in range(half_q, zero + 1):
        start, end = zero - i, min(zero + i + 1, num_bins)
        sliced = hist[start:end]
        p = sliced.copy()
        p[0] += cumsum[start]
        p[-1] += cumsum[-1] - cumsum[end]
        nonzero = p != 0
        merged = sliced.size // num_quantized_bins
        body = num_quantized_bins * merged
        quantized = sliced[:body].reshape(num_quantized_bins, merged).sum(axis=1)
        quantized[-1] += sliced[body:].sum()
        norm = nonzero[:body].reshape(num_quantized_bins, merged).sum(axis=1)
        per_bin = np.zeros(num_quantized_bins, np.int64)
        np.floor_divide(quantized, norm, out=per_bin, where=norm != 0)  # ORT stores q as int64
        q = np.zeros(p.size, np.int64)
        q[:body] = np.repeat(per_bin, merged)
        kl = _kl_smoothed(p, q)
        if kl < best_kl:
            best_kl, best = kl, (edges[start], edges[end])
    if best is None:  # every candidate degenerate (ORT then takes the first one)
        best = (edges[zero - half_q], edges[min(zero + half_q + 1, num_bins)])
    lo, hi = np.array(best[0], dtype), np.array(best[1], dtype)
    # Like ORT: never wider than the values actually seen.
    return max(lo, lowest), min(hi, highest)


def _smooth(p: np.ndarray, eps: float = 0.0001) -> np.ndarray | None:
    """ORT's ``smooth_distribution`` (float32 arithmetic kept)."""
    is_zero = p == 0
    n_zero = int(is_zero.sum())
    n_nonzero = p.size - n_zero
    if not n_nonzero:
        return None
    eps1 = eps * float(n_zero) / float(n_nonzero)
    out = p.astype(np.float32)
    out += eps * is_zero.astype(np.float32) + (-eps1) * (~is_zero).astype(np.float32)
    return out


def _kl_smoothed(p: np.ndarray, q: np.ndarray) -> float:
    ps, qs = _smooth(p), _smooth(q)
    if ps is None or qs is None:
        return np.inf
    ps = ps / ps.sum()
    qs = qs / qs.sum()
    if (ps <= 0).any() or (qs <= 0).any():
        return np.inf
    return float(np.sum(ps * np.log(ps / qs), dtype=np.float32))


class _OneBatch:
    """A CalibrationDataReader that hands ORT one input dict, once."""

    def __init__(self, feed: dict[str, np.ndarray]) -> None:
        self._feed: dict[str, np.ndarray] | None = feed

    def get_next(self):
        feed, self._feed = self._feed, None
        return feed

    def __len__(self) -> int:
        return 1


class ActivationHistograms:
    """ORT's ``HistogramCollector.collect_value`` (entropy and asymmetric percentile), faster.

    Same histograms: ``num_bins`` bins over ``[-t, t]`` with ``t`` the largest |value| seen by
    the first image, the range growing by whole bins of the same width when a later image goes
    further (ORT's ``merge_histogram``), and the exact min and max of every value. What changes:
    only every ``sample_stride``-th value of a tensor goes into the histogram. Histogramming the
    ~106 M activation values of one 640×640 image was the calibration's cost (~1 s per image on
    2 cores); a prime stride (it never lines up with the power-of-two and ×5 feature-map sizes,
    so every row, column and channel is sampled) cuts it by that factor while the threshold
    searches see the same distribution (bench/int8_calibration.py reports how far the ranges
    move). ``sample_stride=1`` gives ORT's histograms exactly.
    """

    def __init__(self, num_bins: int = ENTROPY_NUM_BINS, sample_stride: int = HISTOGRAM_SAMPLE_STRIDE) -> None:
        self.num_bins = num_bins
        self.sample_stride = sample_stride
        # name → (hist, edges, lowest, highest, threshold), ORT's histogram_dict layout
        self.histograms: dict[str, tuple] = {}

    def add(self, name: str, values: np.ndarray) -> None:
        flat = np.ravel(values)
        if flat.size:
            lowest, highest = np.nanmin(flat), np.nanmax(flat)
        else:
            lowest = highest = np.array(0, flat.dtype)
        threshold = np.array(max(abs(lowest), abs(highest)), dtype=flat.dtype)
        sample = flat[:: self.sample_stride]
        old = self.histograms.get(name)
        if old is None:
            hist, edges = np.histogram(sample, self.num_bins, range=(-threshold, threshold))
            self.histograms[name] = (hist, edges, lowest, highest, threshold)
            return
        old_hist, old_edges, old_lowest, old_highest, old_threshold = old
        lowest, highest = min(old_lowest, lowest), max(old_highest, highest)
        if threshold <= old_threshold:
            hist, _ = np.histogram(sample, len(old_hist), range=(-old_threshold, old_threshold))
            self.histograms[name] = (hist + old_hist, old_edges, lowest, highest, old_threshold)
        elif old_threshold == 0:
            hist, edges = np.histogram(sample, len(old_hist), range=(-threshold, threshold))
            self.histograms[name] = (hist + old_hist, edges, lowest, highest, threshold)
        else:  # grow by whole bins of the old width on both sides, the old counts in the middle
            old_width = 2 * old_threshold / len(old_hist)
            grow = int((threshold - old_threshold) // old_width + 1)
            threshold = grow * old_width + old_threshold
            hist, edges = np.histogram(sample, len(old_hist) + 2 * grow, range=(-threshold, threshold))
            hist[grow : len(hist) - grow] += old_hist
            self.histograms[name] = (hist, edges, lowest, highest, threshold)


def percentile_range(hist: np.ndarray, edges: np.ndarray, lowest, highest, percentile: float):
    """ORT's asymmetric ``compute_percentile``: cut ``(100 - percentile) / 2`` % off each side."""
    cdf = np.cumsum(hist / hist.sum())
    cut = (100.0 - percentile) / 200.0
    lo = np.array(edges[np.searchsorted(cdf, cut)], edges.dtype)
    hi = np.array(edges[np.searchsorted(cdf, 1.0 - cut)], edges.dtype)
    return (lowest if lo < lowest else lo), (highest if hi > highest else hi)


def ranges_from_histograms(histograms: dict[str, tuple], method: str):
    """Per-tensor ranges (ORT ``TensorsData``) of one method from collected histograms."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    ranges = {}
    for name, (hist, edges, lowest, highest, _threshold) in histograms.items():
        if method == "entropy":
            lo, hi = entropy_threshold(hist, edges, lowest, highest, ENTROPY_QUANTIZED_BINS)
        elif method == "percentile":
            lo, hi = percentile_range(hist, edges, lowest, highest, PERCENTILE)
        elif method == "max":
            lo, hi = lowest, highest
        else:
            raise CalibrationError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
        ranges[name] = TensorData(lowest=np.asarray(lo, np.float32), highest=np.asarray(hi, np.float32))
    return TensorsData(getattr(CalibrationMethod, {"entropy": "Entropy", "percentile": "Percentile",
                                                  "max": "MinMax"}[method]), ranges)


def _with_progress(images: Sequence[np.ndarray], label: str, console=None):
    """The images one by one, under one progress bar for the calibration pass."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn(f"calibrating ({label})"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, transient=False,
    ) as progress:
        task = progress.add_task("calibrate", total=len(images))
        for img in images:
            yield img
            progress.advance(task)


def collect_histograms(
    onnx_path: Path, input_name: str, images: Sequence[np.ndarray], *, imgsz: int, console=None,
    sample_stride: int = HISTOGRAM_SAMPLE_STRIDE, label: str = "histograms",
) -> dict[str, tuple]:
    """Run the augmented model (every float tensor an output, ORT's choice of tensors) over the
    images one at a time and histogram every tensor (``ActivationHistograms``)."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    collector = ActivationHistograms(ENTROPY_NUM_BINS, sample_stride)
    with tempfile.TemporaryDirectory(prefix="yolopipe-calib-") as tmp:
        # ORT builds the augmented model and its session; the loop over outputs is ours.
        calibrator = create_calibrator(
            Path(onnx_path), None, augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=CalibrationMethod.Entropy, extra_options={"symmetric": False},
        )
        session = calibrator.infer_session
        output_names = [o.name for o in session.get_outputs()]
        wanted = set(calibrator.tensors_to_calibrate)
        for img in _with_progress(images, label, console):
            outputs = session.run(None, {input_name: model_input(img, imgsz)})
            for name, values in zip(output_names, outputs):
                if name in wanted:
                    collector.add(name, values)
            del outputs
        del calibrator, session
    return collector.histograms


def collect_ranges(
    onnx_path: Path, input_name: str, images: Sequence[np.ndarray], method: str, *, imgsz: int, console=None,
    sample_stride: int = HISTOGRAM_SAMPLE_STRIDE,
):
    """Per-tensor ranges (ORT ``TensorsData``) from decoded images, with a progress bar.

    Ranges are asymmetric: the s8 model symmetrises them (max |lo|, |hi|, what
    CalibTensorRangeSymmetric would do), the u8 model uses them as they are.
    """
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    if method in ("entropy", "percentile"):
        histograms = collect_histograms(onnx_path, input_name, images, imgsz=imgsz, console=console,
                                        sample_stride=sample_stride, label=method)
        return ranges_from_histograms(histograms, method)
    if method != "max":
        raise CalibrationError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
    with tempfile.TemporaryDirectory(prefix="yolopipe-calib-") as tmp:
        calibrator = create_calibrator(
            Path(onnx_path), None, augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=CalibrationMethod.MinMax, extra_options={"symmetric": False},
        )
        for img in _with_progress(images, method, console):
            # ORT prints a line per call; keep the progress bar readable.
            with contextlib.redirect_stdout(io.StringIO()):
                calibrator.collect_data(_OneBatch({input_name: model_input(img, imgsz)}))
        with contextlib.redirect_stdout(io.StringIO()):
            return calibrator.compute_data()


def _cache_method(method: str) -> str:
    """The method as a cache key, with the settings that change its ranges."""
    if method == "entropy":
        return f"entropy{ENTROPY_NUM_BINS}x{ENTROPY_QUANTIZED_BINS}s{HISTOGRAM_SAMPLE_STRIDE}"
    if method == "percentile":
        return f"percentile{PERCENTILE}s{HISTOGRAM_SAMPLE_STRIDE}"
    return method


# --- writing the Q/DQ models ------------------------------------------------------------
def write_qdq_model(
    onnx_path: Path,
    out_path: Path,
    ranges_path: Path,
    method: str,
    *,
    target: str,
    exclude_head_tail: bool = True,
    float_head_outputs: bool = True,
    extra_float_nodes: Sequence[str] = (),
) -> Path:
    """Write a Q/DQ model from cached ranges. ``target``: "tensorrt" (s8) or "cpu" (u8 activations).

    ``float_head_outputs`` also keeps the head's six last Convs float (``head_output_convs``:
    1×1 convs producing the box distributions and class logits, ~0.1 % of the model's FLOPs, so
    cheap in FP32 on TensorRT); quantized, they lost a box on the bench's held-out photos and
    added score drift (bench/results/*-int8-calibration-cpu.json).
    ``extra_float_nodes`` are further node names to keep float.
    ``exclude_head_tail=False`` quantizes the whole graph; it exists to show (and test) that
    this breaks YOLOv8 and that the accuracy gate catches it.
    """
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    ort_method = {"entropy": CalibrationMethod.Entropy, "max": CalibrationMethod.MinMax,
                  "percentile": CalibrationMethod.Percentile}[method]
    model = onnx.load(str(onnx_path))
    exclude = head_tail_nodes(model) if exclude_head_tail else []
    if exclude_head_tail and float_head_outputs:
        exclude += head_output_convs(model)
    exclude += list(extra_float_nodes)  # for sensitivity studies (bench/int8_calibration.py)
    if target == "tensorrt":
        kwargs = {
            "activation_type": QuantType.QInt8,
            "op_types_to_quantize": list(TENSORRT_OP_TYPES),
            "extra_options": {
                "ActivationSymmetric": True,
                "WeightSymmetric": True,
                "CalibTensorRangeSymmetric": True,  # no effect with cached ranges; says the intent
                "QuantizeBias": False,  # TensorRT cannot parse DQ of an int32 bias
                "AddQDQPairToWeight": True,  # float weights + Q→DQ: TensorRT folds them itself
                # Inputs only, as ModelOpt places them: a Q on a Conv output would quantize the
                # pre-activation (SiLU input) and the head's box and class logits.
                "OpTypesToExcludeOutputQuantization": list(TENSORRT_OP_TYPES),
            },
        }
    elif target == "cpu":
        kwargs = {
            "activation_type": QuantType.QUInt8,
            "op_types_to_quantize": None,  # everything ORT can quantize: the most fused kernels
            "extra_options": {"ActivationSymmetric": False, "WeightSymmetric": True},
        }
    else:
        raise ValueError(f"unknown target {target!r}")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # ORT logs "consider pre-processing" warnings at WARNING level
    try:
        quantize_static(
            str(onnx_path),
            str(out_path),
            calibration_data_reader=None,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            reduce_range=False,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=exclude,
            calibrate_method=ort_method,
            calibration_cache_path=str(ranges_path),
            **kwargs,
        )
    finally:
        root.setLevel(level)
    return Path(out_path)


# --- the whole command ------------------------------------------------------------------
def check_accuracy(report: Int8Report, *, min_f1: float, allow_low_accuracy: bool, heldout_dir: str = "") -> None:
    """The accuracy gate: ``CalibrationError`` when F1 is below ``min_f1`` (unless allowed)."""
    if report.f1 >= min_f1 or allow_low_accuracy:
        return
    lost = f"; INT8 found nothing on {len(report.lost_all)} of them" if report.lost_all else ""
    raise CalibrationError(
        f"{report.int8_model} agrees with FP32 at F1 {report.f1:.3f} on {report.images} held-out images"
        f"{heldout_dir}, below the required {min_f1:.2f}{lost}; the INT8 models were not installed",
        hint="use more images like the ones you serve, try --method max or percentile, "
        "or accept it with --allow-low-accuracy",
    )


def calibrate(
    weights: str = "sample",
    images_dir: Path | str | None = None,
    *,
    num_images: int = 512,
    method: str = DEFAULT_METHOD,
    imgsz: int = 640,
    artifacts_dir: Path | None = None,
    holdout: float = 0.2,
    min_f1: float = 0.90,
    allow_low_accuracy: bool = False,
    console=None,
    calibration_root: Path = CALIBRATION_ROOT,
    min_images: int = MIN_IMAGES,
    exclude_head_tail: bool = True,
) -> CalibrationResult:
    """Calibrate ``weights`` on the images in ``images_dir`` and write the INT8 models + report.

    Raises ``CalibrationError`` for an unusable folder (missing, empty, unreadable, fewer than
    ``min_images`` calibration images besides the held-out ones) and when the TensorRT-ready
    model's F1 against FP32 on the held-out images is below ``min_f1`` (then the new models are
    not installed; the report is still written) unless ``allow_low_accuracy``.
    """
    from rich.console import Console

    from app.builder.export import export_onnx
    from app.weights import sha256_file

    console = console or Console(stderr=True)
    if method not in METHODS:
        raise CalibrationError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
    if images_dir is None:
        raise CalibrationError("no calibration images given", hint="pass --images DIR")
    images_dir = Path(images_dir)
    if num_images < 1:
        raise CalibrationError(f"num_images must be positive, got {num_images}")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    files = list_images(images_dir)
    calib_files, heldout_files = split_images(files, num_images=num_images, holdout=holdout)
    if len(calib_files) < min_images:
        raise CalibrationError(
            f"{len(files)} images in {images_dir} leave {len(calib_files)} for calibration besides "
            f"{len(heldout_files)} held out; at least {min_images} are needed, {ADVISED_IMAGES}+ advised",
            hint=f"add images like the ones you will serve ({ADVISED_IMAGES + len(heldout_files)}+ in the folder)",
        )

    exported = export_onnx(weights, imgsz=imgsz, artifacts_dir=artifacts_dir)
    onnx_path, meta, model_dir = exported.onnx_path, exported.meta, exported.onnx_path.parent
    timings["export_s"] = time.perf_counter() - t0

    # Held-out images first: they are needed whether or not the ranges are cached.
    heldout_paths, heldout_images = read_images(heldout_files, console)
    if not heldout_images:
        raise CalibrationError(f"none of the {len(heldout_files)} held-out images in {images_dir} could be read")

    cache_path = calibration_cache_path(meta.onnx_sha256 or sha256_file(onnx_path), _cache_method(method),
                                        images_digest(calib_files), calibration_root)
    cache_hit = cache_path.is_file()
    t1 = time.perf_counter()
    if cache_hit:
        console.print(f"calibration ranges from the cache: {cache_path}")
        calib_used = list(calib_files)
    else:
        calib_used, calib_images = read_images(calib_files, console)
        if len(calib_used) < min_images:
            raise CalibrationError(
                f"only {len(calib_used)} of {len(calib_files)} calibration images could be read; "
                f"at least {min_images} are needed, {ADVISED_IMAGES}+ advised"
            )
        if len(calib_used) < ADVISED_IMAGES:
            _warn(console, f"calibrating on {len(calib_used)} images; {ADVISED_IMAGES}+ give steadier ranges")
        from onnxruntime.quantization.calibrate import save_tensors_data

        ranges = collect_ranges(onnx_path, meta.input_name, calib_images, method, imgsz=imgsz, console=console)
        del calib_images
        save_tensors_data(ranges, cache_path)
    timings["calibration_s"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    final_trt, final_cpu = int8_qdq_model_path(model_dir), int8_cpu_model_path(model_dir, must_exist=False)
    tmp_trt = final_trt.with_name(final_trt.stem + ".new.onnx")
    tmp_cpu = final_cpu.with_name(final_cpu.stem + ".new.onnx")
    write_qdq_model(onnx_path, tmp_trt, cache_path, method, target="tensorrt", exclude_head_tail=exclude_head_tail)
    write_qdq_model(onnx_path, tmp_cpu, cache_path, method, target="cpu", exclude_head_tail=exclude_head_tail)
    timings["write_models_s"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    names = [str(p.relative_to(images_dir)) if p.is_relative_to(images_dir) else str(p) for p in heldout_paths]
    report, fp32_dets = compare_models(onnx_path, tmp_trt, meta, heldout_images, names)
    cpu_report, _ = compare_models(onnx_path, tmp_cpu, meta, heldout_images, names, fp32_detections=fp32_dets)
    report.int8_model, cpu_report.int8_model = final_trt.name, final_cpu.name
    timings["report_s"] = time.perf_counter() - t3
    print_report([report, cpu_report], console)

    passed = report.f1 >= min_f1 and cpu_report.f1 >= min_f1
    payload = {
        "model": meta.name,
        "fp32_onnx_sha256": meta.onnx_sha256,
        "method": method,
        "imgsz": imgsz,
        "calibration_images": len(calib_used),
        "heldout_images": [str(p) for p in heldout_paths],
        "min_f1": min_f1,
        "passed": passed,
        "installed": passed or allow_low_accuracy,
        "cache": str(cache_path),
        "cache_hit": cache_hit,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        **report.to_json(),
        "cpu_variant": cpu_report.to_json(),
    }
    report_path = int8_report_path(model_dir)
    save_report(report_path, payload)
    try:
        check_accuracy(report, min_f1=min_f1, allow_low_accuracy=allow_low_accuracy)
        check_accuracy(cpu_report, min_f1=min_f1, allow_low_accuracy=allow_low_accuracy)
    except CalibrationError:
        tmp_trt.unlink(missing_ok=True)
        tmp_cpu.unlink(missing_ok=True)
        raise
    tmp_trt.replace(final_trt)
    tmp_cpu.replace(final_cpu)
    return CalibrationResult(
        model_dir=model_dir,
        onnx_path=onnx_path,
        int8_path=final_trt,
        int8_cpu_path=final_cpu,
        report_path=report_path,
        report=report,
        cpu_report=cpu_report,
        method=method,
        calibration_images=[str(p) for p in calib_used],
        heldout_images=[str(p) for p in heldout_paths],
        cache_path=cache_path,
        cache_hit=cache_hit,
        timings_s=timings,
    )

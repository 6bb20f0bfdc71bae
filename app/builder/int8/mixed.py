"""Accuracy-controlled mixed precision of one installed model (the idea of NNCF's
``quantize_with_accuracy_control``): measure each layer's sensitivity on the model itself, then
revert the most sensitive layers one by one until the held-out agreement holds.

The sensitivities are cached as JSON next to the calibration ranges, keyed by everything they
depend on (the FP32 model, the ranges, the target and its float nodes, the held-out images): a
rerun with ``--allow-low-accuracy``, another ``--min-f1`` or ``--max-float-layers`` reads them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.builder.int8.report import HeldOut, Int8Report
from app.builder.int8.sensitivity import (
    SHORTLIST,
    LayerSensitivity,
    candidates,
    flops_share,
    layer_sensitivity,
    with_reverted,
)

PLACEMENT_VERSION = "v3"  # bump when the Q/DQ placement changes: cached sensitivities are then stale
# The CPU model's reverted layers run unfused at FP32 speed, and SiLU in float already puts it at
# 0.66x FP32: 4.8 % of the FLOPs reverted made 0.72x, with no gain on another distribution
# (bench/results/2026-12-01-int8-cpu-placement-cpu-mixed-on.json). So off by default; raise it to try.
MAX_CPU_FLOAT_SHARE = 0.0


@dataclass
class MixedPrecisionChoice:
    """What accuracy control chose for one model: the layers it reverted to float and the model's report with them."""

    report: Int8Report
    layers: list[str] = field(default_factory=list)  # reverted, most sensitive first
    sensitivity: list[LayerSensitivity] = field(default_factory=list)
    cache_hit: bool = False


def sensitivity_key(*parts: object) -> str:
    return hashlib.sha256("\x00".join(str(p) for p in parts).encode()).hexdigest()


def load_sensitivity(path: Path) -> list[LayerSensitivity] | None:
    if not path.is_file():
        return None
    return [LayerSensitivity(**row) for row in json.loads(path.read_text())["ranked"]]


def save_sensitivity(path: Path, ranked: Sequence[LayerSensitivity], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**meta, "ranked": [s.to_json() for s in ranked]}, indent=1) + "\n")
    tmp.replace(path)


def accuracy_control(target: str, qdq_path: Path, fp32_path: Path, report: Int8Report, subset: HeldOut,
                     evaluate: Callable[[Path], Int8Report], done: Callable[[Int8Report], bool], *,
                     skip_nodes: Sequence[str], flops: dict[str, int], cap: int, cache_path: Path,
                     noise: Callable[[list[str]], dict[str, float]] | None = None,
                     base_model=None, finish: Callable | None = None,
                     console=None, progress: Callable = iter) -> MixedPrecisionChoice:
    """Revert the most sensitive layers of the model at ``qdq_path`` (rewritten in place) until
    ``done(report)`` or the cap: ``cap`` layers, and for the CPU model ``MAX_CPU_FLOAT_SHARE`` of the
    FLOPs (its float Convs run at FP32 speed).

    ``noise`` (layers → rounding noise over signal) shortlists the layers measured on images.
    ``base_model``: the Q/DQ model layers are reverted in (default: the file at ``qdq_path``);
    ``finish``: applied to every reverted copy before it is run or saved (the TensorRT model's
    activation shift, ``shift.py``, is applied after the reverting).
    The cap is tried first (one evaluation on the held-out images); if it reaches the target,
    the fewest layers that still do are found by bisection (a few more)."""
    import onnx

    base = base_model if base_model is not None else onnx.load(str(qdq_path))
    finish = finish or (lambda model: model)
    ranked = load_sensitivity(cache_path)
    hit = ranked is not None
    if hit:
        _print(console, f"{target} model: layer sensitivities from the cache: {cache_path}")
    else:
        layers = candidates(base, target, skip_nodes)
        if noise is not None and len(layers) > SHORTLIST:
            ratios = noise(layers)
            layers = sorted(layers, key=lambda layer: -ratios.get(layer, 0.0))[:SHORTLIST]
        _print(console, f"{target} model: measuring the sensitivity of {len(layers)} Convs on {len(subset)} "
                        "held-out images")
        _, ranked = layer_sensitivity(fp32_path, qdq_path, layers, subset, flops, target=target,
                                      base_model=base, finish=finish, progress=lambda seq: progress(seq, len(layers), f"sensitivity ({target})"))
        save_sensitivity(cache_path, ranked, {"target": target, "images": subset.names})
    order: list[str] = []
    for layer in (s.layer for s in ranked):
        if len(order) >= cap:
            break
        if target != "cpu" or flops_share([*order, layer], flops) <= MAX_CPU_FLOAT_SHARE:  # read at call time
            order.append(layer)
    what = "pre-activations" if target == "cpu" else "Convs"
    tried: dict[int, Int8Report] = {0: report}
    on_disk = [0]

    def attempt(k: int) -> Int8Report:
        onnx.save(finish(with_reverted(base, target, order[:k])), str(qdq_path))
        on_disk[0] = k
        tried[k] = evaluate(qdq_path)
        r = tried[k]
        _print(console, f"{target} model: {k} {what} kept float ({flops_share(order[:k], flops):.1%} of the "
                        f"FLOPs): F1 {r.f1:.3f} [{r.f1_ci95[0]:.3f}, {r.f1_ci95[1]:.3f}]")
        return r

    if not order or done(report):
        return MixedPrecisionChoice(report, [], list(ranked), hit)
    best = len(order)
    if done(attempt(best)):
        lo, hi = 0, best  # done(tried[lo]) is False, done(tried[hi]) is True
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if done(attempt(mid)) else (mid, hi)
        best = hi
    if on_disk[0] != best:  # the file installed is the one chosen
        onnx.save(finish(with_reverted(base, target, order[:best])), str(qdq_path))
    return MixedPrecisionChoice(tried[best], order[:best], list(ranked), hit)


def _print(console, message: str) -> None:
    if console is not None:
        console.print(message, highlight=False)

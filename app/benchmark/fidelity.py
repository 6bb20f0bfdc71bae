"""How close two detectors or two decoders are: detection agreement and pixel differences.

``agreement``: boxes matched one to one (same class, IoU ≥ 0.5, greedy by IoU, as
``app.boxes.match_pairs``) over a set of images → F1 and the largest score difference of a
matched pair. ``pixel_diff``: a decoded image against OpenCV's decode of the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from app.boxes import f1, match_pairs

Boxes = tuple[np.ndarray, np.ndarray, np.ndarray]  # xyxy [N, 4], scores [N], class ids [N]


def agreement(pairs: Iterable[tuple[Boxes, Boxes]], iou_thr: float = 0.5, *, conf: float = 0.25,
              margin: float = 0.01) -> dict[str, Any]:
    """``(reference, ours)`` per image → ``f1``, ``max_abs_dscore``, ``tp``, ``n_ref``, ``n_ours``;
    and ``f1_outside_margin``: F1 when unmatched boxes scored within ``margin`` of ``conf`` (on
    either side, so a score moved by less than ``margin`` can flip them) are left out."""
    tp = n_ref = n_ours = borderline = 0
    max_d = 0.0
    for (rb, rs, rc), (b, s, c) in pairs:
        matched = match_pairs(rb, rc, b, c, iou_thr)
        tp += len(matched)
        n_ref += len(rc)
        n_ours += len(c)
        for i, j, _ in matched:
            max_d = max(max_d, abs(float(rs[i]) - float(s[j])))
        seen_ref = {i for i, _, _ in matched}
        seen_ours = {j for _, j, _ in matched}
        borderline += sum(1 for i in range(len(rc)) if i not in seen_ref and rs[i] < conf + margin)
        borderline += sum(1 for j in range(len(c)) if j not in seen_ours and s[j] < conf + margin)
    return {"f1": round(f1(tp, n_ref, n_ours), 5), "max_abs_dscore": round(max_d, 5), "tp": tp, "n_ref": n_ref,
            "n_ours": n_ours, "borderline_unmatched": borderline,
            "f1_outside_margin": round(2 * tp / max(1, n_ref + n_ours - borderline), 5), "margin": margin}


def pixel_diff(ours: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    """Share of pixel values that differ, mean and max absolute difference (levels)."""
    if ours.shape != ref.shape:
        return {"shape_ok": False, "shape": list(ours.shape), "ref_shape": list(ref.shape)}
    d = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
    return {"shape_ok": True, "differing_pct": round(100.0 * float((d > 0).mean()), 4),
            "mean_abs": round(float(d.mean()), 5), "max_abs": int(d.max())}


def summarize_diffs(diffs: list[dict[str, Any]]) -> dict[str, Any]:
    """Diffs of many images → one row: shapes wrong, mean of shares and means, worst max."""
    ok = [d for d in diffs if d.get("shape_ok")]
    return {
        "images": len(diffs),
        "shape_mismatches": len(diffs) - len(ok),
        "differing_pct": round(float(np.mean([d["differing_pct"] for d in ok])), 4) if ok else None,
        "mean_abs": round(float(np.mean([d["mean_abs"] for d in ok])), 5) if ok else None,
        "max_abs": max((d["max_abs"] for d in ok), default=None),
    }

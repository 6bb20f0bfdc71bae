"""Per-batch stage timeline: CUDA events on each stream plus host times, on one clock.

Off by default (each batch then records nothing). ``GpuPipeline.diagnose(timeline=True)`` starts
one, which records, for every batch until it is closed (``close``, or its ``with``), events
around its decode (the decoder's stream), its upload (the copy stream) and its graph (the
compute stream), and host ``perf_counter`` marks. Once a batch is done, its events are turned
into milliseconds since the timeline's reference event, which was recorded (and waited for) when
the host clock read ``t0``; so GPU intervals and host marks share one time axis, to within the
few microseconds that wait takes.

``summary()`` says how busy the compute stream was between its first and last graph, how much
of the decode and upload time overlapped with compute, and ``decode_hidden_pct``: the share of
batches whose decode was over before the graph of the batch before them was (batch N+1 decoded
while the engine ran batch N). That last one is the overlap the pipeline exists for: an
interval that merely overlaps can be a decode stalled until the engine is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GPU_STAGES = ("decode", "upload", "compute")


@dataclass
class BatchMarks:
    """One batch's events (start, end) per GPU stage, and host marks (``perf_counter``)."""

    batch: int
    events: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    def record(self, stage: str, end: bool, stream) -> None:
        start_ev, end_ev = self.events[stage]
        (end_ev if end else start_ev).record(stream)

    def mark(self, name: str) -> None:
        self.host[name] = time.perf_counter()


class Timeline:
    def __init__(self, reference_stream, on_close: Callable[[Timeline], None] = lambda timeline: None) -> None:
        """``on_close(self)``: called by ``close``, so the pipeline recording into it stops."""
        import torch

        self._torch = torch
        self._on_close = on_close
        self._lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(reference_stream)
        self._ref.synchronize()
        self.t0 = time.perf_counter()

    def begin(self, batch: int, gpu_stages: tuple[str, ...]) -> BatchMarks:
        torch = self._torch
        marks = BatchMarks(batch)
        for stage in gpu_stages:
            marks.events[stage] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        marks.mark("start")
        return marks

    def finish(self, marks: BatchMarks) -> None:
        """After the batch's ``done`` event: its events are complete, so reading them cannot block."""
        marks.mark("end")
        rec: dict[str, Any] = {"batch": marks.batch}
        for stage, (start_ev, end_ev) in marks.events.items():
            try:  # a stage this batch did not have (no GPU-decoded JPEG in it) was never recorded
                rec[stage] = [round(self._ref.elapsed_time(start_ev), 4), round(self._ref.elapsed_time(end_ev), 4)]
            except RuntimeError:
                pass
        for name, t in marks.host.items():
            rec[f"host_{name}"] = round((t - self.t0) * 1e3, 4)
        with self._lock:
            self.records.append(rec)

    def summary(self) -> dict[str, Any]:
        return summarize(self.records)

    def close(self) -> None:
        """No batch records into it from now on (a batch in flight may still finish its record)."""
        self._on_close(self)

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Busy fraction of the compute stream and the overlap of decode/upload with compute (ms)."""
    compute = _union([tuple(r["compute"]) for r in records if "compute" in r])
    if not compute:
        return {"batches": len(records)}
    span = compute[-1][1] - compute[0][0]
    busy = sum(e - s for s, e in compute)
    out: dict[str, Any] = {
        "batches": len(records),
        "compute_span_ms": round(span, 3),
        "compute_busy_ms": round(busy, 3),
        "compute_busy_pct": round(100.0 * busy / span, 2) if span > 0 else None,
    }
    ordered = sorted((r for r in records if "compute" in r), key=lambda r: r["compute"][0])
    pairs = [(prev, cur) for prev, cur in zip(ordered, ordered[1:]) if "decode" in cur]
    if pairs:
        hidden = sum(cur["decode"][1] <= prev["compute"][1] for prev, cur in pairs)
        out["decode_hidden_pct"] = round(100.0 * hidden / len(pairs), 2)
    for stage in ("decode", "upload"):
        mine = _union([tuple(r[stage]) for r in records if stage in r])
        if mine:
            total = sum(e - s for s, e in mine)
            out[f"{stage}_ms"] = round(total, 3)
            out[f"{stage}_overlapping_compute_pct"] = round(100.0 * _overlap(mine, compute) / total, 2) if total else None
    return out

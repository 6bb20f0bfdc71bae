"""The result file and the table on the console.

Result JSON: ``machine``, ``versions``, ``config``, ``setup`` (graph captures per bucket),
``rows`` (flat: ``system``, ``backend``, ``precision``, ``input``, ``batch``, ``p50_ms``,
``p99_ms``, ``img_per_s``, ``decode``, ``mode`` ...), ``timeline`` (the stage timeline of the
best JPEG throughput row: per batch, ms since the run's reference event, for ``decode`` on the
decoder's stream, ``upload`` on the copy stream, ``compute`` on the compute stream, and host
marks), ``failures`` (parts skipped or failed, with why).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def add_overheads(rows: list[dict]) -> None:
    """yolopipe serial frames rows get their overhead over the bare engine of the same batch."""
    from app.benchmark.timing import overhead_pct

    bare = {(r["backend"], r["precision"], r["batch"]): r for r in rows if r.get("mode") == "bare"}
    for r in rows:
        if r["system"] != "yolopipe" or r.get("mode") != "serial" or r.get("input") != "frames":
            continue
        b = bare.get((r["backend"], r["precision"], r["batch"]))
        if b is not None:
            r["overhead_vs_bare_pct"] = overhead_pct(r["p50_ms"], b["p50_ms"])


def hoist_timeline(rows: list[dict]) -> dict[str, Any] | None:
    """Keep one full timeline (the fastest pipelined JPEG row's); the others keep their summary."""
    piped = [r for r in rows if r.get("mode") == "pipelined" and "timeline" in r]
    if not piped:
        return None
    jpeg = [r for r in piped if r["input"] == "jpeg"] or piped
    best = max(jpeg, key=lambda r: r.get("img_per_s") or 0)
    out = {"row": {k: best[k] for k in ("backend", "precision", "input", "batch", "decode", "img_per_s") if k in best},
           "summary": best["timeline_summary"], "batches": best["timeline"]}
    for r in piped:
        r.pop("timeline")
    return out


def write(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def describe(r: dict) -> str:
    """One progress line per row."""
    if r.get("system") == "decoder":
        return f"  decoder {r.get('decoder')}: {r.get('img_per_s')} img/s {r.get('vs_opencv', r.get('error', ''))}"
    if r.get("system") == "fidelity":
        return f"  fidelity {r.get('decode')} {r.get('precision')}: {r.get('agreement')}"
    extra = "".join(f" {k}={r[k]}" for k in ("mode", "decode", "in_flight", "host_dispatch_us_p50",
                                             "host_upload_us_p50", "launch", "gpu_ms_p50", "overhead_vs_bare_pct",
                                             "errors") if k in r)
    p50 = f"p50 {r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms " if r.get("p50_ms") is not None else ""
    busy = r.get("timeline_summary", {}).get("compute_busy_pct")
    return (f"  {r['system']} {r['backend']} {r['precision']} {r['input']} b{r['batch']}: {p50}{r['img_per_s']} img/s"
            f"{extra}" + (f" compute busy {busy}%" if busy is not None else ""))


def print_table(console, rows: list[dict]) -> None:
    from rich.table import Table

    table = Table("system", "backend", "prec", "input", "mode", "batch", "p50 ms", "p99 ms", "img/s", "dispatch µs",
                  "over bare %")
    for r in rows:
        if r.get("system") in ("decoder", "fidelity"):
            continue
        mode = r.get("mode", "")
        if mode == "pipelined":
            mode = f"{r.get('in_flight')} in flight"
        input_ = r["input"] + (f" c={r['conf']}" if "conf" in r else "") + (f" {r['decode']}" if r.get("decode") else "")
        p50 = "" if r.get("p50_ms") is None else f"{r['p50_ms']:.3f}"
        p99 = "" if r.get("p99_ms") is None else f"{r['p99_ms']:.3f}"
        table.add_row(r["system"], r["backend"], r["precision"], input_, mode, str(r["batch"]), p50, p99,
                      str(r["img_per_s"]), str(r.get("host_dispatch_us_p50", "")), str(r.get("overhead_vs_bare_pct", "")))
    console.print(table)

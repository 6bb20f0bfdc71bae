"""NVDEC's ceiling in isolation (issue #46, goal 1): how many frames/s decode sessions give, with
no model, no pool and no letterbox, one knob at a time; then the same through yolopipe's own
reader, to explain where a session's ~300 frames/s in the pipeline go.

Each row runs ``--sessions`` decode sessions of one clip (each loops over it) for ``--seconds``
after all of them have opened and decoded a first batch, as threads of this process or as
processes of their own (``--modes``), and counts the frames each one got:

* ``simple``: PyNvVideoCodec's ``SimpleDecoder`` (its own demuxer inside the session), device
  memory, ``get_batch_frames(batch)``; knobs: ``batch`` (frames per call), ``format`` (``native``:
  NV12, as the pipeline takes it; ``rgbp``: planar RGB converted by the binding), ``context``
  (``primary``: the device's primary context, shared by every session, as yolopipe's readers;
  ``own``: none passed, the binding's choice);
* ``threaded``: its ``ThreadedDecoder`` (a decode thread of the binding's own per session);
* ``demuxed``: the demuxer outside the session (``CreateDemuxer``, in the calling thread), its
  packets fed to ``CreateDecoder`` one ``Decode`` call each; knob: ``latency`` (``native``: 4
  frames held; ``low``: none, display order; ``zero``: none, decode order);
* ``yolopipe``: ``app.gpu.nvdec.NvdecReader`` (``SimpleDecoder`` under the device's gate) with
  each batch copied into frames of the caller's own (``own_copies``: an allocation and a stream
  synchronize per batch), as the stream runner's decode pool reads;
* ``torchcodec``: torchcodec's CUDA decoder, the alternative, where it is installed.

A row that fails records its error and the run goes on; ``--budget-s`` stops starting rows.

    python bench/nvdec_isolation.py --clip .data/video/dance-1080p30.mp4 --out /tmp/out/nvdec-isolation.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import code_revision, machine_info, versions

OPEN_S = 90.0  # for every session of a row to open and decode its first batch

# kind, mode, sessions, knobs: the rows run, in this order (each about --seconds after its opening)
PLAN: list[tuple[str, str, tuple[int, ...], dict[str, Any]]] = [
    ("simple", "threads", (1, 4, 8, 16), {"batch": 8, "format": "native"}),
    ("simple", "processes", (4, 8), {"batch": 8, "format": "native"}),
    ("simple", "threads", (1, 8), {"batch": 1, "format": "native"}),
    ("simple", "threads", (1, 8), {"batch": 30, "format": "native"}),
    ("simple", "threads", (1, 8), {"batch": 8, "format": "rgbp"}),
    ("simple", "threads", (1, 8), {"batch": 8, "format": "native", "context": "own"}),
    ("threaded", "threads", (1, 8), {"batch": 8, "format": "native"}),
    ("demuxed", "threads", (1, 8), {"latency": "native"}),
    ("demuxed", "threads", (1, 8), {"latency": "low"}),
    ("demuxed", "threads", (1, 8), {"latency": "zero"}),
    ("yolopipe", "threads", (1, 8), {"batch": 8}),
    ("torchcodec", "threads", (1, 8), {}),
]


def _context(knobs: dict[str, Any]) -> dict[str, Any]:
    """The CUDA context a session is given (``context`` knob): the device's primary one, or none."""
    if knobs.get("context", "primary") == "own":
        return {}
    from app.gpu.driver import cuda_driver

    return {"cuda_context": cuda_driver().primary_context(0)}


def _color(nvc: Any, name: str) -> Any:
    return {"native": nvc.OutputColorType.NATIVE, "rgbp": nvc.OutputColorType.RGBP}[name]


def _latency(nvc: Any, name: str) -> Any:
    kind = nvc.DisplayDecodeLatencyType
    return {"native": kind.NATIVE, "low": kind.LOW, "zero": kind.ZERO}[name]


class Session:
    """One decode session of ``clip``; ``step()`` decodes once and returns how many frames came."""

    def __init__(self, kind: str, clip: str, knobs: dict[str, Any]) -> None:
        self.kind, self.clip, self.knobs = kind, clip, knobs
        getattr(self, f"_open_{kind}")()

    # --- PyNvVideoCodec's own readers --------------------------------------------------------
    def _open_simple(self) -> None:
        import PyNvVideoCodec as nvc

        color = _color(nvc, self.knobs.get("format", "native"))
        self.decoder = nvc.SimpleDecoder(self.clip, gpu_id=0, use_device_memory=True, output_color_type=color,
                                         **_context(self.knobs))
        self.step = self._step_batches

    def _open_threaded(self) -> None:
        import PyNvVideoCodec as nvc

        batch = self.knobs.get("batch", 8)
        color = _color(nvc, self.knobs.get("format", "native"))
        self.decoder = nvc.ThreadedDecoder(self.clip, buffer_size=2 * batch, gpu_id=0, use_device_memory=True,
                                           output_color_type=color, **_context(self.knobs))
        self.step = self._step_batches

    def _step_batches(self) -> int:
        frames = self.decoder.get_batch_frames(self.knobs.get("batch", 8))
        if not frames:  # the clip's end: from its start again, in the same session
            if self.kind == "simple":
                self.decoder.seek_to_index(0)
            else:
                self.decoder.reconfigure_decoder(self.clip, start_frame=0)
            frames = self.decoder.get_batch_frames(self.knobs.get("batch", 8))
        return len(frames)

    def _open_demuxed(self) -> None:
        import PyNvVideoCodec as nvc

        self.nvc = nvc
        self.demuxer = nvc.CreateDemuxer(self.clip)
        context = _context(self.knobs).get("cuda_context", 0)
        latency = _latency(nvc, self.knobs.get("latency", "native"))
        self.decoder = nvc.CreateDecoder(gpuid=0, codec=self.demuxer.GetNvCodecId(), cudacontext=context,
                                         cudastream=0, usedevicememory=True, latency=latency)
        self.packets = iter(self.demuxer)
        self.step = self._step_packets

    def _step_packets(self) -> int:
        packet = next(self.packets, None)
        if packet is None:  # flush what the decoder holds, then the clip again
            frames = len(self.decoder.Decode(self.nvc.PacketData()) or [])
            self.demuxer = self.nvc.CreateDemuxer(self.clip)
            self.packets = iter(self.demuxer)
            return frames
        return len(self.decoder.Decode(packet) or [])

    # --- yolopipe's reader, as the decode pool reads ------------------------------------------
    def _open_yolopipe(self) -> None:
        from app.gpu.nvdec import NvdecReader
        from app.runtime import cuda_device

        self.reader = NvdecReader(self.clip, device=cuda_device(0), batch=self.knobs.get("batch", 8))
        self.batches = self.reader.batches()
        self.step = self._step_reader

    def _step_reader(self) -> int:
        frames = next(self.batches, None)
        if not frames:  # the clip's end: its decoder back to the start, the same session
            self.reader._decoder.seek_to_index(0)
            self.batches = self.reader.batches()
            frames = next(self.batches, [])
        return len(self.reader.own_copies(frames))

    # --- the alternative -----------------------------------------------------------------------
    def _open_torchcodec(self) -> None:
        from torchcodec.decoders import VideoDecoder

        self.decoder = VideoDecoder(self.clip, device="cuda")
        self.next_index = 0
        self.step = self._step_torchcodec

    def _step_torchcodec(self) -> int:
        count = len(self.decoder)
        if self.next_index >= count:
            self.next_index = 0
        stop = min(self.next_index + 8, count)
        frames = self.decoder.get_frames_in_range(self.next_index, stop)
        self.next_index = stop
        return int(frames.data.shape[0])


def run_session(kind: str, clip: str, knobs: dict[str, Any], report: Any, go: Any, seconds: float) -> None:
    """Open a session and decode a first batch, say so on ``report``, then decode from ``go`` on
    for ``seconds``: its frames and their seconds (or its error) on ``report`` too."""
    try:
        session = Session(kind, clip, knobs)
        session.step()
    except Exception as exc:  # noqa: BLE001 - the row records it
        report.put({"error": f"{type(exc).__name__}: {exc}"[:300]})
        return
    report.put({"opened": True})
    if not go.wait(OPEN_S + 10):
        return
    frames, start = 0, time.perf_counter()
    try:
        while (elapsed := time.perf_counter() - start) < seconds:
            frames += session.step()
    except Exception as exc:  # noqa: BLE001
        report.put({"error": f"{type(exc).__name__}: {exc}"[:300], "frames": frames})
        return
    report.put({"frames": frames, "seconds": round(elapsed, 3)})


def _collect(report: Any, count: int, workers: list[Any], deadline: float) -> list[dict[str, Any]]:
    """``count`` messages from ``report``, or fewer once every worker has ended or ``deadline``."""
    got: list[dict[str, Any]] = []
    while len(got) < count and time.monotonic() < deadline:
        try:
            got.append(report.get(timeout=0.5))
        except queue.Empty:
            if not any(worker.is_alive() for worker in workers):
                break
    return got


def measure(kind: str, mode: str, sessions: int, knobs: dict[str, Any], clip: str, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind, "mode": mode, "sessions": sessions, **knobs}
    t0 = time.perf_counter()
    if mode == "threads":
        report: Any = queue.Queue()
        go: Any = threading.Event()
        workers: list[Any] = [threading.Thread(target=run_session, args=(kind, clip, knobs, report, go, seconds),
                                               daemon=True) for _ in range(sessions)]
    else:
        ctx = multiprocessing.get_context("spawn")
        report, go = ctx.Queue(), ctx.Event()
        workers = [ctx.Process(target=run_session, args=(kind, clip, knobs, report, go, seconds))
                   for _ in range(sessions)]
    for worker in workers:
        worker.start()
    opened = _collect(report, sessions, workers, time.monotonic() + OPEN_S)
    errors = sorted({m["error"] for m in opened if "error" in m})
    if len(opened) < sessions:
        errors.append(f"{sessions - len(opened)} session(s) neither opened nor failed within {OPEN_S} s")
    row["opened_s"] = round(time.perf_counter() - t0, 3)
    results: list[dict[str, Any]] = []
    if not errors:
        go.set()
        results = _collect(report, sessions, workers, time.monotonic() + seconds + 60)
        errors = sorted({m["error"] for m in results if "error" in m})
        if len(results) < sessions:
            errors.append(f"{sessions - len(results)} session(s) gave no result")
    go.set()  # the sessions still waiting for it end
    for worker in workers:
        worker.join(timeout=30)
    if errors:
        row["errors"] = errors
    rates = [r["frames"] / r["seconds"] for r in results if r.get("seconds")]
    row["fps_per_session"] = [round(rate, 1) for rate in rates]
    row["fps"] = round(sum(rates), 1) if rates and not errors else None
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", type=Path, default=ROOT / ".data/video/dance-1080p30.mp4")
    parser.add_argument("--seconds", type=float, default=4.0, help="decoding time per row, after every session opened")
    parser.add_argument("--kinds", default=",".join(dict.fromkeys(kind for kind, *_ in PLAN)),
                        help="the rows of these kinds (default: all)")
    parser.add_argument("--max-sessions", type=int, default=16, help="rows with more sessions are left out")
    parser.add_argument("--budget-s", type=float, default=300.0, help="no row starts after this many seconds")
    parser.add_argument("--out", type=Path, default=Path("nvdec-isolation.json"))
    args = parser.parse_args()
    if not args.clip.is_file():
        print(f"no clip at {args.clip}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("bench/nvdec_isolation.py measures NVDEC: it needs an NVIDIA GPU, and this machine has none",
              file=sys.stderr)
        return 2
    kinds = set(args.kinds.split(","))
    doc: dict[str, Any] = {
        "what": "NVDEC decode sessions in isolation (issue #46, goal 1): frames/s of N sessions as threads or "
                "processes, one knob at a time, then through yolopipe's reader",
        "machine": machine_info(gpu=True), "versions": versions(("torch", "pynvvideocodec", "torchcodec")),
        "commit": code_revision(), "clip": args.clip.name, "seconds_per_row": args.seconds, "rows": [],
    }
    start = time.monotonic()
    for kind, mode, counts, knobs in PLAN:
        for sessions in counts:
            if kind not in kinds or sessions > args.max_sessions:
                continue
            if time.monotonic() - start > args.budget_s:
                doc["cut"] = f"rows left out after {args.budget_s:.0f} s"
                break
            row = measure(kind, mode, sessions, knobs, str(args.clip), args.seconds)
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(doc, indent=1) + "\n")  # a run cut off keeps its rows
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stand-ins the CPU tests share to see what the GPU path would do: a pipeline that decodes JPEGs
itself (as ``app.pipeline.gpu.GpuPipeline`` does) around the real CPU pipeline, and a spy on the
one image header parser."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

import app.imaging.check
import app.imaging.headers
from app.contracts import Diagnostics, EncodedImage, PipelineRun, RunFacts, StageTimes, measure_once
from app.errors import YolopipeError
from app.imaging.decode import decode_image


class DecodesItself:
    """An ``app.contracts.Pipeline`` that takes JPEGs (``decodes_jpeg``) and decodes each with the
    header that came with its bytes, reading none, then runs the real CPU pipeline (``cpu``) on
    the pixels: what reaches a GPU pipeline, seen on a machine without one. ``received`` holds
    every item it was given, ``bytes_seen`` the bytes of each JPEG as the run found them (a view
    of them is valid only until its image is answered)."""

    decodes_jpeg = True
    takes_nv12 = False
    cuda = None
    buckets: tuple[int, ...] = ()

    def __init__(self, cpu) -> None:
        self.cpu = cpu
        self.backend, self.precision, self.meta = "decodes-itself", cpu.precision, cpu.meta
        self.letterbox = cpu.letterbox
        self.max_batch, self.max_det, self.in_flight = cpu.max_batch, cpu.max_det, 1
        self.received: list = []
        self.bytes_seen: list[bytes] = []

    def run(self, images, params, *, decode=None):
        self.received.extend(images)
        self.bytes_seen.extend(bytes(x.data) for x in images if isinstance(x, EncodedImage))
        t0 = time.perf_counter()
        out: list = []
        for x in images:  # an image that does not decode fails alone, as on the GPU
            try:
                out.append(decode_image(x.data, header=x.header) if isinstance(x, EncodedImage) else x)
            except YolopipeError as exc:
                out.append(exc)
        decoded = StageTimes(decode_ms=(time.perf_counter() - t0) * 1e3)  # its own stage, as the GPU's
        ok = [i for i, x in enumerate(out) if not isinstance(x, YolopipeError)]
        if not ok:  # no image reached the model: no facts of a run
            return PipelineRun(out, decoded)
        run = self.cpu.run([out[i] for i in ok], params)
        for i, answer in zip(ok, run.images):
            out[i] = answer
        return PipelineRun(out, decoded + run.timings, self.facts(run.facts))

    def facts(self, facts: RunFacts) -> RunFacts:
        """What the run reports it was (the CPU pipeline's own facts)."""
        return facts

    def diagnose(self, *, decode=None, profile=None, bare=None, measure=measure_once, timeline=False):
        """The CPU pipeline's diagnostics (its decoder is OpenCV's, here)."""
        return self.cpu.diagnose(profile=profile, bare=bare, measure=measure, timeline=timeline)

    def warmup(self, batches=None, *, nv12: bool = False, frame_size=None) -> None:
        """Nothing to prepare."""

    def release_memory(self) -> None:
        self.cpu.release_memory()

    def close(self) -> None:
        """The CPU pipeline is the caller's."""


class ReportsLikeTheGpu(DecodesItself):
    """``DecodesItself`` reporting a run as ``app.pipeline.gpu.GpuPipeline`` does: the four stage
    times (its JPEG decode its own), and a GPU run's facts: the bucket the batch was padded up
    to, the batch slot it held (the free one: slots go round), the launch path and the launch's
    host costs in microseconds (large ones: read as latencies they would stand out)."""

    def __init__(self, cpu) -> None:
        from app.gpu.pack import bucket_sizes

        super().__init__(cpu)
        self.in_flight = 2
        self.buckets = tuple(bucket_sizes(self.max_batch))
        self._slots = itertools.cycle(range(self.in_flight))
        self._lock = threading.Lock()

    def facts(self, facts: RunFacts) -> RunFacts:
        from app.gpu.pack import bucket_for

        with self._lock:
            slot = next(self._slots)
        return RunFacts(facts.batch, bucket_for(self.buckets, facts.batch), slot, "driver", slot == 0,
                        upload_us=4000.0, dispatch_us=9000.0, launch_us=7000.0)


def count_header_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every call of the image header parser (``app.imaging.headers.read_header``, under each name
    it is imported by) from now to the test's end, one entry (the bytes' length) per call."""
    calls: list[int] = []
    real = app.imaging.headers.read_header

    def counted(data):
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(app.imaging.headers, "read_header", counted)
    monkeypatch.setattr(app.imaging.check, "read_header", counted)
    return calls


class Answers:
    """An ``app.contracts.Pipeline`` stand-in for the stream runner's plumbing: every frame (host
    array or ``DeviceNv12``) answered with no detections after ``per_batch_s`` (without the GIL,
    as a GPU batch waits), so what is measured is the reading, pacing and batching around it.
    ``batches``: the size of each batch it ran."""

    decodes_jpeg = False
    cuda = None
    buckets: tuple[int, ...] = ()
    backend, precision, letterbox = "answers", "fp32", "square"

    def __init__(self, *, max_batch: int = 16, per_batch_s: float = 0.002, takes_nv12: bool = False,
                 in_flight: int = 1) -> None:
        import types

        self.meta = types.SimpleNamespace(name="answers", imgsz=64, names=["person"], weights_sha256="0" * 64)
        self.max_batch, self.max_det, self.in_flight = max_batch, 300, in_flight
        self.per_batch_s, self.takes_nv12 = per_batch_s, takes_nv12
        self.batches: list[int] = []
        self.warmups: list[tuple[bool, tuple[int, int] | None]] = []  # (nv12, frame_size) of each warmup

    def run(self, images, params, *, decode=None):
        import time

        import numpy as np

        from app.contracts import DeviceNv12
        from app.imaging.letterbox import letterbox_params

        self.batches.append(len(images))
        t0 = time.perf_counter()
        time.sleep(self.per_batch_s)
        sizes = [(x.height, x.width) if isinstance(x, DeviceNv12) else x.shape[:2] for x in images]
        return PipelineRun([(np.zeros((0, 6), np.float32), letterbox_params(h, w, self.meta.imgsz)) for h, w in sizes],
                           StageTimes(infer_ms=(time.perf_counter() - t0) * 1e3), RunFacts(len(images), len(images)))

    def diagnose(self, *, decode=None, profile=None, bare=None, measure=measure_once, timeline=False):
        """Facts only: it has no engine to profile or time alone."""
        return Diagnostics("opencv", False, "answers", False, "no CUDA graphs: a stand-in")

    def warmup(self, batches=None, *, nv12: bool = False, frame_size=None) -> None:
        """Nothing to prepare: noted."""
        self.warmups.append((nv12, frame_size))

    def close(self) -> None:
        """Nothing to free."""

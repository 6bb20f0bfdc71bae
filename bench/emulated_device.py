"""The device emulated: a stand-in ``Pipeline`` to measure the host tier (HTTP and gRPC workers,
IPC, batcher, formatters) of the real server on any machine, no GPU needed.

``EmulatedDevice`` (an ``app.contracts.Pipeline``, wrapped in the real ``Detector``):

* a serial device at ``rate`` images/s: a batch of n waits n / rate s with the GIL released
  (``time.sleep``, as a CUDA sync waits), holding the one device; ``in_flight`` batches at once
  (the GPU pipeline's three), which run on it one after another;
* it decodes JPEG itself (``decodes_jpeg``) like the GPU pipeline: the bytes arrive undecoded
  with the header the HTTP (or gRPC) worker read and checked, and no decode CPU is spent;
* its answers are the sample model's real ones, replayed (``Replay``): recorded once with the
  real CPU detector for the benchmark's images (``Replay.record``), in source pixels, and given
  back with an identity letterbox (gain 1, no pad), so the Detector's letterbox undo does its
  usual arithmetic and leaves them as the CPU model gave them: the server answers what the CPU
  server answers, byte for byte (at the recorded parameters; a request with a higher ``conf``,
  some ``classes`` or a lower ``max_det`` gets the recorded rows filtered, which is what NMS
  would keep too; ``iou`` and ``agnostic`` are not replayed).

An image is looked up by its length and its last 32 bytes (the end of its entropy-coded data),
not by a hash of all of it: hashing 100 kB per image would add CPU of its own to the process
being measured. ``Replay.record`` refuses images that share a key. An image that is not in the
table (the warm-up's gray frames, a stream's frames, any other upload) is answered with the
``fallback`` rows (by default none), never refused.

``open_emulated_detector`` is the service's detector factory
(``app.service.inference.worker.DetectorFactory``): ``bench/emulated_server.py`` runs the real
``yolopipe serve`` around it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from app.contracts import DetectParams, Diagnostics, EncodedImage, PipelineRun, RunFacts, StageTimes
from app.types import Letterbox, ModelMeta

TAIL = 32  # bytes of an image's end that, with its length, key it in the table
RATE = 7000.0  # images/s: the H200's engine at batch 64 (bench/README.md)


def image_key(data: bytes) -> tuple[int, bytes]:
    return len(data), bytes(data[-TAIL:])


@dataclass
class Replay:
    """The model's answers to known images: rows ``[K, 6]`` float32 in source pixels (x1, y1,
    x2, y2, score, class) per image key, recorded at ``params``; and the model's ``meta``."""

    meta: ModelMeta
    rows: dict[tuple[int, bytes], np.ndarray] = field(default_factory=dict)
    params: DetectParams = field(default_factory=DetectParams)

    @classmethod
    def record(cls, detector: Any, images: Sequence[bytes]) -> Replay:
        """Each image's answer from ``detector`` (the real one, e.g. the sample model on the CPU)."""
        params = detector.params()
        replay = cls(detector.meta, params=params)
        for data in images:
            key = image_key(data)
            if key in replay.rows:
                raise ValueError(f"two images share a replay key (length {key[0]} and the same last {TAIL} bytes)")
            answer = detector.run([data], params)
            if answer.errors:
                raise ValueError(f"an image failed on the real detector: {answer.errors[0]}")
            replay.rows[key] = np.ascontiguousarray(answer.rows_of(0), np.float32)
        return replay

    def save(self, path: Path) -> None:
        keys = list(self.rows)
        counts = np.array([len(self.rows[k]) for k in keys], np.int64)
        np.savez(path, meta=np.array(json.dumps(asdict(self.meta))), params=np.array(json.dumps(asdict(self.params))),
                 lengths=np.array([k[0] for k in keys], np.int64),
                 tails=np.array([np.frombuffer(k[1].rjust(TAIL, b"\0"), np.uint8) for k in keys]).reshape(-1, TAIL),
                 tail_sizes=np.array([len(k[1]) for k in keys], np.int64), counts=counts,
                 rows=np.concatenate([self.rows[k] for k in keys]) if keys else np.zeros((0, 6), np.float32))

    @classmethod
    def load(cls, path: Path) -> Replay:
        with np.load(path) as f:
            params = json.loads(str(f["params"]))
            params["classes"] = tuple(params["classes"]) if params["classes"] is not None else None
            replay = cls(ModelMeta(**json.loads(str(f["meta"]))), params=DetectParams(**params))
            starts = np.cumsum(f["counts"]) - f["counts"]
            rows = f["rows"]
            for length, tail, size, start, n in zip(f["lengths"].tolist(), f["tails"], f["tail_sizes"].tolist(),
                                                    starts.tolist(), f["counts"].tolist()):
                replay.rows[(length, tail.tobytes()[TAIL - size:])] = rows[start : start + n].copy()
        return replay


class EmulatedDevice:
    """Implements ``app.contracts.Pipeline``: a serial device at ``rate`` images/s answering
    ``replay``'s rows (``fallback`` for an image it does not know)."""

    backend = "emulated"
    precision = "fp16"
    decodes_jpeg = True
    takes_nv12 = False
    letterbox = "square"  # as a GPU pipeline's (rows are replayed: the placement is never made)
    cuda = None  # no CUDA device: it is emulated
    max_det = 300
    buckets: tuple[int, ...] = ()

    def __init__(self, replay: Replay, rate: float = RATE, *, max_batch: int = 32, in_flight: int = 3,
                 fallback: np.ndarray | None = None) -> None:
        self.replay = replay
        self.meta = replay.meta
        self.rate = rate
        self.max_batch = max_batch
        self.in_flight = in_flight
        self.fallback = np.zeros((0, 6), np.float32) if fallback is None else np.asarray(fallback, np.float32)
        self._device = threading.Lock()

    def run(self, images: Sequence[Any], params: DetectParams, *, decode: str | None = None) -> PipelineRun:
        t0 = time.perf_counter()
        with self._device:  # one device: batches run one after another
            time.sleep(len(images) / self.rate)
        t1 = time.perf_counter()
        out = [self._answer(x, params) for x in images]
        t2 = time.perf_counter()
        # The GPU pipeline's stage times and facts, so that the batcher's metrics do the same work.
        times = StageTimes(infer_ms=(t1 - t0) * 1e3, postprocess_ms=(t2 - t1) * 1e3)
        return PipelineRun(out, times, RunFacts(len(images), len(images), launch="driver"))

    def diagnose(self, *, decode: str | None = None, profile: Any = None, bare: Any = None, measure: Any = None,
                 timeline: bool = False) -> Diagnostics:
        """Facts only: no engine to profile or time alone."""
        return Diagnostics("emulated", False, "emulated", False, "no CUDA graphs: the device is emulated")

    def _answer(self, image: Any, params: DetectParams) -> tuple[np.ndarray, Letterbox]:
        if isinstance(image, EncodedImage):
            rows = self.replay.rows.get(image_key(image.data), self.fallback)
            height, width = image.header.height, image.header.width
        else:  # a decoded array: the warm-up's gray images, a stream's frames
            rows = self.fallback
            height, width = image.shape[:2]
        # In source pixels already: an identity placement (the Detector's undo leaves them as they are).
        return self._filtered(rows, params), Letterbox(height, width, height, width, 0, 0, height, width)

    def _filtered(self, rows: np.ndarray, params: DetectParams) -> np.ndarray:
        """The recorded rows a request with ``params`` keeps (as NMS would, but for iou and agnostic)."""
        recorded = self.replay.params
        if (params.conf, params.classes, params.max_det) == (recorded.conf, recorded.classes, recorded.max_det):
            return rows
        keep = rows[:, 4] >= params.conf
        if params.classes is not None:
            keep &= np.isin(rows[:, 5], params.classes)
        return rows[keep][: params.max_det]

    def warmup(self, batches: Sequence[int] | None = None, *, nv12: bool = False,
               frame_size: tuple[int, int] | None = None) -> None:
        """Nothing to prepare."""

    def release_memory(self) -> None:
        """Nothing cached."""

    def close(self) -> None:
        """Nothing to free."""


def open_emulated_detector(settings: Any, steps: Any = None, *, replay: Path | None, rate: float = RATE) -> Any:
    """The service's detector factory (``functools.partial`` it with ``replay`` and ``rate``): the
    emulated device in the real ``Detector``, at the run shape of ``settings`` (batch, wait,
    pixel limit) with the GPU's batches in flight. ``replay``: a file ``Replay.save`` wrote."""
    from app.pipeline.detector import Detector
    from app.runtime import options_from

    table = Replay.load(replay) if replay is not None else Replay(generic_meta())
    shape = replace(options_from(settings).shape, letterbox=EmulatedDevice.letterbox)  # as app.runtime clamps a GPU's
    return Detector(EmulatedDevice(table, rate, max_batch=shape.max_batch, in_flight=shape.in_flight), shape)


def generic_meta() -> ModelMeta:
    """An 80-class model's meta, for a device without a recorded replay."""
    return ModelMeta(name="emulated", names=[f"class{i}" for i in range(80)], imgsz=640, stride=32,
                     input_name="images", output_name="output0", input_shape=["batch", 3, "height", "width"],
                     output_shape=["batch", 84, 8400], opset=17, weights_sha256="0" * 64)


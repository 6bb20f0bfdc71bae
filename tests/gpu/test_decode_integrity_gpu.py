"""Issue #25 on the device: a cut or corrupt JPEG is the CPU path's own error on every GPU decode
path (nvImageCodec's hardware decoder and its default chain, torchvision's nvJPEG, OpenCV); a
slot that held a photo never lends its pixels to a cut file; and under many threads through the
inference worker's batcher every cut file is that error and every photo gets its own
detections."""

from __future__ import annotations

import queue
import threading
import time

import cv2
import numpy as np
import pytest

from app.contracts import RunShape
from app.errors import InvalidImage, YolopipeError
from app.imaging.check import check_image
from app.imaging.decode import decode_image
from app.ipc.answers import answers_frame, read_answers
from app.ipc.ring import Ring, map_ring
from app.ipc.wire import FrameReader, ImageRef
from app.pipeline.detector import Detector
from app.service.inference.batcher import Batcher, Job
from app.service.inference.metrics import WorkerMetrics
from tests.references import detections_json, image_answers

pytestmark = pytest.mark.requires_gpu

CPU_ERROR = "cannot decode this JPEG image (truncated or corrupt)"
DECODES = ["gpu", "nvjpeg", "cpu"]  # gpu: nvImageCodec (hardware decoder, then its default chain)


@pytest.fixture(scope="module")
def pipe(gpu, sample_model_dir, meta):
    """One slot: every batch is decoded into the staging the batch before it used."""
    p = gpu.make_pipeline(sample_model_dir, meta, "fp16", max_batch=8, in_flight=1)
    yield p
    p.close()


@pytest.fixture(scope="module")
def photos(assets_dir) -> dict[str, bytes]:
    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    return {"bus": (assets_dir / "bus.jpg").read_bytes(), "zidane": (assets_dir / "zidane.jpg").read_bytes(),
            "bus_progressive": cv2.imencode(".jpg", bus, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes(),
            "bus_restarts": cv2.imencode(".jpg", bus, [cv2.IMWRITE_JPEG_RST_INTERVAL, 8])[1].tobytes()}


def cuts(data: bytes) -> dict[str, bytes]:
    n = len(data)
    return {"400 B": data[:400], "2000 B": data[:2000], "50 %": data[: n // 2], "90 %": data[: n * 9 // 10],
            "no EOI": data[:-2]}


def as_json(out, names):
    return out if isinstance(out, YolopipeError) else detections_json(out, names)


@pytest.mark.parametrize("decode", DECODES)
def test_a_slot_that_held_a_photo_answers_each_cut_file_with_the_cpu_error(gpu, pipe, photos, decode):
    def detect(items):  # each run with this decoder
        return gpu.detect(pipe, items, decode=decode)

    names = pipe.meta.names
    bus, zidane = photos["bus"], photos["zidane"]
    pair = [as_json(o, names) for o in detect([zidane, bus])]
    assert all(isinstance(p, list) and p for p in pair)
    for source in ("bus", "bus_progressive"):
        for what, cut in cuts(photos[source]).items():
            assert as_json(detect([photos[source]])[0], names)  # the slot now holds that photo
            (alone,) = detect([cut])
            assert isinstance(alone, InvalidImage) and str(alone) == CPU_ERROR, (decode, source, what, alone)
            out = detect([zidane, cut, bus])  # its slot the error; the photos where [zidane, bus] put them
            assert isinstance(out[1], InvalidImage) and str(out[1]) == CPU_ERROR, (decode, source, what)
            assert [as_json(out[0], names), as_json(out[2], names)] == pair, (decode, source, what)


@pytest.mark.parametrize("decode", ["gpu", "nvjpeg"])
def test_the_broken_corpus_through_the_gpu_decoders_is_refused_exactly_as_on_the_cpu(gpu, pipe, photos, forge,
                                                                                    decode):
    """Every broken variant (cuts, bit flips, header bytes, tables, restart markers, empty
    scans, ...) of a baseline, a progressive and a restart-interval photo, through the detector
    on the GPU pipeline: an error exactly where the CPU path refuses, with its message."""
    detector = Detector(pipe, decode=decode)
    corpus = {}
    for name in ("bus", "bus_progressive", "bus_restarts"):
        corpus.update(forge.jpeg_broken(name, photos[name]))
    results = detector.detect(list(corpus.values()), detector.params())
    refused = 0
    for (name, data), result in zip(corpus.items(), results):
        try:
            decode_image(data)
            cpu = None
        except YolopipeError as exc:
            cpu = str(exc)
        got = None if result.error is None else str(result.error)
        assert got == cpu, (decode, name, got, cpu)
        refused += cpu is not None
    assert len(corpus) > 500 and refused > 300


def test_many_threads_through_the_batcher_cut_files_are_errors_and_photos_their_own(chosen16, photos, tmp_path):
    """16 client threads admit photos and cut files (these with the header the worker reads
    itself, as for bytes from elsewhere) into one batcher over the chosen engine's 3-slot
    pipeline (batch-invariant kernels): each photo gets exactly its answer of one batch of the
    four, in whatever bucket and slot and with whatever neighbours the batcher ran it."""
    pipeline = chosen16.pipeline
    detector = Detector(pipeline, RunShape(max_batch=8, in_flight=3, max_wait_ms=2, letterbox="square"))
    names = detector.names
    valid = dict(photos)
    broken = {f"{src} {what}": cut for src in ("bus", "zidane", "bus_progressive") for what, cut in cuts(photos[src]).items()}
    expected = {n: detections_json(det.detections, names) for n, det in
                zip(valid, detector.detect(list(valid.values()), detector.params()))}
    answers: queue.Queue = queue.Queue()

    def deliver(jobs, batch_answers):
        for outcome in image_answers(read_answers(FrameReader().feed(answers_frame(batch_answers))[0][1])):
            answers.put(outcome)

    batcher = Batcher(detector, budget_s=120.0, deliver=deliver, metrics=WorkerMetrics("0"))
    ring = Ring(tmp_path / "ring", 96 * 2**20)
    ring_lock = threading.Lock()
    sent: dict[int, str] = {}
    try:
        batcher.start((1, 8), None, pipeline.buckets)
        view = map_ring(ring.path)

        def client(k: int) -> None:
            rng = np.random.default_rng(k)
            pool = list(valid) + list(broken)
            for j in range(16):
                name = pool[int(rng.integers(len(pool)))]
                data = valid.get(name) or broken[name]
                with ring_lock:
                    offset = ring.put(data)
                req = k * 1000 + j
                sent[req] = name
                header = check_image(data) if name in valid else None
                ref = ImageRef(req, 0, offset, len(data), time.monotonic() + 120, detector.params(), header)
                assert batcher.admit_many([Job(f"client-{k}", ref, view[offset : offset + len(data)])]) == [None]
                time.sleep(float(rng.uniform(0, 0.004)))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        got = [answers.get(timeout=120) for _ in range(16 * 16)]
    finally:
        batcher.close(10.0)
        ring.close()  # the pipeline is the session's (chosen16)
    wrong = []
    for o in got:
        name = sent[o.req_id]
        if name in broken:
            ok = isinstance(o.error, InvalidImage) and str(o.error) == CPU_ERROR
        else:
            ok = o.error is None and detections_json(o.detections, names) == expected[name]
        if not ok:
            wrong.append((name, o.error, o.detections))
    assert not wrong, wrong[:5]
    assert {sent[o.req_id] for o in got} & set(broken) and {sent[o.req_id] for o in got} & set(valid)

"""The same bytes with the same parameters give byte-identical JSON whatever they are batched
with, whichever bucket (batch size) and slot runs them (also one re-captured after its staging
grew), from any thread, and in another process: on the engine predict and serve choose (the
AOTInductor package with batch-invariant kernels, issue #35; with cuDNN's kernels one photo had
three answers among companions in one bucket and nine across buckets). A failure names the first
stage whose bits differ: the letterboxed input (decode, letterbox), the engine's head, or NMS."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading

import cv2
import numpy as np
import pytest

from app.boxes import rows_to_detections
from app.contracts import DetectParams
from app.errors import YolopipeError
from tests.references import detections_json

pytestmark = pytest.mark.requires_gpu

PRECISION = "fp16"
PARAMS = DetectParams(conf=0.25, iou=0.7)


@pytest.fixture(scope="module")
def pipe(chosen16):
    return chosen16.pipeline


@pytest.fixture(scope="module")
def photos(assets_dir) -> dict[str, bytes]:
    bus, zidane = cv2.imread(str(assets_dir / "bus.jpg")), cv2.imread(str(assets_dir / "zidane.jpg"))

    def jpg(img):
        return cv2.imencode(".jpg", img)[1].tobytes()

    return {"bus": (assets_dir / "bus.jpg").read_bytes(), "zidane": (assets_dir / "zidane.jpg").read_bytes(),
            "bus_flipped": jpg(bus[:, ::-1]), "zidane_small": jpg(cv2.resize(zidane, (640, 360))),
            "bus_gray": jpg(cv2.cvtColor(bus, cv2.COLOR_BGR2GRAY)),
            "zidane_huge": jpg(cv2.resize(zidane, (3840, 2160))),  # grows a slot's staging: its graphs re-captured
            "bus_restarts": cv2.imencode(".jpg", bus, [cv2.IMWRITE_JPEG_RST_INTERVAL, 8])[1].tobytes(),
            "bus_progressive": cv2.imencode(".jpg", bus, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()}


def digest(t) -> str:
    return hashlib.sha1(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:12]


def records(gpu, pipe, batch: list[str], photos, stages: dict | None = None) -> tuple[dict[str, str], int]:
    """Each image's JSON (as the service writes it), and the slot that ran the batch; with
    ``stages`` (one thread only), each image's input and head digests are added to it too."""
    from app.gpu.capture import graph_key

    run = pipe.run([gpu.jpeg(photos[n]) for n in batch], PARAMS)
    names = pipe.meta.names
    out = {}
    slot, bucket = run.facts.slot, run.facts.bucket
    head = pipe.slots[slot].graphs.get(graph_key(bucket)).head if stages is not None else None
    for j, (n, o) in enumerate(zip(batch, run.images)):
        assert not isinstance(o, YolopipeError), (n, o)
        out[n] = json.dumps(detections_json(rows_to_detections(*o), names))
        if stages is not None:
            for stage, bits in (("input", digest(pipe.inputs.tensor[j])), ("head", digest(head[j])),
                                ("answer", out[n])):
                stages.setdefault(n, {}).setdefault(stage, set()).add(bits)
    return out, slot


def first_stage_that_differs(stages: dict) -> dict[str, str]:
    """Per image with more than one answer: the first stage with more than one value."""
    return {n: next(stage for stage in ("input", "head", "answer") if len(seen[stage]) > 1)
            for n, seen in stages.items() if len(seen["answer"]) > 1}


def test_the_same_image_gives_the_same_bytes_in_any_batch_slot_and_thread(gpu, pipe, photos):
    rng = np.random.default_rng(0)
    others = [n for n in photos if n != "bus"]
    batches = []
    for k in range(12):  # bus at every position, among varying companions: always bucket 8
        companions = [str(x) for x in rng.choice(others, 7)]
        companions.insert(k % 8, "bus")
        batches.append(companions)
    seen: dict[str, set[str]] = {}
    slots: set[int] = set()
    lock = threading.Lock()

    def run(batch):
        got, slot = records(gpu, pipe, batch, photos)
        with lock:
            slots.add(slot)
            for n, rec in got.items():
                seen.setdefault(n, set()).add(rec)

    stages: dict = {}
    for batch in batches:  # one thread: the slots take turns
        got, slot = records(gpu, pipe, batch, photos, stages)
        slots.add(slot)
        for n, rec in got.items():
            seen.setdefault(n, set()).add(rec)
    assert first_stage_that_differs(stages) == {}
    threads = [threading.Thread(target=lambda b=b: run(b)) for b in batches]  # then all at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert slots == {0, 1, 2}
    assert json.loads(next(iter(seen["bus"])))  # it has detections
    assert {n: len(r) for n, r in seen.items()} == {n: 1 for n in seen}, {n: r for n, r in seen.items() if len(r) > 1}


def test_across_buckets_and_places_an_image_gets_the_same_bytes(gpu, pipe, photos):
    """Each probe photo (baseline, restart-interval, progressive, another scene) alone and among
    companions in buckets 1, 2, 4 and 8, first and last: the same bytes everywhere."""
    stages: dict = {}
    for probe in ("bus", "bus_restarts", "bus_progressive", "zidane"):
        for size in (1, 2, 3, 5, 8):  # buckets 1, 2, 4, 8, 8
            for place in sorted({0, size - 1}):
                batch = ["zidane_small"] * (size - 1)
                batch.insert(place, probe)
                records(gpu, pipe, batch, photos, stages)
    assert all(stages[p]["answer"] != {"[]"} for p in ("bus", "zidane"))  # they have detections
    assert first_stage_that_differs(stages) == {}
    assert {n: len(s["answer"]) for n, s in stages.items()} == {n: 1 for n in stages}


CHILD = """
import json, sys
from pathlib import Path
from app.boxes import rows_to_detections
from app.contracts import DetectParams, EncodedImage, RunShape
from app.imaging.headers import read_header
from app.runtime import OpenOptions, open_model_dir
from tests.references import detections_json
det = open_model_dir(Path(sys.argv[1]), OpenOptions(backend="torch-cuda", precision=sys.argv[2],
                                                    shape=RunShape(max_batch=8, in_flight=1)))
assert det.diagnose().compiler == "aoti"  # the package the parent built: loaded, not built again
items = [EncodedImage(d, read_header(d)) for d in (open(p, "rb").read() for p in sys.argv[3:])]
run = det.pipeline.run(items, DetectParams(conf=0.25, iou=0.7))
print(json.dumps([json.dumps(detections_json(rows_to_detections(*o), det.meta.names)) for o in run.images]))
det.close()
"""


def test_a_new_process_gives_the_same_bytes(gpu, pipe, photos, sample_model_dir, tmp_path):
    batch = ["bus", "zidane", "bus_flipped"]
    here, _ = records(gpu, pipe, batch, photos)
    paths = []
    for n in batch:
        paths.append(tmp_path / f"{n}.jpg")
        paths[-1].write_bytes(photos[n])
    for _ in range(2):  # two fresh processes
        out = subprocess.run([sys.executable, "-c", CHILD, str(sample_model_dir), PRECISION, *map(str, paths)],
                             capture_output=True, text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1]) == [here[n] for n in batch]

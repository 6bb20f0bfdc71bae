"""A real ``yolopipe serve`` under load, with cut and corrupt JPEGs among the valid photos
(issue #25: on the GPU a cut ``bus.jpg`` was answered with another client's detections).

Many clients post valid photos while others post broken files, over ``/v1/detect`` and
``/v1/detect/batch``. Every broken file is a 400 with the CPU path's own error; every valid
photo gets its own detections, as the detector gives them in this process.

CPU by default (ONNX Runtime). With ``YOLOPIPE_REAL_GPU=1`` (on the GPU machine) the server and
the reference detector run torch-cuda fp16 with GPU JPEG decode; batches of different sizes
may differ there by a rounding step, so detections are compared within 1e-3 in score and 1 px.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time

import cv2
import httpx
import numpy as np
import pytest

from app.errors import InvalidImage
from app.imaging.decode import decode_image
from tests.references import detections_json

GPU = os.environ.get("YOLOPIPE_REAL_GPU") == "1"
SERVE = (["--backend", "torch-cuda", "--precision", "fp16", "--no-compile"] if GPU else ["--backend", "onnxruntime"])
REFERENCE = ({"backend": "torch-cuda", "precision": "fp16", "compile": False, "max_batch": 8} if GPU
             else {"backend": "onnxruntime"})  # OpenOptions' fields, max_batch its run shape's
CPU_ERROR = "cannot decode this JPEG image (truncated or corrupt)"
CLIENTS, ROUNDS = (32, 10) if GPU else (6, 5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("broken-jpegs") / "server.log"
    port = _free_port()
    env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts_dir), "YOLO_OFFLINE": "1", "YOLOPIPE_WORKERS": "2",
           "YOLOPIPE_MAX_WAIT_MS": "5", "YOLOPIPE_MAX_BATCH": "8"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", *SERVE, "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        yield base
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def images(assets_dir, forge) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(valid photos, broken files), by name."""
    bus, zidane = (assets_dir / "bus.jpg").read_bytes(), (assets_dir / "zidane.jpg").read_bytes()
    bus_px = cv2.imread(str(assets_dir / "bus.jpg"))

    def jpg(img, *params):
        return cv2.imencode(".jpg", img, list(params))[1].tobytes()

    progressive = jpg(bus_px, cv2.IMWRITE_JPEG_PROGRESSIVE, 1)
    valid = {"bus": bus, "zidane": zidane, "bus_flipped": jpg(bus_px[:, ::-1]), "bus_progressive": progressive,
             "zidane_crop": jpg(cv2.imread(str(assets_dir / "zidane.jpg"))[60:700, 300:1100]),
             "bus_restarts": jpg(bus_px, cv2.IMWRITE_JPEG_RST_INTERVAL, 8)}
    broken = {"bus_cut_400": bus[:400], "bus_cut_2000": bus[:2000], "bus_cut_half": bus[: len(bus) // 2],
              "bus_cut_90pct": bus[: len(bus) * 9 // 10], "zidane_no_eoi": zidane[:-2],
              "progressive_cut_half": progressive[: len(progressive) // 2],
              "bus_zero_length_scan": forge.jpeg_broken("bus", bus)["bus_zero_length_scan"],
              "bus_dri_without_rst": forge.jpeg_with_dri(bus, 4),
              "restarts_rst_removed": forge.jpeg_broken("r", valid["bus_restarts"])["r_rst_removed"]}
    for data in broken.values():  # the CPU path's own verdict
        with pytest.raises(InvalidImage, match=r"^cannot decode this JPEG image \(truncated or corrupt\)$"):
            decode_image(data)
    return valid, broken


@pytest.fixture(scope="module")
def expected(artifacts_dir, images):
    from app.contracts import RunShape
    from app.runtime import OpenOptions, open_detector

    valid, _ = images
    reference = dict(REFERENCE)
    shape = RunShape(max_batch=reference.pop("max_batch")) if "max_batch" in reference else RunShape()
    with open_detector(OpenOptions("sample", artifacts_dir=artifacts_dir, shape=shape, **reference)) as det:
        return {name: detections_json(det.detect([data], det.params())[0].detections, det.names)
                for name, data in valid.items()}


def assert_same(got: list[dict], want: list[dict], name: str) -> None:
    assert len(got) == len(want), name
    for g, w in zip(got, want):
        assert g["class_id"] == w["class_id"], name
        if GPU:
            assert abs(g["score"] - w["score"]) <= 1e-3, name
            assert np.abs(np.subtract(g["box"], w["box"])).max() <= 1.0, name
        else:
            assert g == w, name


def test_broken_jpegs_among_many_clients_are_the_cpu_error_and_every_photo_gets_its_own(server, images, expected):
    valid, broken = images
    names = [*valid, *broken]
    failures: list[str] = []
    answered = {"valid": 0, "broken": 0, "batch": 0}
    lock = threading.Lock()

    def check(name: str, status: int, body: dict) -> None:
        if name in broken:
            ok = status == 400 and body["error"]["message"] == CPU_ERROR
        else:
            try:
                ok = status == 200
                assert_same(body["detections"], expected[name], name)
            except AssertionError:
                ok = False
        with lock:
            answered["broken" if name in broken else "valid"] += 1
            if not ok:
                want = expected.get(name, CPU_ERROR)
                failures.append(f"{name}: {status} {str(body)[:300]} (expected {str(want)[:300]})")

    def post(http: httpx.Client, url: str, **kw) -> httpx.Response:
        while True:  # a 503 is about load, not the image: retry as a client should
            r = http.post(url, **kw)
            if r.status_code != 503:
                return r
            time.sleep(float(r.headers.get("retry-after", 1)))

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=server, timeout=120) as http:
            for _ in range(ROUNDS):
                if rng.random() < 0.3:  # one batch request mixing both kinds
                    picked = rng.sample(names, 6)
                    files = [("images", (f"{n}.jpg", (valid | broken)[n], "image/jpeg")) for n in picked]
                    r = post(http, "/v1/detect/batch", files=files)
                    assert r.status_code == 200, r.text
                    for n, result in zip(picked, r.json()["results"]):
                        check(n, 400 if "error" in result else 200, result)
                    with lock:
                        answered["batch"] += 1
                    continue
                name = rng.choice(names)
                r = post(http, "/v1/detect", content=(valid | broken)[name], headers={"content-type": "image/jpeg"})
                check(name, r.status_code, r.json())

    def run(seed: int) -> None:
        try:
            client(seed)
        except Exception as exc:  # noqa: BLE001 - reported with the others
            with lock:
                failures.append(f"client {seed}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures, failures[:10]
    assert answered["valid"] >= 2 * CLIENTS and answered["broken"] >= 2 * CLIENTS and answered["batch"], answered


def test_the_server_says_why_in_its_batch_answers(server, images):
    """In a batch, a broken file's slot carries the error; the others are answered."""
    valid, broken = images
    files = [("images", ("bus.jpg", valid["bus"], "image/jpeg")),
             ("images", ("cut.jpg", broken["bus_cut_half"], "image/jpeg"))]
    r = httpx.post(f"{server}/v1/detect/batch", files=files, timeout=120)
    assert r.status_code == 200
    first, second = r.json()["results"]
    assert first["detections"] and second["error"]["message"] == CPU_ERROR


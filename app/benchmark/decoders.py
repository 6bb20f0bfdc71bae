"""The JPEG decoders side by side: pixels against OpenCV's on the varied JPEGs (per kind:
subsampling, progressive, gray, CMYK, EXIF), and decode throughput at batch 128 on the run's
images. nvImageCodec is also tried with other backend sets (the hardware
backend alone; its default chain), which is how the pipeline's choice was made: with chroma
upsampling off (nvJPEG's default, torchvision's too) many values differ from OpenCV's (the
figures: this benchmark's rows in bench/results/). Each GPU decoder is also timed while another
thread keeps the SMs busy (``img_per_s_gpu_busy``), as the engine does in a pipeline: what
decode can overlap with it."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from app.benchmark.fidelity import pixel_diff, summarize_diffs
from app.benchmark.timing import batch_of
from app.benchmark.workloads import varied_jpegs

THROUGHPUT_BATCH = 128


def _configs():
    """``(label, make decoder)`` for every decoder that can start here."""
    from app.gpu.decode import NvJpegDecoder
    from app.gpu.nvimgcodec import NVIMGCODEC_OPTIONS, NvImageCodecDecoder

    configs = [(f"nvimgcodec hw, then chain {NVIMGCODEC_OPTIONS} (the pipeline's)", lambda: NvImageCodecDecoder(0)),
               (f"nvimgcodec default chain {NVIMGCODEC_OPTIONS}", lambda: _chain(None)),
               ("nvimgcodec hw-only", lambda: _chain("hw")),
               ("nvjpeg (torchvision)", lambda: NvJpegDecoder(0))]
    return configs


def _chain(kind: str | None):
    """nvImageCodec with its default backend chain (None) or the hardware decoder alone."""
    from nvidia import nvimgcodec

    from app.gpu.early_decoder import NvDecoders, decode_params
    from app.gpu.nvimgcodec import NVIMGCODEC_OPTIONS, NvImageCodecDecoder

    backends = None if kind is None else [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)]
    one = nvimgcodec.Decoder(device_id=0, backends=backends, options=NVIMGCODEC_OPTIONS)
    # one decoder, no second pass: what it refuses goes to OpenCV
    return NvImageCodecDecoder(0, decoders=NvDecoders(nvimgcodec, decode_params(nvimgcodec), None, lambda: one, one))


def decoder_rows(images, log) -> list[dict]:
    import cv2

    from app.gpu.decode import DeviceImage, to_host_bgr

    varied = varied_jpegs()
    refs = [cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR) for _, d in varied]
    bench = batch_of([d for _, d in images], THROUGHPUT_BATCH)
    rows = []
    for label, make in _configs():
        try:
            decoder = make()
        except Exception as exc:  # noqa: BLE001 - this decoder is not available here: say so
            rows.append({"system": "decoder", "decoder": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        try:
            with decoder.lock:
                decoded = decoder.decode([d for _, d in varied])
            by_kind, refused = defaultdict(list), 0
            for (file, _), img, ref in zip(varied, decoded, refs):
                if not isinstance(img, DeviceImage):
                    refused += 1  # decoded by OpenCV (CMYK by design; anything the GPU refused)
                    continue
                by_kind[file.split("-", 1)[1].rsplit("-", 1)[0]].append(pixel_diff(to_host_bgr(img, decoder.stream), ref))
            decoded = None
            speed = _throughput(decoder, bench)
            busy = _throughput_gpu_busy(decoder, bench)
            rows.append({"system": "decoder", "decoder": label, "input": "jpeg", "batch": THROUGHPUT_BATCH,
                         "img_per_s": speed, "img_per_s_gpu_busy": busy, "busy": BUSY, "to_opencv": refused,
                         "vs_opencv": summarize_diffs([d for v in by_kind.values() for d in v]),
                         "vs_opencv_by_kind": {k: summarize_diffs(v) for k, v in sorted(by_kind.items())}})
            log(f"  {label}: {speed} img/s ({busy} with the GPU busy), vs OpenCV {rows[-1]['vs_opencv']}, {refused} to OpenCV")
        finally:
            decoder.close()
    rows.append(_opencv_row(bench))
    return rows


def _throughput(decoder, datas: list[bytes], reps: int = 5) -> float:
    """Batches decoded per second × batch, the decoder's stream synchronised after each."""
    with decoder.lock:
        decoder.decode(datas)  # warm-up
        decoder.stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            decoder.decode(datas)
            decoder.stream.synchronize()
        wall = time.perf_counter() - t0
    return round(reps * len(datas) / wall, 1)


BUSY = "a thread of its own: four fp16 GEMMs of 8192 x 8192 on a stream of its own, then that stream synchronised"


def _throughput_gpu_busy(decoder, datas: list[bytes]) -> float:
    """``_throughput`` while another thread keeps the SMs busy (``BUSY``), as an engine does."""
    import torch

    stop, started = threading.Event(), threading.Event()

    def busy() -> None:
        stream = torch.cuda.Stream(decoder.device)
        with torch.cuda.stream(stream):
            a = torch.randn(8192, 8192, device=f"cuda:{decoder.device}", dtype=torch.float16)
            while not stop.is_set():
                for _ in range(4):
                    a @ a
                stream.synchronize()
                started.set()

    thread = threading.Thread(target=busy, name="yolopipe-bench-busy", daemon=True)
    thread.start()
    try:
        started.wait(30)
        return _throughput(decoder, datas)
    finally:
        stop.set()
        thread.join()


def _opencv_row(datas: list[bytes], threads: int = 16, reps: int = 3) -> dict:
    import cv2

    def dec(d):
        return cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(dec, datas))
        t0 = time.perf_counter()
        for _ in range(reps):
            list(pool.map(dec, datas))
        wall = time.perf_counter() - t0
    return {"system": "decoder", "decoder": f"opencv ({threads} threads)", "input": "jpeg", "batch": len(datas),
            "img_per_s": round(reps * len(datas) / wall, 1)}

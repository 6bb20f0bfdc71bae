"""Fixtures of the GPU tests: the sample model's pipelines (fp32, fp16), frames, and the
helpers every GPU test module uses (the ``gpu`` fixture). Each test module is marked
``pytestmark = pytest.mark.requires_gpu``; without a CUDA GPU (or with the Numba simulator on)
its tests are skipped before any fixture here runs, so nothing here runs in CI.
"""

from __future__ import annotations

import functools
import importlib
import types

import cv2
import numpy as np
import pytest

from app.contracts import DetectParams
from app.errors import YolopipeError
from app.types import ModelMeta

CONF, IOU = 0.25, 0.7
MAX_BATCH = 8


@functools.cache
def why_no_gpu() -> str | None:
    """Why the GPU tests cannot run here, or None where they can. Asked at the first test that
    needs a GPU, so a session that runs none never imports torch for it."""
    from app.gpu.rounding import SIMULATOR  # the flag every kernel module reads

    if SIMULATOR:  # tests/conftest.py turns it on unless YOLOPIPE_REAL_GPU=1
        return "the Numba CUDA simulator is on: these tests need a real GPU"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    from numba import cuda

    if not cuda.is_available():  # the NMS and letterbox kernels run through numba.cuda
        return "numba.cuda sees no GPU"
    return None


def why_not_importable(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{module} is not importable: {exc}"
    return None


@pytest.hookimpl(tryfirst=True)  # before the runner sets up fixtures that would open the GPU
def pytest_runtest_setup(item):
    """``pytest.mark.requires_gpu``: skip without a CUDA GPU; ``requires_gpu("PyNvVideoCodec")``:
    also without that module (asked after the GPU, so a machine without one says so)."""
    marker = item.get_closest_marker("requires_gpu")
    if marker is None:
        return
    if reason := why_no_gpu():
        pytest.skip(reason)
    for module in marker.args:
        if reason := why_not_importable(module):
            pytest.skip(reason)


@pytest.fixture(scope="session")
def meta(sample_model_dir) -> ModelMeta:
    return ModelMeta.load(sample_model_dir / "meta.json")


def make_pipeline(model_dir, meta, precision, *, compile=False, max_batch=MAX_BATCH, in_flight=None, decode="gpu"):
    from app.backends.torch_cuda import TorchCudaEngine
    from app.config import IN_FLIGHT
    from app.contracts import RunShape
    from app.pipeline.gpu import GpuPipeline
    from app.runtime import cuda_device

    engine = TorchCudaEngine(model_dir, meta, precision=precision, max_batch=max_batch, compile=compile)
    return GpuPipeline(engine, meta, RunShape(max_batch=max_batch, in_flight=in_flight or IN_FLIGHT, decode=decode),
                       cuda_device(0))


@pytest.fixture(scope="session")
def chosen16(sample_model_dir):
    """The engine predict and serve choose on a GPU without TensorRT: the AOTInductor package
    with batch-invariant kernels (built here on the session's first use: minutes), fp16, in a
    pipeline of buckets up to 8 with three batches in flight. A ``Detector``."""
    from app.contracts import RunShape
    from app.runtime import OpenOptions, ensure_engine, open_model_dir

    options = OpenOptions(backend="torch-cuda", precision="fp16", shape=RunShape(max_batch=MAX_BATCH, in_flight=3))
    ensure_engine(sample_model_dir, options)
    det = open_model_dir(sample_model_dir, options)
    found = det.diagnose()
    assert (found.compiler, found.batch_invariant) == ("aoti", True), found
    yield det
    det.close()


@pytest.fixture(scope="session")
def pipe32(sample_model_dir, meta):
    p = make_pipeline(sample_model_dir, meta, "fp32")
    yield p
    p.close()


@pytest.fixture(scope="session")
def pipe16(sample_model_dir, meta):
    p = make_pipeline(sample_model_dir, meta, "fp16")
    yield p
    p.close()


@pytest.fixture(scope="session")
def frames(assets_dir) -> dict[str, np.ndarray]:
    """bus, zidane, and generated variants: downscaled, upscaled, flipped, gray, stacked."""
    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    zidane = cv2.imread(str(assets_dir / "zidane.jpg"))
    gray = cv2.cvtColor(cv2.cvtColor(zidane, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
    stacked = np.concatenate([cv2.resize(bus, (640, 853)), cv2.resize(zidane, (640, 360))], axis=0)
    return {
        "bus": bus,
        "zidane": zidane,
        "bus_small": cv2.resize(bus, (317, 423), interpolation=cv2.INTER_AREA),
        "zidane_tiny_upscaled": cv2.resize(zidane, (300, 169), interpolation=cv2.INTER_AREA),
        "bus_flipped": np.ascontiguousarray(bus[:, ::-1]),
        "zidane_gray": gray,
        "stacked": stacked,
        "zidane_huge": cv2.resize(zidane, (2560, 1440)),
    }


def ultralytics_predict(model, frame, half):
    r = model.predict(frame, imgsz=640, rect=False, conf=CONF, iou=IOU, quantize="fp16" if half else "fp32",
                      device=0, verbose=False)[0]
    b = r.boxes
    return b.xyxy.cpu().numpy(), b.conf.cpu().numpy(), b.cls.cpu().numpy().astype(int)


def jpeg(data: bytes, header_of: bytes | None = None):
    """``data`` as a pipeline takes encoded bytes: with the header whoever read them first parsed
    (``header_of``: another image's, for bytes whose own header cannot be read). A cut or corrupt
    JPEG's header says so (``JpegHeader.defect``): the pipeline must refuse it on that."""
    from app.contracts import EncodedImage
    from app.imaging.headers import read_header

    return EncodedImage(data, read_header(data if header_of is None else header_of))


def detect(pipe, items, params=None, decode=None):
    """Detections (original pixels) per item (bytes: with their header read), or the item's error
    (bytes whose header cannot be read at all get that error, as the detector gives it);
    ``decode``: the run's JPEG decoder (None: the pipeline's own)."""
    from app.boxes import rows_to_detections

    results: list = [None] * len(items)
    run_items, at = [], []
    for k, x in enumerate(items):
        try:
            run_items.append(jpeg(x) if isinstance(x, bytes) else x)
            at.append(k)
        except YolopipeError as exc:
            results[k] = exc
    if run_items:
        out = pipe.run(run_items, params or DetectParams(conf=CONF, iou=IOU), decode=decode).images
        for k, o in zip(at, out):
            results[k] = o if isinstance(o, YolopipeError) else rows_to_detections(*o)
    return results


def rows_of(run):
    assert not any(isinstance(o, YolopipeError) for o in run.images), run.images
    return [rows for rows, _ in run.images]


def slot_of(pipe, run):
    """The batch slot a run used."""
    return pipe.slots[run.facts.slot]


@pytest.fixture(scope="session")
def gpu():
    """The helpers above, for test modules (they cannot import this conftest)."""
    return types.SimpleNamespace(
        CONF=CONF, IOU=IOU, MAX_BATCH=MAX_BATCH, make_pipeline=make_pipeline, ultralytics_predict=ultralytics_predict,
        detect=detect, rows_of=rows_of, slot_of=slot_of, jpeg=jpeg,
    )

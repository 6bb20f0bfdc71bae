"""Shared fixtures and folder-assigned markers.

Markers come from the folder a test lives in (tests/unit → unit, tests/gpu → gpu, ...), so
``-m "not gpu"`` works without anybody remembering to decorate a test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Parallel test processes (pytest-xdist's -n): each gets its share of the cores for the thread
# pools of torch, ONNX Runtime (in the servers and CLIs the tests start) and BLAS, set before any
# of them loads. Pools sized to the whole machine in every process spin against each other: a
# torch test ran ~6x longer beside another process than alone.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _share = str(max(1, _CORES // _WORKERS))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "YOLOPIPE_ORT_THREADS"):
        os.environ.setdefault(_name, _share)
os.environ.setdefault("YOLO_OFFLINE", "1")  # Ultralytics must never reach for the network in tests
# Servers the tests start serve no gRPC unless a test asks for it (on a free port): many run at
# once, and the default port (8001) would be taken by the first.
os.environ.setdefault("YOLOPIPE_GRPC_PORT", "0")
# Kernels run in Numba's CUDA simulator unless YOLOPIPE_REAL_GPU=1 (on the GPU machine). It must
# be chosen before anything imports numba.cuda, so here, at the root of the whole session.
if os.environ.get("YOLOPIPE_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
from app.gpu.device import configure_process  # noqa: E402
from app.gpu.rounding import SIMULATOR

configure_process()  # CUDA's work-queue count, before any test makes a CUDA context


def _one_shared_array_per_line() -> None:
    """Make the simulator's shared-array allocation atomic.

    numba-cuda's simulator (0.30.4) finds a block's ``cuda.shared.array`` by the file and line
    that declare it, with an unlocked look-up followed by a store. Threads that one
    ``syncthreads`` releases together can each miss, and each keep a private ``np.empty``.
    In one CI run, a thread of ``_mask_suppress`` read a garbage kept-count from its own copy
    and indexed past its 64-slot array. On a GPU, shared arrays are static, so the kernels
    stay as they are. The harness takes the same key under a lock.
    """
    import sys
    import threading

    import numpy as np
    from numba.cuda.simulator import kernelapi

    unlocked = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # refused, or the one dynamic buffer: no look-up
            return unlocked(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)  # the simulator's own key
        with lock:
            found = self._allocations.get(key)
            if found is None:
                found = self._allocations[key] = np.empty(shape, dtype)
        return found

    kernelapi.FakeCUDAShared.array = array


if SIMULATOR:
    _one_shared_array_per_line()

TESTS = Path(__file__).parent
_FOLDER_MARKERS = {"unit", "kernels", "gpu", "tensorrt", "e2e"}


def _folder(item) -> str | None:
    rel = Path(str(item.fspath)).resolve().relative_to(TESTS.resolve())
    return rel.parts[0] if len(rel.parts) > 1 else None


def pytest_collection_modifyitems(config, items):
    # Schemathesis gives every API operation's item the test's bare node id; pytest-xdist
    # schedules by node id and would run one of them. Each gets its own (the item's name).
    seen: dict[str, int] = {}
    for item in items:
        seen[item.nodeid] = seen.get(item.nodeid, 0) + 1
    for item in items:
        if seen[item.nodeid] > 1:
            if hasattr(item.parent, "id"):  # pytest 9: node ids are NodeId objects
                item._id = item.parent.id.child(item.name)
            else:
                item._nodeid = f"{item.parent.nodeid}::{item.name}"
    for item in items:
        if (folder := _folder(item)) in _FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, folder))
    # The simulator's kernel tests first: run after the GPU-path tests had loaded torch and its
    # thread pools, one CI run took ~10x longer in them (19 min instead of 6).
    items.sort(key=lambda item: _folder(item) != "kernels")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; the GPU machine may run without it
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4. Each worker loads torch, ONNX Runtime and the
    servers its files start (~1-2 GB); more than 4 buys little, the e2e files being the tail."""
    return max(1, min(4, _CORES))


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    """Images that the ultralytics package ships (bus.jpg, zidane.jpg)."""
    import importlib.util

    spec = importlib.util.find_spec("ultralytics")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "assets"


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # Every test, and every CLI or server a test starts, keeps artifacts in pytest's own temp
    # folder (pruned by pytest), never in the user's cache or the temp dir at large. Set before
    # collection, since some test modules build an app at import.
    root = config._tmp_path_factory.getbasetemp() / "artifacts"
    root.mkdir(exist_ok=True)
    os.environ["YOLOPIPE_ARTIFACTS_DIR"] = str(root)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """One export of the sample model for the whole session (export takes seconds)."""
    from app.builder.export import export_onnx

    out = Path(os.environ["YOLOPIPE_ARTIFACTS_DIR"])
    export_onnx("sample", artifacts_dir=out)
    return out


@pytest.fixture(scope="session")
def sample_model_dir(artifacts_dir) -> Path:
    from app.builder.export import export_onnx

    return export_onnx("sample", artifacts_dir=artifacts_dir).model_dir


@pytest.fixture(scope="session")
def ultralytics_model(sample_model_dir):
    """Ultralytics' own model on the same weights: the reference every path is compared with."""
    from ultralytics import YOLO

    return YOLO(str(sample_model_dir / "weights.pt"))


@pytest.fixture(scope="session")
def varied_images(tmp_path_factory, assets_dir) -> Path:
    """A folder of real photos in varied sizes (160–1280 px) and formats (JPEG, PNG, gray, alpha)."""
    import cv2

    out = tmp_path_factory.mktemp("varied")
    bus = cv2.imread(str(assets_dir / "bus.jpg"))
    zidane = cv2.imread(str(assets_dir / "zidane.jpg"))
    (out / "nested").mkdir()
    for i, (src, side) in enumerate([(bus, 160), (bus, 320), (zidane, 480), (bus, 1280), (zidane, 1280), (zidane, 200)]):
        h, w = src.shape[:2]
        r = side / max(h, w)
        img = cv2.resize(src, (max(1, round(w * r)), max(1, round(h * r))), interpolation=cv2.INTER_AREA)
        ext = ".png" if i % 2 else ".jpg"
        cv2.imwrite(str(out / f"img{i}_{side}{ext}"), img)
    cv2.imwrite(str(out / "nested" / "bus_flipped.jpg"), bus[:, ::-1])
    cv2.imwrite(str(out / "nested" / "zidane_crop.png"), zidane[100:600, 300:1000])
    cv2.imwrite(str(out / "bus_gray.png"), cv2.cvtColor(bus, cv2.COLOR_BGR2GRAY))
    cv2.imwrite(str(out / "zidane_alpha.png"), cv2.cvtColor(zidane, cv2.COLOR_BGR2BGRA))
    return out


@pytest.fixture(scope="session")
def forge():
    """tests/forge.py: hand-made image files (decompression bombs, header variants), shared by
    the imaging and the API tests. Loaded by path: the tests folder is not a package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("yolopipe_test_forge", TESTS / "forge.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def cpu_detector(artifacts_dir):
    """The sample model on ONNX Runtime, in this process: the reference the served answers must equal."""
    from app.runtime import OpenOptions, open_detector

    with open_detector(OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir)) as det:
        yield det


@pytest.fixture(scope="session")
def bus(assets_dir) -> bytes:
    return (assets_dir / "bus.jpg").read_bytes()


@pytest.fixture(scope="session")
def zidane(assets_dir) -> bytes:
    return (assets_dir / "zidane.jpg").read_bytes()

"""The torch-cuda engine built ahead of time (an AOTInductor package) on a real GPU: a first
start builds it, a later start loads it and compiles nothing; in the pipeline's CUDA graphs it
gives the eager model's detections at every batch size, on every slot, replay after replay,
with fixed addresses; and a batch padded into a larger captured bucket gives the same boxes."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from app.boxes import f1, match_pairs
from app.contracts import DetectParams

pytestmark = pytest.mark.requires_gpu

BATCH = 8


@pytest.fixture(scope="module")
def root(sample_model_dir, tmp_path_factory):
    """An artifacts root with the sample export and no engine: the first open builds it."""
    out = tmp_path_factory.mktemp("aoti") / "artifacts"
    shutil.copytree(sample_model_dir, out / sample_model_dir.relative_to(sample_model_dir.parents[1]),
                    ignore=shutil.ignore_patterns("torch-cuda", "*.engine"))  # its inductor cache: a warm rebuild
    return out


@pytest.fixture(scope="module")
def detector(root):
    from app.contracts import RunShape
    from app.runtime import OpenOptions, ensure_artifacts, open_model_dir
    from app.types import StartupSteps

    said: list[str] = []
    steps = StartupSteps(said.append)
    options = OpenOptions("sample", backend="torch-cuda", precision="fp16", artifacts_dir=root,
                          shape=RunShape(max_batch=BATCH))
    det = open_model_dir(ensure_artifacts(options, steps), options, steps)
    assert any("compiling with AOTInductor (2 of 3" in s for s in said), said  # a first start builds it, and says so
    assert det.diagnose().compiler == "aoti"
    yield det
    det.close()


# fp16 kernels fused and ordered otherwise than the eager model's move scores in the last bits,
# so a box right at the confidence threshold may come and go: F1 over all images, not per image.
F1_FP16 = 0.98


def same(a, b) -> float:
    tp = sum(len(match_pairs(x.boxes, x.class_ids, y.boxes, y.class_ids)) for x, y in zip(a, b))
    return f1(tp, sum(len(x) for x in a), sum(len(y) for y in b))


def unmatched(a, b) -> int:
    tp = sum(len(match_pairs(x.boxes, x.class_ids, y.boxes, y.class_ids)) for x, y in zip(a, b))
    return sum(len(x) for x in a) + sum(len(y) for y in b) - 2 * tp


def items_of(frames, n):
    names = ["bus", "zidane", "bus_small", "bus_flipped", "zidane_gray", "stacked", "zidane_tiny_upscaled"]
    return [frames[names[i % len(names)]] for i in range(n)]


def test_a_later_start_loads_the_package_and_compiles_nothing(gpu, root, detector, frames, pipe16, monkeypatch):
    import torch._inductor
    import torch.export

    from app.builder import torch_build
    from app.contracts import RunShape
    from app.runtime import OpenOptions, open_detector

    def refuse(*args, **kwargs):
        raise AssertionError("a start with its engine built must compile nothing")

    for owner, name in [(torch, "compile"), (torch.export, "export"), (torch._inductor, "aoti_compile_and_package"),
                        (torch_build, "_compile")]:
        monkeypatch.setattr(owner, name, refuse)
    options = OpenOptions("sample", backend="torch-cuda", precision="fp16", artifacts_dir=root,
                          shape=RunShape(max_batch=BATCH))
    with open_detector(options) as again:  # opening builds nothing
        assert again.diagnose().compiler == "aoti"
        ours, eager = [], []
        for n in (1, 3, BATCH):
            items = items_of(frames, n)
            ours += gpu.detect(again.pipeline, items)
            eager += gpu.detect(pipe16, items)
        assert same(eager, ours) >= F1_FP16


def test_in_the_pipeline_graphs_it_equals_the_eager_model_at_every_batch(gpu, detector, frames, pipe16):
    ours, eager = [], []
    for n in range(1, BATCH + 1):
        items = items_of(frames, n)
        ours += gpu.detect(detector.pipeline, items)
        eager += gpu.detect(pipe16, items)
        assert sum(len(d) for d in ours[-n:]) > 0, n
    assert same(eager, ours) >= F1_FP16


def test_replays_read_the_current_input_and_write_fixed_addresses(gpu, detector, frames):
    """The package allocates its output on each call; captured, that output lives in the graph's
    pool at one address, which the NMS reads on every replay: other inputs give other rows, the
    first input again gives the first rows, and replays allocate nothing."""
    pipe = detector.pipeline
    pipe.warmup([4])  # bucket 4 captured on every slot before anything is measured
    a, b = items_of(frames, 4), [frames["stacked"]] * 4
    params = DetectParams(conf=0.1)
    first = gpu.rows_of(pipe.run(a, params))
    heads = {id(s): s.graphs.get(4).head.data_ptr() for s in pipe.slots}
    allocated = torch.cuda.memory_allocated()
    for _ in range(10):
        other = gpu.rows_of(pipe.run(b, params))
        again = gpu.rows_of(pipe.run(a, params))
        for x, y in zip(first, again):
            np.testing.assert_array_equal(x, y)
    assert not all(np.array_equal(x, y) for x, y in zip(first, other))
    assert torch.cuda.memory_allocated() == allocated
    assert {id(s): s.graphs.get(4).head.data_ptr() for s in pipe.slots} == heads


def test_a_batch_padded_into_a_larger_captured_bucket_gives_the_same_boxes(gpu, root, meta, frames):
    from app.artifacts.torch_engines import find_torch_engine
    from app.backends.torch_cuda import TorchCudaEngine
    from app.builder.torch_build import engine_key
    from app.contracts import RunShape
    from app.pipeline.gpu import GpuPipeline
    from app.runtime import cuda_device

    (model_dir,) = root.glob("*/imgsz640")
    found = find_torch_engine(model_dir, engine_key(meta, precision="fp16", max_batch=BATCH))
    engine = TorchCudaEngine(model_dir, meta, precision="fp16", max_batch=BATCH,
                             packages=[(found.package, found.manifest.key)])
    shape = RunShape(max_batch=BATCH, in_flight=1)
    with GpuPipeline(engine, meta, shape, cuda_device(0), pad_to_captured=True) as pipe:
        pipe.warmup([BATCH])
        items = items_of(frames, 3)
        run = pipe.run(items, DetectParams(conf=gpu.CONF, iou=gpu.IOU))
        assert run.facts.bucket == BATCH and sorted(pipe.slots[0].graphs.by_batch) == [BATCH]
        padded = gpu.detect(pipe, items)
        pipe.pad_to_captured = False
        exact = gpu.detect(pipe, items)  # bucket 4, captured now
        assert sorted(pipe.slots[0].graphs.by_batch) == [4, BATCH]
        assert unmatched(exact, padded) <= 1 and sum(len(d) for d in padded) > 0


def test_the_kernels_are_cached_for_the_next_start(detector, frames):
    """Numba's letterbox and NMS kernels, compiled by this process's first batches, are on disk
    (``app.gpu.kernel_cache``): the next start loads them instead of compiling them."""
    from pathlib import Path

    detector.detect(items_of(frames, 2))
    folder = Path(os.environ["NUMBA_CACHE_DIR"])
    indexed = {p.name.split(".")[0] for p in folder.rglob("*.nbi")}
    assert {"preprocess", "nms"} <= indexed, sorted(folder.rglob("*"))[:20]


def test_a_build_from_a_cache_with_tiles_generates_only_the_recorded_candidates(root, detector):
    """The fixture's build read ``YOLOPIPE_TUNING_CACHE`` (the device harness names the card's
    committed cache) or the model folder's: where that cache fitted and held the best tiles, this
    torch's inductor generated only the recorded candidates (``app.builder.narrowed_choices``), and
    the package it made passed the build's checks (the eager model's head, batch invariance, a
    fresh process) and this module's. Bit-identity with a build of every candidate:
    bench/results/2026-12-06-nvidia-h100-build-narrowed-ab.json."""
    from app.artifacts.torch_engines import manifest_of
    from app.artifacts.tuning_cache import read_tuning_cache

    packages = sorted(root.rglob("torch-cuda/*.invariant.pt2"))
    assert packages, "the fixture built no batch-invariant package"
    tuning = manifest_of(packages[0]).builder["tuning"]
    cache = read_tuning_cache(tuning["cache"])
    if tuning["tuning_cache"] != "hit" or not cache.best_tiles:
        pytest.skip(f"the build read no cache with tiles ({tuning['tuning_cache']}): every candidate was generated")
    assert 0 < tuning["candidates_kept"] < tuning["candidates_generated"], tuning

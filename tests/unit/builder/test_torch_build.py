"""The torch-cuda engine's life cycle, on the CPU, with stand-ins for the GPU, the compiler and
the engine: ``build-engine`` writes the package; predict's and serve's start-ups
(``ensure_artifacts``, then the open) load it and build nothing (every compile, trace and export
function of torch fails the test if called); a stale, foreign or half-written package is rebuilt
with a message, never loaded; an open alone never builds.

The real compile is ``tests/unit/builder/test_torch_build_aoti.py`` (AOTInductor on the CPU) and
``tests/gpu/test_torch_engine.py`` (on the GPU)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from app.artifacts.torch_engines import find_torch_engine, leftovers, manifest_path
from app.builder import inductor_settings, torch_build, torch_check

STAND_IN_GPU = ("NVIDIA Stand-in", "9.0")
ROOT = Path(__file__).resolve().parents[3]


class StandInEngine:
    """What the runtime hands the torch-cuda engine, recorded; it runs nothing."""

    name = "torch-cuda"
    input_dtype = "float16"

    def __init__(self, model_dir, meta, *, precision, max_batch, device, compile, packages):
        self.precision, self.max_batch, self.compile = precision, max_batch, compile
        self.packages = [path for path, _ in packages]
        self.compiled = bool(packages)
        OPENED.append(self)

    def close(self):
        pass


class StandInPipeline:
    letterbox = "square"  # as GpuPipeline's kernels

    def __init__(self, engine, meta, shape, cuda, *, pad_to_captured=False):
        self.engine, self.meta, self.max_batch, self.in_flight = engine, meta, shape.max_batch, shape.in_flight
        self.backend, self.precision = engine.name, engine.precision
        self.buckets = (shape.max_batch,)

    def close(self):
        pass


OPENED: list[StandInEngine] = []
COMPILED: list = []


def stand_in_compile(weights, meta, key, device, out, say, what, tuning_cache):
    """What AOTInductor would write, in miniature: a package file for ``key``."""
    COMPILED.append(key)
    out.write_bytes(f"a compiled {key.stem} for {key.gpu_name} by torch {key.torch_version}".encode() * 50)
    return {"stand_in": True}


@pytest.fixture
def gpu(monkeypatch):
    """A machine with one stand-in GPU (whose identity a test may change) and stand-in engine,
    pipeline and compiler; returns the GPU's ``[name, capability]``."""
    import app.backends.torch_cuda
    import app.gpu.probe
    import app.pipeline.gpu

    identity = list(STAND_IN_GPU)
    monkeypatch.setattr(app.gpu.probe, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(app.gpu.probe, "gpu_identity", lambda device=0: tuple(identity))
    monkeypatch.setattr(app.backends.torch_cuda, "TorchCudaEngine", StandInEngine)
    monkeypatch.setattr(app.pipeline.gpu, "GpuPipeline", StandInPipeline)
    monkeypatch.setattr(torch_build, "_compile", stand_in_compile)
    OPENED.clear()
    COMPILED.clear()
    return identity


def refuse_every_compile(monkeypatch) -> None:
    """From now on any compile, trace or export (torch's, or the builder's own steps) fails the test."""
    import torch
    import torch._inductor
    import torch.export
    import torch.jit

    def refuse(name):
        def called(*args, **kwargs):
            raise AssertionError(f"{name} was called: a start-up with its engine built must build nothing")
        return called

    for owner, name in [(torch, "compile"), (torch.export, "export"), (torch._inductor, "aoti_compile_and_package"),
                        (torch.jit, "trace"), (torch.jit, "script"), (torch_build, "_compile"),
                        (torch_build, "export_program"), (torch_build, "compile_package")]:
        monkeypatch.setattr(owner, name, refuse(f"{owner.__name__}.{name}"))


@pytest.fixture
def root(tmp_path, sample_model_dir) -> Path:
    """An artifacts root holding the sample export (hard links: no copy of the weights)."""
    out = tmp_path / "artifacts"
    shutil.copytree(sample_model_dir, out / sample_model_dir.relative_to(sample_model_dir.parents[1]),
                    copy_function=os.link)
    return out


def model_dir_in(root: Path) -> Path:
    (folder,) = root.glob("*/imgsz640")
    return folder


def open_for_predict(root: Path, batch: int = 64):
    """What ``predict`` does: its artifacts ensured, then opened."""
    from app.contracts import RunShape
    from app.runtime import OpenOptions, ensure_artifacts, open_model_dir

    options = OpenOptions("sample", backend="torch-cuda", artifacts_dir=root, shape=RunShape(max_batch=batch))
    return open_model_dir(ensure_artifacts(options), options)


def open_for_serve(root: Path, **settings):
    """What the service's inference worker does, from its settings."""
    from app.runtime import ensure_artifacts, open_model_dir, options_from
    from app.settings import Settings

    options = options_from(Settings(weights="sample", backend="torch-cuda", artifacts_dir=root, **settings))
    return open_model_dir(ensure_artifacts(options), options)


def test_a_second_start_builds_nothing(gpu, root, monkeypatch):
    open_for_predict(root)
    assert len(COMPILED) == 1 and COMPILED[0].max_batch == 64 and COMPILED[0].gpu_name == "NVIDIA Stand-in"
    (package,) = OPENED[0].packages
    assert package.name == "fp16.b1-64.invariant.pt2" and package.parent == model_dir_in(root) / "torch-cuda"
    refuse_every_compile(monkeypatch)
    open_for_predict(root)
    open_for_predict(root, batch=8)
    open_for_serve(root)  # the service's batch of 32 runs on the same package
    assert [e.packages for e in OPENED[1:]] == [[package]] * 3 and len(COMPILED) == 1
    with pytest.raises(AssertionError, match="must build nothing"):  # the guard itself works
        open_for_predict(root, batch=128)  # batches past 64: another package must be built


def test_build_engine_writes_the_engine_and_predict_and_serve_load_it(gpu, root, monkeypatch):
    from typer.testing import CliRunner

    from app.cli import cli

    result = CliRunner().invoke(cli, ["build-engine", "--artifacts-dir", str(root)])
    assert result.exit_code == 0, result.output
    package = model_dir_in(root) / "torch-cuda" / "fp16.b1-64.invariant.pt2"
    assert f"wrote: {package}" in " ".join(result.output.split()) and package.is_file()
    said = " ".join(result.output.split())
    assert "the torch-cuda engine (fp16, batch 1-64, invariant kernels, NVIDIA Stand-in): built in" in said, said  # progress, on the terminal
    manifest = json.loads(manifest_path(model_dir_in(root), COMPILED[0]).read_text())
    assert manifest["key"]["gpu_name"] == "NVIDIA Stand-in" and manifest["package_bytes"] == package.stat().st_size
    refuse_every_compile(monkeypatch)
    again = CliRunner().invoke(cli, ["build-engine", "--artifacts-dir", str(root)])
    assert again.exit_code == 0 and f"up to date: {package}" in " ".join(again.output.split()), again.output
    open_for_predict(root)
    open_for_serve(root)
    assert [e.packages for e in OPENED] == [[package], [package]]
    assert all(e.compiled for e in OPENED)


@pytest.mark.parametrize(("change", "says"), [
    ("torch", "torch 0.0.0-other built it, this is torch"),
    ("gpu", "it was built on NVIDIA Other (compute capability 8.9), this GPU is NVIDIA Stand-in (9.0)"),
    ("weights", "it was built from other weights"),
])
def test_a_stale_or_foreign_engine_is_rebuilt_with_a_message(gpu, root, change, says):
    open_for_predict(root)
    folder = model_dir_in(root)
    manifest_file = manifest_path(folder, COMPILED[0])
    manifest = json.loads(manifest_file.read_text())
    manifest["key"].update({"torch": {"torch_version": "0.0.0-other"},
                            "gpu": {"gpu_name": "NVIDIA Other", "compute_capability": "8.9"},
                            "weights": {"weights_sha256": "f" * 64}}[change])
    manifest_file.write_text(json.dumps(manifest))  # as a build on another machine or torch left it
    with pytest.warns(RuntimeWarning) as caught:
        open_for_predict(root)
    said = [str(w.message) for w in caught]
    assert any("fp16.b1-64.invariant.pt2 does not fit" in m and says in m and "building it again" in m for m in said), said
    assert len(COMPILED) == 2 and OPENED[1].packages == OPENED[0].packages
    rebuilt = json.loads(manifest_file.read_text())["key"]
    assert (rebuilt["gpu_name"], rebuilt["compute_capability"]) == STAND_IN_GPU and rebuilt["weights_sha256"] != "f" * 64


def test_a_truncated_engine_is_rebuilt_never_loaded(gpu, root):
    open_for_predict(root)
    (package,) = OPENED[0].packages
    package.write_bytes(package.read_bytes()[:100])
    with pytest.warns(RuntimeWarning, match="differs from its manifest"):
        open_for_predict(root)
    assert len(COMPILED) == 2 and len(package.read_bytes()) > 100


KILLED_BUILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import app.gpu.probe
    app.gpu.probe.gpu_identity = lambda device=0: ("NVIDIA Stand-in", "9.0")
    from app.artifacts.exports import load_export
    from app.builder import torch_build

    def killed(weights, meta, key, device, out, say, what, tuning_cache):
        out.write_bytes(b"the first half of a package")
        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-build

    torch_build._compile = killed
    _, meta = load_export(Path(sys.argv[1]))
    torch_build.ensure_torch_engine(Path(sys.argv[1]), meta, precision="fp16", max_batch=64)
""")


def test_a_build_killed_mid_way_is_never_loaded_and_the_next_start_builds_it(gpu, root):
    folder = model_dir_in(root)
    proc = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(folder)], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (left,) = leftovers(folder)
    assert left.read_bytes() == b"the first half of a package"
    assert find_torch_engine(folder, torch_build.engine_key(_meta(folder), precision="fp16", max_batch=64)).package is None
    open_for_predict(root)
    assert len(COMPILED) == 1 and leftovers(folder) == []  # the next start built it and swept the remains
    (package,) = OPENED[0].packages
    assert package.read_bytes().startswith(b"a compiled fp16.b1-64.invariant")


def _meta(folder: Path):
    from app.artifacts.exports import load_export

    return load_export(folder)[1]


def test_without_aotinductor_the_eager_model_runs_and_later_starts_do_not_build_again(gpu, root, monkeypatch):
    from app.errors import BackendUnavailable

    tries = []

    def no_compiler(*args, **kwargs):
        tries.append(1)
        raise BackendUnavailable("AOTInductor could not compile the model: no C++ compiler")

    monkeypatch.setattr(torch_build, "_compile", no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_for_predict(root)
    assert any("running the eager model instead" in str(w.message) for w in caught)
    assert OPENED[0].packages == [] and OPENED[0].compile is False  # eager, in CUDA graphs
    assert list((model_dir_in(root) / "torch-cuda").glob("*.pt2")) == []  # nothing half-built left to load
    (note,) = (model_dir_in(root) / "torch-cuda").glob("*.refused")
    assert "no C++ compiler" in note.read_text()
    open_for_predict(root)  # the next start reads the note: no second build in vain
    assert len(tries) == 1 and OPENED[-1].compile is False


def test_an_open_alone_builds_nothing_and_names_the_command_that_does(gpu, root, monkeypatch):
    """``open_detector`` without ``ensure_artifacts``: no package is an error naming the build
    command (for this run's batch and kernels); after a build that failed here, the eager model."""
    from app.contracts import RunShape
    from app.errors import ArtifactError, BackendUnavailable
    from app.runtime import OpenOptions, open_detector
    from app.types import StartupSteps

    refuse_every_compile(monkeypatch)
    options = OpenOptions("sample", backend="torch-cuda", artifacts_dir=root, batch_invariant=False,
                          shape=RunShape(max_batch=128))
    with pytest.raises(ArtifactError, match="no torch-cuda engine \\(fp16, batches up to 128\\)") as caught:
        open_detector(options)
    assert caught.value.hint == (f"run `yolopipe build-engine --artifacts-dir {root} --backend torch-cuda --precision "
                                 "fp16 --max-batch 128 --no-batch-invariant` first (predict and serve build it themselves)")
    assert OPENED == [] and not (model_dir_in(root) / "torch-cuda").exists()

    def no_compiler(*args):
        raise BackendUnavailable("no compiler")

    monkeypatch.setattr(torch_build, "_compile", no_compiler)
    with pytest.warns(RuntimeWarning, match="running the eager model instead"):
        open_for_predict(root)  # predict's start: the build fails here, and says so
    said: list[str] = []
    with open_detector(OpenOptions("sample", backend="torch-cuda", artifacts_dir=root),
                       StartupSteps(said.append)):
        assert OPENED[-1].compile is False and any("no compiler (an earlier build" in line for line in said), said


def test_a_package_that_fails_in_a_fresh_process_is_refused_with_what_the_process_said(tmp_path):
    """The check every package passes before it is published: a new process loads and runs it.
    Here the file is no package (and there may be no GPU): the child fails, and the build is
    refused with its exit and its last lines, never published."""
    import types

    from app.artifacts.torch_engines import TorchEngineKey
    from app.errors import BackendUnavailable

    bogus = tmp_path / "fp16.b1-64.pt2"
    bogus.write_bytes(b"the first half of a package")
    key = TorchEngineKey("0" * 64, 64, "fp16", "2.x", "NVIDIA Stand-in", "9.0", 1, 64)
    with (pytest.raises(BackendUnavailable, match=r"does not run in a fresh process here \(exit code 1\): .*Error"),
          torch_check.fresh_process_check(0, key, types.SimpleNamespace(imgsz=64)) as fresh):
        fresh.load(bogus)
        fresh.answer()


def test_the_fresh_process_starts_with_the_block_waits_for_the_package_and_is_killed_when_the_block_fails(
        tmp_path, started_processes):
    """The fresh process starts when the block does (its imports run while the build compiles),
    loads nothing until it is handed the package, is waited for only when asked, and a block
    that fails kills it: no process is left."""
    import time
    import types

    from app.artifacts.torch_engines import TorchEngineKey
    from app.errors import BackendUnavailable

    started = started_processes
    bogus = tmp_path / "fp16.b1-64.pt2"
    bogus.write_bytes(b"no package")
    key = TorchEngineKey("0" * 64, 64, "fp16", "2.x", "NVIDIA Stand-in", "9.0", 1, 64)
    meta = types.SimpleNamespace(imgsz=64)
    with pytest.raises(RuntimeError, match="an in-process check failed"), \
            torch_check.fresh_process_check(0, key, meta):
        time.sleep(0.5)
        assert len(started) == 1 and started[0].poll() is None  # running (waiting) while the block runs
        raise RuntimeError("an in-process check failed")
    assert started[0].returncode is not None  # killed and reaped
    with torch_check.fresh_process_check(0, key, meta) as fresh:
        time.sleep(0.5)
        assert started[1].poll() is None  # waits for the package, however long the build takes
        fresh.load(bogus)
        with pytest.raises(BackendUnavailable, match=r"does not run in a fresh process here \(exit code 1\)"):
            fresh.answer()
    assert started[1].returncode == 1


def test_no_batch_invariant_builds_and_loads_the_cudnn_package_beside_the_invariant_one(gpu, root, monkeypatch):
    """``--no-batch-invariant`` reaches the build (cuDNN's kernels: no Triton-only settings) and
    the run that asks for it; the default run keeps its batch-invariant package."""
    from typer.testing import CliRunner

    from app.cli import cli

    result = CliRunner().invoke(cli, ["build-engine", "--artifacts-dir", str(root), "--no-batch-invariant"])
    assert result.exit_code == 0, result.output
    assert [k.batch_invariant for k in COMPILED] == [False]
    cudnn = model_dir_in(root) / "torch-cuda" / "fp16.b1-64.cudnn.pt2"
    assert cudnn.is_file() and "cudnn kernels" in " ".join(result.output.split())
    assert torch_build.inductor_configs(False) == {}
    assert {name: torch_build.inductor_configs(True)[name] for name in ("max_autotune", "max_autotune_gemm_backends",
                                                                        "max_autotune_conv_backends")} == {
        "max_autotune": True, "max_autotune_gemm_backends": "TRITON", "max_autotune_conv_backends": "TRITON"}
    assert torch_build.inductor_configs(False, cuda=True) == inductor_settings.CUDA_INDUCTOR_CONFIGS
    open_for_predict(root)  # the default: batch-invariant, built now
    assert [k.batch_invariant for k in COMPILED] == [False, True]
    refuse_every_compile(monkeypatch)
    open_for_serve(root, batch_invariant=False)
    assert OPENED[-1].packages == [cudnn]


def test_the_build_finds_a_package_whose_answer_for_an_image_depends_on_its_batch():
    """``batch_variance`` (the check a batch-invariant build must pass): a model that computes each
    image alone passes; one whose sums depend on the batch's size (as a split of the work by
    batch size does), or that reads a neighbour, is caught, at the places where it differs."""
    import dataclasses

    import torch

    from tests.unit.artifacts.test_torch_engines import KEY

    key = dataclasses.replace(KEY, max_batch=8)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).eval()
    example = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))

    def per_image(x):
        with torch.inference_mode():
            return torch.cat([conv(x[i : i + 1]) for i in range(x.shape[0])])

    def split_by_size(x):  # the sum's order (so its rounding) changes with the batch's size
        with torch.inference_mode():
            y = per_image(x)
            return y + y * 1e-6 * (x.shape[0] > 4)

    def reads_a_neighbour(x):
        with torch.inference_mode():
            return per_image(x) + 1e-3 * per_image(x).roll(1, dims=0)

    assert torch_check.batch_variance(per_image, example, key) == []
    found = torch_check.batch_variance(split_by_size, example, key)
    assert [f.split(" (")[0] for f in found] == ["at place 0 of a batch of 8", "at place 7 of a batch of 8"]
    assert len(torch_check.batch_variance(reads_a_neighbour, example, key)) == 6  # sizes 2, 3, 8: both places


def test_a_start_that_must_build_says_so_first_with_its_estimate(gpu, root):
    from app.contracts import RunShape
    from app.runtime import OpenOptions, ensure_artifacts
    from app.types import StartupSteps

    said: list[str] = []
    options = OpenOptions("sample", backend="torch-cuda", artifacts_dir=root, shape=RunShape(max_batch=64))
    ensure_artifacts(options, StartupSteps(said.append))
    (announce,) = [line for line in said if line.startswith("no torch-cuda engine built for this GPU yet")]
    built = [i for i, line in enumerate(said) if ": built in" in line]
    assert said.index(announce) < built[0], said  # said before the build starts
    from app.artifacts.tuning_cache import TYPICAL_TUNINGS, build_estimate_s, say_duration

    estimate = say_duration(build_estimate_s("NVIDIA Stand-in", tunings=TYPICAL_TUNINGS, narrowed=True))
    assert (f"{estimate} (a first build tunes about {TYPICAL_TUNINGS} kernels over the tile settings that won on "
            "compute capability 9.0)") in announce, announce
    assert "`yolopipe build-engine` builds it ahead of time" in announce


def test_build_engine_refuses_a_tuning_cache_it_would_not_read_before_any_work(gpu, root, tmp_path):
    from typer.testing import CliRunner

    from app.cli import cli

    bad = tmp_path / "notes.json"
    bad.write_text('{"kind": "something else"}')
    for args, says in [(["--tuning-cache", str(bad)], "is not a yolopipe tuning cache"),
                       (["--tuning-cache", str(tmp_path)], "is a folder"),
                       (["--no-batch-invariant", "--tuning-cache", str(tmp_path / "t.json")], "not tuned")]:
        result = CliRunner().invoke(cli, ["build-engine", "--artifacts-dir", str(root), *args])
        assert result.exit_code != 0 and says in " ".join(result.output.split()), result.output
    assert COMPILED == []


@pytest.mark.parametrize(("batches", "traced"), [((1, 64), 64), ((1, 256), 64), ((1, 8), 8), ((1, 2), 2),
                                                  ((100, 256), 100), ((4, 4), 4), ((1, 1), 1)])
def test_a_package_is_traced_and_tuned_at_predicts_batch_brought_into_its_range(batches, traced):
    """Inductor tunes every template at the traced size: at batch 2 the H100's package ran batch 64
    0.80x as fast as cuDNN's, at 64 0.91x (bench/results/2026-12-06-nvidia-h100-tuning-batch-probe.json)."""
    from app.artifacts.torch_engines import TorchEngineKey

    key = TorchEngineKey("0" * 64, 640, "fp16", "2.11.0", "NVIDIA Stand-in", "9.0", *batches)
    assert torch_build.example_batch(key) == traced

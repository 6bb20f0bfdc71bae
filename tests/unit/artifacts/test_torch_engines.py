"""The torch-cuda engine's artifact rules: a package is loaded only with its manifest, only when
every fact of its key is this run's, and only when its bytes are the manifest's; files are
published whole or not at all, even when the writing process is killed."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.artifacts.store import exclusive_lock, publish, temp_name, write_atomically
from app.artifacts.torch_engines import (
    TorchEngineKey,
    TorchEngineManifest,
    engine_dir,
    find_torch_engine,
    leftovers,
    manifest_path,
    package_path,
    save_manifest,
    sha256_of,
)

KEY = TorchEngineKey("a" * 64, 640, "fp16", "2.11.0+cu130", "NVIDIA H200", "9.0", 1, 64)


def built(model_dir: Path, key: TorchEngineKey = KEY, payload: bytes = b"compiled model " * 100) -> Path:
    """A package of ``payload`` with its manifest, as a finished build leaves them."""
    path = package_path(model_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, payload)
    save_manifest(model_dir, TorchEngineManifest(key, sha256_of(path), path.stat().st_size))
    return path


def test_a_finished_build_is_found_with_its_key(tmp_path):
    path = built(tmp_path)
    found = find_torch_engine(tmp_path, dataclasses.replace(KEY, max_batch=32))  # a run of batch 32: 1-64 takes it
    assert found.package == path and found.manifest.key == KEY and found.refused == []
    assert path.name == "fp16.b1-64.invariant.pt2" and manifest_path(tmp_path, KEY).name == "fp16.b1-64.invariant.json"


def test_nothing_built_is_nothing_found(tmp_path):
    assert find_torch_engine(tmp_path, KEY).package is None
    engine_dir(tmp_path).mkdir()
    assert find_torch_engine(tmp_path, KEY) == find_torch_engine(tmp_path / "x", KEY)


@pytest.mark.parametrize(("change", "says"), [
    ({"weights_sha256": "b" * 64}, "built from other weights"),
    ({"imgsz": 320}, "built for imgsz 320"),
    ({"torch_version": "2.10.0+cu128"}, "torch 2.10.0+cu128 built it, this is torch 2.11.0+cu130"),
    ({"gpu_name": "NVIDIA H100 80GB HBM3"}, "built on NVIDIA H100 80GB HBM3 (compute capability 9.0), this GPU is NVIDIA H200"),
    ({"compute_capability": "8.0", "gpu_name": "NVIDIA A100"}, "compute capability 8.0"),
    ({"format": 0}, "package format 0"),
])
def test_a_stale_or_foreign_package_is_refused_with_its_reason(tmp_path, change, says):
    built(tmp_path, dataclasses.replace(KEY, **change))
    found = find_torch_engine(tmp_path, KEY)
    assert found.package is None
    (reason,) = found.refused
    assert "fp16.b1-64.invariant.pt2 does not fit" in reason and says in reason, reason


def test_a_package_without_its_manifest_is_never_loaded(tmp_path):
    """The manifest is written last: a build killed before it leaves a package nothing loads."""
    path = built(tmp_path)
    manifest_path(tmp_path, KEY).unlink()
    found = find_torch_engine(tmp_path, KEY)
    said = f"torch-cuda engine {path.name} has no readable manifest (a build that did not finish)"
    assert found.package is None and found.refused == [said]
    manifest_path(tmp_path, KEY).write_text("{not json")
    assert find_torch_engine(tmp_path, KEY).package is None


def test_a_package_whose_bytes_differ_from_its_manifest_is_never_loaded(tmp_path):
    path = built(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut short
    assert find_torch_engine(tmp_path, KEY).package is None
    assert "differs from its manifest" in find_torch_engine(tmp_path, KEY).refused[0]
    path.write_bytes(data[:-1] + b"X")  # same size, other bytes
    assert find_torch_engine(tmp_path, KEY).package is None
    assert find_torch_engine(tmp_path, KEY, verify=False).package == path  # the size alone cannot tell
    path.write_bytes(data)
    assert find_torch_engine(tmp_path, KEY).package == path


def test_temporary_files_are_never_packages(tmp_path):
    built(tmp_path)
    final = package_path(tmp_path, KEY)
    final.rename(temp_name(final))  # only the temporary name of the package is left
    assert temp_name(final).name.startswith(".fp16.b1-64.invariant.tmp-") and temp_name(final).suffix == ".pt2"
    assert find_torch_engine(tmp_path, KEY).package is None
    assert leftovers(tmp_path) == [temp_name(final)]


def test_the_narrowest_batch_range_that_takes_the_run_wins(tmp_path):
    wide = built(tmp_path, dataclasses.replace(KEY, max_batch=256))
    narrow = built(tmp_path, KEY)
    fixed = built(tmp_path, dataclasses.replace(KEY, min_batch=64))  # a fixed batch of 64 takes no batch of 1
    assert find_torch_engine(tmp_path, dataclasses.replace(KEY, max_batch=16)).package == narrow
    assert find_torch_engine(tmp_path, dataclasses.replace(KEY, max_batch=128)).package == wide
    assert find_torch_engine(tmp_path, dataclasses.replace(KEY, max_batch=512)).package is None
    assert fixed.exists() and find_torch_engine(tmp_path, dataclasses.replace(KEY, max_batch=512)).refused == []
    assert find_torch_engine(tmp_path, dataclasses.replace(KEY, precision="fp32")).package is None


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from app.artifacts.store import temp_name
    final = Path(sys.argv[1])
    with open(temp_name(final), "wb") as fh:
        fh.write(b"half of a package")
        fh.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-build, before publish() and the manifest
""")


def test_a_build_killed_mid_write_leaves_nothing_that_loads(tmp_path):
    final = package_path(tmp_path, KEY)
    final.parent.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(final)], capture_output=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert proc.returncode == -signal.SIGKILL
    assert not final.exists() and find_torch_engine(tmp_path, KEY).package is None
    (left,) = leftovers(tmp_path)
    assert left.read_bytes() == b"half of a package"


def test_publish_replaces_in_one_step(tmp_path):
    target = tmp_path / "x.bin"
    write_atomically(target, b"old")
    tmp = temp_name(target)
    tmp.write_bytes(b"new")
    assert target.read_bytes() == b"old"
    publish(tmp, target)
    assert target.read_bytes() == b"new" and not tmp.exists()


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from app.artifacts.store import exclusive_lock
    with exclusive_lock(Path(sys.argv[1])):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
""")


def test_one_builder_at_a_time_and_a_killed_one_blocks_nobody(tmp_path):
    import time

    lock = tmp_path / "lock"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "2"], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    with exclusive_lock(lock):
        waited = time.monotonic() - started
    holder.wait(30)
    assert waited > 0.5  # it waited for the other holder
    killed = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "60"], stdout=subprocess.PIPE, text=True, env=env)
    assert killed.stdout.readline().strip() == "held"
    killed.kill()
    killed.wait(30)
    started = time.monotonic()
    with exclusive_lock(lock):
        assert time.monotonic() - started < 5  # the kernel dropped the dead holder's lock


def test_build_engine_says_what_it_built_and_how_long_a_fresh_process_takes_to_load_it(tmp_path):
    from app.artifacts.torch_engines import manifest_of
    from app.cli.engine import torch_engine_summary

    path = package_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    write_atomically(path, b"package")
    assert manifest_of(path) is None and "no manifest" in torch_engine_summary(path)
    builder = {"fresh_process": {"load_s": 0.801, "first_run_s": 0.351}}
    save_manifest(tmp_path, TorchEngineManifest(KEY, sha256_of(path), 7, build_seconds=99.0, builder=builder))
    assert manifest_of(path).builder == builder
    assert torch_engine_summary(path) == ("  fp16, batches 1-64, invariant kernels, NVIDIA H200, torch 2.11.0+cu130; built in 99 s; "
                                          "a fresh process loads it in 0.80 s and runs its first batch in 0.35 s")


def test_batch_invariant_and_cudnn_packages_live_side_by_side_and_each_run_finds_its_own(tmp_path):
    """The kind of kernels is part of the key and the name: a run that asks for batch-invariant
    kernels never loads a cuDNN package (nor the other way round), and neither is a refusal."""
    cudnn = dataclasses.replace(KEY, batch_invariant=False)
    invariant_path, cudnn_path = built(tmp_path), built(tmp_path, cudnn)
    assert invariant_path != cudnn_path and cudnn_path.name == "fp16.b1-64.cudnn.pt2"
    assert find_torch_engine(tmp_path, KEY).package == invariant_path
    assert find_torch_engine(tmp_path, cudnn).package == cudnn_path
    invariant_path.unlink()
    missing = find_torch_engine(tmp_path, KEY)
    assert missing.package is None and missing.refused == []


def test_a_package_of_the_previous_format_is_refused_as_such_and_rebuilt(tmp_path):
    """A format-2 package (named without its kernels, built with cuDNN's) says why it is not loaded."""
    old = dataclasses.replace(KEY, format=2)
    folder = engine_dir(tmp_path)
    folder.mkdir(parents=True)
    path = folder / "fp16.b1-64.pt2"
    write_atomically(path, b"old package")
    fields = {k: v for k, v in dataclasses.asdict(old).items() if k != "batch_invariant"}  # format 2 had no such field
    manifest = {"key": fields, "package_sha256": sha256_of(path), "package_bytes": path.stat().st_size}
    write_atomically(folder / "fp16.b1-64.json", __import__("json").dumps(manifest).encode())
    found = find_torch_engine(tmp_path, KEY)
    assert found.package is None
    assert found.refused == [("torch-cuda engine fp16.b1-64.pt2 does not fit: it is of package format 2, "
                              "this yolopipe reads format 3")]
    current = built(tmp_path)  # the rebuild deletes the leftovers (under the build lock), not itself
    assert sorted(p.name for p in leftovers(tmp_path)) == ["fp16.b1-64.json", "fp16.b1-64.pt2"]
    assert current.exists() and find_torch_engine(tmp_path, KEY).package == current

"""What may import what.

1. The CPU request path, the service's modules and the CLI never load a GPU library (start-up
   time and memory on CPU machines), checked in a fresh interpreter since this test session
   itself has torch loaded.
2. Build-time code (``app/builder``) and run-time code never import each other; both may use
   the neutral layers (artifacts, imaging, boxes, types, errors, config, weights) and the GPU
   facts build and run share (``app.gpu.probe``, ``app.gpu.tensorrt_lib``, and
   ``app.gpu.torch_model``: the model as the torch-cuda engine runs it and its builder exports
   it, and how a built package is loaded, which the builder checks as a run loads it). Only the composers
   below may import both sides; every module of ``app`` is in exactly one group. Read from the source.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import app

BANNED = ("torch", "numba.cuda", "cupy", "tensorrt", "ultralytics", "modelopt", "nvidia.nvimgcodec")
APP = Path(app.__file__).parent
BUILD_TIME = ("app.builder",)
RUN_TIME = ("app.pipeline", "app.predict", "app.backends", "app.gpu", "app.api", "app.ipc", "app.service", "app.distributed")
SHARED_GPU_FACTS = ("app.gpu.probe", "app.gpu.tensorrt_lib", "app.gpu.torch_model")
NEUTRAL = ("app.artifacts", "app.boxes", "app.config", "app.contracts", "app.engine_contracts", "app.errors", "app.files",
           "app.heap", "app.imaging", "app.records", "app.settings", "app.source_urls", "app.types", "app.versions", "app.weights",
           "app.bytecode")
# May import build time and run time alike, each for a stated reason:
COMPOSERS = {
    "app.runtime": "the composition root: ensure_artifacts exports and builds, open_detector opens a run-time detector",
    "app.benchmark": "times yolopipe against Ultralytics: exports the model it times",
    "app.cli": "one command per step, build steps (export, calibrate, build-engine) and run steps alike",
}

LOADED = """
import json, sys
{body}
print(json.dumps(sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in {banned!r}))))
"""


def banned_modules_after(body: str, *args: str) -> list[str]:
    code = LOADED.format(body=body, banned=BANNED)
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["app.api.main", "app.service.supervisor", "app.service.http_worker", "app.ipc.client",
                                    "app.service.inference.worker", "app.cli", "app.runtime",
                                    "app.api.grpc.server", "app.service.grpc_worker",
                                    "app.artifacts.engines", "app.predict.folder", "app.distributed"])
def test_importing_loads_no_gpu_library(module):
    assert banned_modules_after(f"import {module}") == []


DETECT = """
from pathlib import Path
from app.runtime import OpenOptions, open_detector
image = Path(sys.argv[1])
with open_detector(OpenOptions("sample", backend=sys.argv[2])) as det:
    (res,) = det.detect([image.read_bytes()], det.params())
    assert res.error is None and len(res.detections) > 0, res
"""


def test_onnxruntime_path_loads_no_gpu_library(artifacts_dir, assets_dir):
    assert banned_modules_after(DETECT, str(assets_dir / "bus.jpg"), "onnxruntime") == []


def test_auto_backend_on_a_cpu_machine_stays_light(artifacts_dir, assets_dir):
    from app.gpu.probe import cuda_device_count

    if cuda_device_count():
        pytest.skip("this machine has a GPU: auto picks a GPU backend")
    assert banned_modules_after(DETECT, str(assets_dir / "bus.jpg"), "auto") == []


PREDICT_SAMPLES = """
import json, sys
out, root = sys.argv[1], sys.argv[2]
sys.argv = ["yolopipe", "predict", "samples", "--out", out, "--artifacts-dir", root]
from app.cli import main
try:
    main()
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
print(json.dumps(sorted(sys.modules)))
"""


def test_predict_samples_on_a_cpu_machine_loads_no_gpu_library_and_no_compiler(artifacts_dir, tmp_path):
    """``yolopipe predict samples`` as a user types it: no torch (so no torch.cuda), no numba.cuda,
    no CuPy; and no Numba at all (its CPU NMS is for many candidates: loading it is seconds)."""
    from app.gpu.probe import cuda_device_count

    if cuda_device_count():
        pytest.skip("this machine has a GPU: auto picks a GPU backend")
    out = tmp_path / "p.jsonl"
    proc = subprocess.run([sys.executable, "-c", PREDICT_SAMPLES, str(out), str(artifacts_dir)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if any(m == b or m.startswith(b + ".") for b in BANNED)] == []
    assert [m for m in loaded if m == "numba" or m.startswith("numba.")] == []
    assert len(out.read_text().splitlines()) == 2  # it did predict both images


def imports_of(path: Path) -> set[str]:
    """Every ``app.*`` module a source file imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "app" or m.startswith("app.")}


def module_name(path: Path) -> str:
    return ".".join(("app", *path.relative_to(APP).with_suffix("").parts)).removesuffix(".__init__")


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_every_module_is_in_exactly_one_group():
    groups = (BUILD_TIME, RUN_TIME, NEUTRAL, tuple(COMPOSERS))
    for path in sorted(APP.rglob("*.py")):
        here = module_name(path)
        if here != "app":
            assert sum(within(here, g) for g in groups) == 1, f"{here}: say whether it is build, run, neutral or a composer"


def test_build_time_and_run_time_never_import_each_other():
    crossings = []
    for path in sorted(APP.rglob("*.py")):
        here = module_name(path)
        for target in imports_of(path):
            if within(here, NEUTRAL) and within(target, BUILD_TIME + RUN_TIME) and not within(target, SHARED_GPU_FACTS):
                crossings.append(f"{here} (neutral) imports {target}")
            if within(here, BUILD_TIME) and within(target, RUN_TIME) and not within(target, SHARED_GPU_FACTS):
                crossings.append(f"{here} (build time) imports {target}")
            if within(here, RUN_TIME) and within(target, BUILD_TIME):
                crossings.append(f"{here} (run time) imports {target}")
    assert crossings == []


def test_the_layering_check_sees_a_crossing(tmp_path):
    """The check above reads real import statements, lazy ones included."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from app.builder.export import export_onnx\n    import app.gpu.nms\n")
    assert imports_of(src) == {"app.builder.export", "app.builder.export.export_onnx", "app.gpu.nms"}

"""The INT8 build code stays on its side: no run-time module, nothing heavy loaded at import."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from app.builder import int8

RUN_TIME = ("app.pipeline", "app.backends", "app.api", "app.serving", "app.runtime", "app.gpu")
SHARED_GPU_LEAVES = ("app.gpu.probe", "app.gpu.tensorrt_lib")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_run_time_module_is_imported():
    files = [*Path(int8.__file__).parent.glob("*.py"), Path(int8.__file__).parent.parent / "quantize.py"]
    assert len(files) > 8
    for path in files:
        for name in imported_modules(path):
            if name.startswith(SHARED_GPU_LEAVES):
                continue
            assert not name.startswith(RUN_TIME), f"{path.name} imports {name}"


def test_importing_the_package_loads_nothing_heavy():
    script = ("import json, sys, app.builder.int8, app.builder.quantize; "
              "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
              "{'onnx', 'onnxruntime', 'numba', 'torch', 'cv2', 'pycocotools'})))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    # cv2 comes with app.imaging (the shared decode/letterbox leaves); the rest only when used
    assert [m for m in json.loads(out.stdout) if m.split(".")[0] != "cv2"] == []

"""Importing the INT8 build code loads nothing heavy (the build/run layering: tests/unit/test_import_ban.py)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_the_package_loads_nothing_heavy():
    script = ("import json, sys, app.builder.int8; "
              "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
              "{'onnx', 'onnxruntime', 'numba', 'torch', 'cv2', 'pycocotools'})))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    # cv2 comes with app.imaging (the shared decode/letterbox leaves); the rest only when used
    assert [m for m in json.loads(out.stdout) if m.split(".")[0] != "cv2"] == []

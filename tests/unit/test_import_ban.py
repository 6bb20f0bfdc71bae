"""The CPU request path never loads GPU libraries (start-up time and memory on CPU machines).

Checked in a fresh interpreter, since this test session itself has torch loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

BANNED = ("torch", "numba.cuda", "cupy", "tensorrt", "ultralytics", "modelopt")

SCRIPT = """
import json, sys
from pathlib import Path
from app.runtime import open_detector
engines, image = Path(sys.argv[1]), Path(sys.argv[2])
with open_detector("sample", backend=sys.argv[3], artifacts_dir=engines) as det:
    (res,) = det.detect([image.read_bytes()], det.params())
    assert res.error is None and len(res.detections) > 0, res
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "cupy", "tensorrt", "ultralytics", "modelopt"} or m.startswith("numba.cuda"))))
"""


def loaded_modules(artifacts_dir, image, backend):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(artifacts_dir), str(image), backend],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_onnxruntime_path_imports_no_gpu_library(artifacts_dir, assets_dir):
    assert loaded_modules(artifacts_dir, assets_dir / "bus.jpg", "onnxruntime") == []


def test_auto_backend_on_a_cpu_machine_stays_light(artifacts_dir, assets_dir):
    from app.gpu.probe import cuda_device_count

    if cuda_device_count():
        import pytest

        pytest.skip("this machine has a GPU: auto picks a GPU backend")
    assert loaded_modules(artifacts_dir, assets_dir / "bus.jpg", "auto") == []

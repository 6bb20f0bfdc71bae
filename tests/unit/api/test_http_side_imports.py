"""The HTTP and gRPC workers check image headers and never decode: they must not load OpenCV
(nor the gRPC worker FastAPI, which it does not serve)."""

from __future__ import annotations

import subprocess
import sys


def test_the_http_worker_and_its_app_do_not_load_opencv():
    code = ("import sys, app.service.http_worker, app.api.main, app.imaging.check; "
            "print(sorted(m for m in ('cv2', 'onnxruntime', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_grpc_worker_and_its_service_do_not_load_opencv_or_fastapi():
    code = ("import sys, app.service.grpc_worker, app.api.grpc.server; "
            "print(sorted(m for m in ('cv2', 'onnxruntime', 'torch', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

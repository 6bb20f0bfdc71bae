"""The HTTP workers check image headers and never decode: they must not load OpenCV."""

from __future__ import annotations

import subprocess
import sys


def test_the_http_worker_and_its_app_do_not_load_opencv():
    code = ("import sys, app.service.http_worker, app.api.main, app.imaging.check; "
            "print(sorted(m for m in ('cv2', 'onnxruntime', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

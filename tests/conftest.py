"""Shared fixtures and folder-assigned markers.

Markers come from the folder a test lives in (tests/unit → unit, tests/gpu → gpu, ...), so
``-m "not gpu"`` works without anybody remembering to decorate a test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("YOLO_OFFLINE", "1")  # Ultralytics must never reach for the network in tests

TESTS = Path(__file__).parent
_FOLDER_MARKERS = {"unit", "kernels", "gpu", "tensorrt", "e2e"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(TESTS.resolve())
        folder = rel.parts[0] if len(rel.parts) > 1 else None
        if folder in _FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, folder))

"""Numba's compiled CUDA kernels are cached per version of the kernel sources: a changed device
function in another module (which Numba's own check misses) gets a fresh folder."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import app.gpu
from app.gpu import kernel_cache


def test_the_folder_is_named_by_every_kernel_source(tmp_path):
    copy = tmp_path / "gpu"
    shutil.copytree(Path(app.gpu.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = kernel_cache.sources_digest(copy)
    assert before == kernel_cache.sources_digest(Path(app.gpu.__file__).parent)
    rounding = copy / "rounding.py"  # device functions the kernels of other files call
    rounding.write_text(rounding.read_text() + "\n# changed\n")
    assert kernel_cache.sources_digest(copy) != before and len(before) == 16


def test_numba_is_pointed_there_unless_the_user_chose(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("YOLOPIPE_CACHE_DIR", str(tmp_path))
    configs = [sys.modules[n] for n in ("numba.core.config", "numba.cuda.core.config") if n in sys.modules]
    for config in configs:
        monkeypatch.setattr(config, "CACHE_DIR", getattr(config, "CACHE_DIR", ""))
    kernel_cache.configure.cache_clear()
    try:
        folder = kernel_cache.configure()
        digest = kernel_cache.sources_digest(Path(app.gpu.__file__).parent)
        assert folder == str(tmp_path / "numba-kernels" / digest)
        import os

        assert os.environ["NUMBA_CACHE_DIR"] == folder and all(c.CACHE_DIR == folder for c in configs)
        kernel_cache.configure.cache_clear()
        monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
        assert kernel_cache.configure() == str(tmp_path / "mine")
    finally:
        kernel_cache.configure.cache_clear()

"""Bytecode kept between runs where the interpreter would compile its imports' sources at every start.

Container images often set ``PYTHONDONTWRITEBYTECODE=1`` and install packages without their
bytecode (uv does not compile by default). Each ``import torch`` then compiles torch's Python
sources from scratch: 2.9 s on the GPU machine's image against 1.4 s from kept bytecode
(``bench/results/2026-12-06-nvidia-h100-imports-probe.json``), on the way to every first result.

So ``keep_bytecode`` (the first thing the ``yolopipe`` command and each service worker do), where
bytecode writing is off and the large packages came without bytecode, points Python's
``sys.pycache_prefix`` at ``<cache>/bytecode/<python tag>`` and writes there: the package folders are
left as they are, the first run compiles once and later runs read. ``PYTHONPYCACHEPREFIX`` passes
it on to the interpreters yolopipe starts. A user's own ``PYTHONPYCACHEPREFIX`` is left alone, and
so is every interpreter that keeps its bytecode already.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from app.artifacts.store import cache_dir

# The packages whose import dominates a start-up; one of them without bytecode turns this on.
LARGE_PACKAGES = ("torch", "numpy")


def bytecode_dir() -> Path:
    """``<cache>/bytecode/<python tag>`` (e.g. ``cpython-312``)."""
    return cache_dir() / "bytecode" / sys.implementation.cache_tag


def keep_bytecode(packages: tuple[str, ...] | None = None) -> bool:
    """Keep the bytecode of this process's imports in ``bytecode_dir()`` where Python would not
    keep it (module docstring); ``packages``: those that decide (``LARGE_PACKAGES``). Returns
    whether it is kept there. Call it before the heavy imports."""
    ours = str(bytecode_dir())
    if sys.pycache_prefix is None:
        if not sys.dont_write_bytecode or not any(_lacks_bytecode(p) for p in packages or LARGE_PACKAGES):
            return False  # Python writes bytecode beside the sources, or they came with theirs
        sys.pycache_prefix = ours
        os.environ["PYTHONPYCACHEPREFIX"] = ours  # the interpreters this one starts read it too
    elif sys.pycache_prefix != ours:
        return False  # the user chose where bytecode lives
    sys.dont_write_bytecode = False
    return True


def _lacks_bytecode(package: str) -> bool:
    """Whether ``package`` is installed with no bytecode beside its ``__init__`` (found without
    importing it)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    return not os.path.exists(importlib.util.cache_from_source(spec.origin))

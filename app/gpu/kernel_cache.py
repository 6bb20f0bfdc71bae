"""Where Numba keeps the compiled CUDA kernels, so that a start loads them instead of compiling.

Numba compiles each kernel (letterbox, NMS, NV12) on its first launch, seconds of every start;
``cache=True`` keeps what it compiled on disk. Numba checks only the kernel's own source file,
not the device functions it calls from other modules (``app.gpu.rounding``), so the cache lives
in a folder named by a hash of every source of this package and Numba's versions: changed code
gets a fresh folder and compiles again. A user's own ``NUMBA_CACHE_DIR`` wins.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

from app.artifacts.store import cache_dir
from app.versions import package_versions


def sources_digest(package: Path) -> str:
    """16 hex digits naming the kernels' sources (every ``*.py`` of ``package``) and Numba's versions."""
    digest = hashlib.sha256()
    for name, version in sorted(package_versions(("numba", "numba-cuda")).items()):
        digest.update(f"{name}={version}\n".encode())
    for source in sorted(Path(package).glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def configure() -> str:
    """Point Numba's cache here (call before any ``cache=True`` kernel is defined); the folder."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    folder = str(cache_dir() / "numba-kernels" / sources_digest(Path(__file__).parent))
    os.environ["NUMBA_CACHE_DIR"] = folder
    for name in ("numba.core.config", "numba.cuda.core.config"):  # read at import: set where already loaded
        if (config := sys.modules.get(name)) is not None:
            config.CACHE_DIR = folder
    return folder

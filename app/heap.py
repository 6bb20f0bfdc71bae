"""glibc's heap, tuned and trimmed through ``ctypes``: the one place that calls into the C library.

Each call changes the whole process, so the library never makes one on its own: the process that
owns itself (``yolopipe predict``, an inference worker) asks. Every function answers False or
does nothing where the C library is not glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@functools.cache
def _libc_function(name: str) -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def _mallopt(param: int, value: int) -> bool:
    mallopt = _libc_function("mallopt")
    return mallopt is not None and bool(mallopt(param, value))


@functools.cache
def keep_freed_heap() -> bool:
    """Have glibc keep freed heap memory for the next allocations instead of handing it back to the
    kernel after every batch, where each file's bytes land on fresh pages that fault in 4 KiB at a
    time (the reads' system time, bench/results/2026-12-01-cpu-2core-folder-plumbing.json). The
    thresholds are where glibc's own adjustment tops out (32 MiB mmap, 64 MiB trim)."""
    return _mallopt(_M_MMAP_THRESHOLD, 32 << 20) and _mallopt(_M_TRIM_THRESHOLD, 64 << 20)


def limit_malloc_arenas(arenas: int) -> bool:
    """At most ``arenas`` glibc arenas in this process. Each thread that allocates otherwise
    gets an arena of its own (up to 8 per core), and ``malloc_trim`` cannot hand back the free
    top of a thread's arena: after a burst, an inference worker's decode and ONNX Runtime
    threads kept tens of MB that way. Call it before threads allocate (glibc fixes the limit
    when the first thread arena is made)."""
    return _mallopt(_M_ARENA_MAX, arenas)


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: the free pages of every arena go back to the kernel."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)

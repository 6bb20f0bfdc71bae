"""app.heap against glibc itself: what malloc_info and the resident set show in a fresh process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

ARENAS = """
import ctypes, os, re, sys, tempfile, threading
from app.heap import limit_malloc_arenas
if sys.argv[1] == "limited":
    assert limit_malloc_arenas(2)
barrier = threading.Barrier(8)
def work():  # eight threads allocating at the same time
    barrier.wait()
    keep = [bytearray(300_000) for _ in range(20)]
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile() as f:
    stream = ctypes.c_void_p(libc.fdopen(os.dup(f.fileno()), b"w"))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(len(re.findall("<heap nr=", open(f.name).read())))
"""


def test_limit_malloc_arenas_holds_many_threads_to_two_arenas():
    def arenas(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, check=True)
        return int(out.stdout)

    assert arenas("limited") <= 2 < arenas("free")



KEPT = """
import os, sys
from app.heap import keep_freed_heap
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "kept":
    assert keep_freed_heap()
chunk = bytearray(24 << 20)  # over glibc's default mmap threshold, under keep_freed_heap's
before = resident()
del chunk
print(before - resident())
"""


def test_keep_freed_heap_keeps_a_freed_batch_for_the_next_one():
    def handed_back(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", KEPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout)

    assert handed_back("free") > 20 << 20  # mmapped: unmapped at once
    assert handed_back("kept") < 4 << 20  # on the heap, under the trim threshold: kept

"""How an AOTInductor package's library is linked, so that a fresh process can load it (build time only).

The package library is linked by the machine's C++ compiler (``$CXX``, else ``g++``). Some
toolchains link their C++ runtime into it statically: on the H200, ``CXX=/opt/gcc/bin/g++`` does,
and the library then carries its own libstdc++, every symbol of it exported (2,490). In a fresh
process the system's libstdc++.so.6 is loaded too (libtorch needs it), and the locale facets' ids
are GNU unique symbols: the dynamic linker binds the library's ids to the system copy while the
library's own copy builds the locales. ``std::regex`` in the container's constructor
(``parse_device_str``) then looks a facet up by the other copy's index and calls through the wrong
table: SIGSEGV on the H200, "API call failed" with a CPU package built the same way
(``bench/results/2026-12-03-nvidia-h200-aoti-loading.json``: the bindings; preloading the system's
libstdc++ made it load, by binding everything to that one copy).

The fix, at build time: ``-Wl,--exclude-libs,ALL`` on the library's link line makes the symbols of
every static archive linked into it local. A runtime linked in statically is then the library's
own, whole (its ids included), and one linked dynamically is unaffected. Inductor's C++ compiler
is a setting (``cpp.cxx``): during the build it is a small script that adds the flag to the link
of the ``.so`` and runs the real compiler unchanged.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from app.errors import BackendUnavailable

# Only the final link of a shared library is touched: "-shared" without "-c".
LINK_FLAGS = ("-Wl,--exclude-libs,ALL",)
SCRIPT = """#!/bin/sh
# yolopipe (app/builder/aoti_link.py): inductor's C++ compiler while it builds a package.
# The library's static archives (a statically linked C++ runtime) stay private to it.
link=0
for arg in "$@"; do
  case "$arg" in -c) exec {real} "$@" ;; -shared) link=1 ;; esac
done
if [ "$link" = 1 ]; then
  exec {real} "$@" {flags}
fi
exec {real} "$@"
"""


def real_compiler() -> str:
    """The compiler inductor would use (its ``cpp.cxx`` setting: ``$CXX``, else ``g++``)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        name = get_cpp_compiler()
    except Exception:  # noqa: BLE001 - a torch without it, or no compiler found: say so below
        name = os.environ.get("CXX", "g++")
    found = shutil.which(name)
    if found is None:
        raise BackendUnavailable(f"no C++ compiler {name!r} on PATH: AOTInductor needs one to build the engine",
                                 hint="install g++ (apt-get install g++), or set CXX")
    return found


def write_script(folder: Path, real: str) -> Path:
    """The wrapper script, named as the real compiler (inductor tells GCC from clang by the name
    or by what ``--version`` prints, which the script passes through)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / Path(real).name
    path.write_text(SCRIPT.replace("{real}", shlex.quote(real)).replace("{flags}", " ".join(LINK_FLAGS)))
    path.chmod(0o755)
    return path


@contextlib.contextmanager
def linking(where: Path | None = None) -> Iterator[Path]:
    """Inductor's C++ compiler is the wrapper script for the length of the block (its settings
    restored after). The script lives in a temporary folder under ``where`` (the engine's own
    folder: a /tmp mounted noexec could not run it), removed after. Yields the script's path."""
    import torch._inductor.config as inductor_config

    with tempfile.TemporaryDirectory(prefix=".yolopipe-link-", dir=where) as folder:
        script = write_script(Path(folder), real_compiler())
        with inductor_config.patch({"cpp.cxx": (str(script),)}):
            yield script

"""py-spy recordings of a server's processes under load, read back as where each process kind
spends its active samples (``bench/http_load.py --parts host --profile``).

Each recording samples every thread of one process (``--threads``), without pausing it
(``--nonblocking``), in py-spy's raw (collapsed stack) format: one line per distinct stack, its
frames from the thread down, then its count. Two views of the same run:

* ``active``: every thread py-spy sees active (it leaves idle ones out unless ``--idle`` is
  given). Linux tells it a thread's state, and a runnable thread waiting for a core counts as
  active: on a machine with more runnable threads than cores the waits just woken
  (``Condition.wait``, the event loop's own ``Runner.run``) take a share they do not burn;
* ``gil``: only the thread holding the GIL (``--gil``): the Python work itself, without the
  native work done with the GIL released.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
from pathlib import Path

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_SHORT = ("site-packages/", "/lib/python3")  # where a library's or the standard library's own path begins


def find_py_spy() -> str:
    found = shutil.which("py-spy")
    if found is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    return found


def record(pid: int, seconds: float, out: Path, rate: int = 200, *, gil: bool = False) -> subprocess.Popen:
    """Start recording ``pid`` for ``seconds`` into ``out``; wait for the process it returns.
    ``gil``: only the samples of the thread holding the GIL (py-spy ``--gil``)."""
    return subprocess.Popen([find_py_spy(), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", str(rate), "--format", "raw", "--threads", "--nonblocking",
                             *(["--gil"] if gil else []), "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def short_file(path: str, root: Path) -> str:
    """A frame's file without the machine's prefix: ``starlette/routing.py``, ``app/api/routes.py``,
    ``asyncio/events.py``."""
    if path.startswith(str(root) + "/"):
        return path[len(str(root)) + 1:]
    for marker in _SHORT:
        if marker in path:
            rest = path.split(marker, 1)[1]
            return rest.split("/", 1)[1] if marker == "/lib/python3" and "/" in rest else rest
    return path


def package_of(file: str) -> str:
    """What a file belongs to: ``app/api``, ``starlette``, ``asyncio``... (top two levels inside
    ``app``, the top level elsewhere; a single module stands for itself)."""
    parts = file.split("/")
    if parts[0] == "app" and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0].removesuffix(".py") if len(parts) == 1 else parts[0]


def summarize(raw: Path, root: Path, n: int = 25) -> dict:
    """The samples of one recording: the share of each function itself (``self_percent``) and
    with what it calls (``total_percent``), the share of each package itself, and of each thread;
    top ``n`` of each."""
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    packages: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        thread, *frames = stack.split(";")
        names = []
        for frame in frames:
            match = _FRAME.match(frame)
            if match is None:
                names.append((frame, frame))
                continue
            file = short_file(match["file"], root)
            names.append((f"{match['function']} ({file})", file))
        samples += k
        threads[thread.split(": ", 1)[-1]] += k
        if names:
            own[names[-1][0]] += k
            packages[package_of(names[-1][1])] += k
        for name in {name for name, _ in names}:
            total[name] += k

    def share(counter: collections.Counter) -> dict:
        return {key: round(100 * v / max(samples, 1), 1) for key, v in counter.most_common(n)}

    return {"samples": samples, "threads_percent": share(threads), "packages_self_percent": share(packages),
            "self_percent": share(own), "total_percent": share(total)}

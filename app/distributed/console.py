"""Ray's own output kept off the user's terminal, in its session's log files.

A Ray job prints from four places unless told otherwise: Ray's Python loggers (``ray.init``'s
``logging_level``), the actors' output, forwarded to the driver (``ray.init``'s
``log_to_driver``), Ray Data's console handler (``quiet_ray_data``), and the C++ core of the
driver's process, which writes its error lines to file descriptor 2 whatever its log file
(``core_log_to``). No option of Ray 2.60 moves that last one: ``RAY_BACKEND_LOG_LEVEL=fatal``
silences it, but prints a line of its own and silences every Ray process the driver starts.

The core prints one such line with every Ray Data actor pool: Ray Data hands its actors their
function and context as ObjectRefs, and an actor with arguments in the object store and
``max_restarts > 0`` gets a warning at level E (ray-project/ray#53727: a restart fails if those
objects are gone). The driver put them and keeps them on its node until the job ends, so a
restarted actor finds them (``tests/unit/distributed/test_ray_job.py`` kills a node mid-job);
the line goes to the log folder with the core's others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path


def quiet_ray_data() -> None:
    """Ray Data's console handler says errors only; its file handler keeps everything
    (``<session>/logs/ray-data``). Ray Data sets its logger up when ``ray.data`` is imported."""
    import ray.data  # noqa: F401 - sets up the "ray.data" logger and its handlers

    for handler in logging.getLogger("ray.data").handlers:
        if handler.get_name() == "console":
            handler.setLevel(logging.ERROR)


@contextlib.contextmanager
def core_log_to(path: Path | None) -> Iterator[None]:
    """File descriptor 2, where Ray's C++ core writes, appends to ``path`` within the block, while
    Python's ``sys.stderr`` (the terminal's messages, the progress bar) keeps writing where
    descriptor 2 wrote before. ``path`` None, or a file that cannot be opened: nothing moves."""
    if path is None:
        yield
        return
    try:
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        yield
        return
    saved = sys.stderr
    try:
        python_on_fd2 = saved.fileno() == 2
    except (AttributeError, OSError, ValueError):  # a stream of its own (a test runner's): not descriptor 2
        python_on_fd2 = False
    saved.flush()
    terminal = os.dup(2)
    if python_on_fd2:
        sys.stderr = open(terminal, "w", buffering=1, encoding=saved.encoding, errors=saved.errors,  # noqa: SIM115
                          closefd=False)
    os.dup2(log, 2)
    os.close(log)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)
        if python_on_fd2:
            sys.stderr.close()
            sys.stderr = saved
        os.close(terminal)

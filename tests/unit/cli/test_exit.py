"""``app.cli.exit_now``: the process ends with the command's status, its output and exit handlers
intact, whether it skips the interpreter's finalization (torch loaded, no other thread working)
or not; checked in fresh interpreters, where finalization is observable (a ``__del__`` at exit)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys, threading, time
if {torch}:
    import torch  # noqa: F401
class Finalized:
    def __del__(self):
        sys.stderr.write("finalized\\n")
keep = Finalized()  # its __del__ runs only in the interpreter's own finalization
atexit.register(lambda: open(sys.argv[1], "w").write("handler ran"))
if {thread}:
    threading.Thread(target=time.sleep, args=(0.5,)).start()
sys.stdout.write("x" * 100000 + "\\n")  # buffered: must reach the pipe before the end
from app.cli import exit_now
exit_now({code})
"""


def run(tmp_path, *, torch: bool, thread: bool, code: object) -> tuple[subprocess.CompletedProcess, bool]:
    marker = tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(torch=torch, thread=thread, code=repr(code)), str(marker)],
                          capture_output=True, text=True, timeout=300)
    return proc, marker.exists() and marker.read_text() == "handler ran"


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (1, 1), (3, 3), ("bad input", 1)])
def test_with_torch_loaded_the_process_ends_at_once_with_its_status_output_and_handlers(tmp_path, code, status):
    proc, handler_ran = run(tmp_path, torch=True, thread=False, code=code)
    assert proc.returncode == status, proc.stderr
    assert handler_ran
    assert proc.stdout == "x" * 100000 + "\n"
    assert "finalized" not in proc.stderr  # the interpreter's finalization was skipped
    assert ("bad input" in proc.stderr) == (code == "bad input")


@pytest.mark.parametrize(("torch", "thread"), [(False, False), (True, True)])
def test_without_torch_or_with_a_thread_at_work_the_interpreter_ends_as_usual(tmp_path, torch, thread):
    proc, handler_ran = run(tmp_path, torch=torch, thread=thread, code=3)
    assert proc.returncode == 3, proc.stderr
    assert handler_ran and proc.stdout == "x" * 100000 + "\n"
    assert "finalized" in proc.stderr

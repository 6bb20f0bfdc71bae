"""The run folder's lock: a folder that a live process uses survives every sweep; the folder of a
killed server (SIGKILL: no clean-up of its own) is removed by the next ``RunLayout.create``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.ipc import layout as layout_module
from app.ipc.layout import LOCK_NAME, RunLayout, sweep

REPO = Path(__file__).resolve().parents[3]

# A process that creates a run folder in argv[1] (and, with argv[2] == "worker", hands the layout
# to a spawned child that holds it), prints the folder and the child's pid, and sleeps.
OWNER = """
import multiprocessing, sys, time
from app.ipc.layout import RunLayout
from tests.unit.ipc.test_layout import hold
layout = RunLayout.create(0, base=sys.argv[1])
child = 0
if sys.argv[2:] == ["worker"]:
    proc = multiprocessing.get_context("spawn").Process(target=hold, args=(layout, sys.argv[1]))
    proc.start()
    child = proc.pid
    while not any(p.name.startswith("attached-") for p in __import__("pathlib").Path(sys.argv[1]).iterdir()):
        time.sleep(0.05)
print(layout.root, child, flush=True)
time.sleep(120)
"""


def hold(layout: RunLayout, base: str) -> None:
    """A worker: it has the layout (unpickled, so it holds the lock) and says so, then sleeps."""
    Path(base, f"attached-{os.getpid()}").touch()
    time.sleep(120)


def start_owner(base: Path, *extra: str) -> tuple[subprocess.Popen, Path, int]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(base), *extra], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    root, child = proc.stdout.readline().split()
    return proc, Path(root), int(child)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return  # a zombie holds no lock
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} still runs")


def test_create_makes_a_locked_folder_and_remove_lets_go(tmp_path):
    layout = RunLayout.create(2, base=tmp_path)
    assert layout.root.parent == tmp_path and layout.root.name.startswith("yolopipe-")
    assert layout.lock_file.is_file() and layout.metrics_dir.is_dir()
    assert str(layout.root) in layout_module._held
    layout.remove()
    assert not layout.root.exists() and str(layout.root) not in layout_module._held


def test_a_live_servers_folder_survives_and_a_killed_ones_goes_at_the_next_create(tmp_path, caplog):
    proc, root, _ = start_owner(tmp_path)
    try:
        assert sweep(tmp_path) == []
        mine = RunLayout.create(0, base=tmp_path)
        assert root.is_dir() and (root / "metrics").is_dir()  # live: left alone
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with caplog.at_level(logging.INFO, logger="yolopipe.serving"):
            other = RunLayout.create(0, base=tmp_path)
        assert not root.exists()
        assert [r.getMessage() for r in caplog.records if str(root) in r.getMessage()] == [
            f"removed {root}, left by a yolopipe serve that is no longer running"]
        assert mine.root.is_dir() and other.root.is_dir()  # this process's own folders are live too
        mine.remove()
        other.remove()
    finally:
        kill(proc.pid)
        proc.wait()


def test_a_folder_whose_worker_still_runs_is_live_after_its_supervisor_is_killed(tmp_path):
    proc, root, child = start_owner(tmp_path, "worker")
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert sweep(tmp_path) == [] and root.is_dir()  # the worker (which unpickled the layout) holds it
        kill(child)
        wait_gone(child)
        assert sweep(tmp_path) == [root] and not root.exists()
    finally:
        kill(proc.pid)
        kill(child)
        proc.wait()


def test_a_starting_servers_folder_without_its_lock_yet_is_left(tmp_path):
    starting = tmp_path / "yolopipe-abcd1234"
    (starting / "metrics").mkdir(parents=True)
    assert sweep(tmp_path) == [] and starting.is_dir()
    assert RunLayout.create(0, base=tmp_path).root != starting and starting.is_dir()


def test_an_old_folder_without_a_lock_goes_only_when_nothing_uses_it(tmp_path):
    """Such as a yolopipe from before the lock left: removed when old and nothing has it open."""
    old = tmp_path / "yolopipe-old_1234"
    (old / "metrics").mkdir(parents=True)
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    with open(old / "ring-1-0-0", "wb") as ring:  # a live (old) server's ring
        os.utime(old, (hour_ago, hour_ago))
        assert sweep(tmp_path) == [] and old.is_dir()
    os.utime(old, (hour_ago, hour_ago))
    assert ring.closed and sweep(tmp_path, unlocked_age_s=7200) == []  # not old enough
    if not Path("/proc/net/unix").exists():
        pytest.skip("no /proc: an unlocked folder is never removed")
    assert sweep(tmp_path) == [old] and not old.exists()


def test_only_this_users_run_folders_are_swept(tmp_path):
    """Other things named yolopipe-* (yolopipe-ray, bench folders, shared-memory regions, links)
    stay, even with a free lock file in them."""
    keep = []
    for name in ("yolopipe-ray", "yolopipe-bench-folder-abcd1234", "yolopipe-ABCD1234", "yolopipe-abcd12345"):
        (tmp_path / name).mkdir()
        (tmp_path / name / LOCK_NAME).touch()
        keep.append(tmp_path / name)
    (tmp_path / "yolopipe-region01").write_bytes(b"x")  # a client's shared-memory object
    (tmp_path / "elsewhere").mkdir()
    dead = RunLayout.create(0, base=tmp_path / "elsewhere")
    for fd in layout_module._held.pop(str(dead.root)):
        os.close(fd)  # as if its process were gone
    (tmp_path / "yolopipe-link0001").symlink_to(dead.root)
    assert sweep(tmp_path) == []
    assert all(p.exists() for p in keep) and (tmp_path / "yolopipe-region01").exists() and dead.root.is_dir()


def test_a_folder_swept_between_its_lock_files_creation_and_locking_is_made_again(tmp_path, monkeypatch):
    """The race with a sweeper: the sweeper took the fresh lock file first and removed the folder;
    create notices (the lock it got is on a removed file) and makes another folder."""
    import fcntl
    import shutil

    real_flock = fcntl.flock
    swept = []

    def flock(fd, operation):
        if operation == fcntl.LOCK_SH and not swept:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            swept.append(path.parent)
            shutil.rmtree(path.parent)
        return real_flock(fd, operation)

    if not Path("/proc/self/fd").exists():
        pytest.skip("needs /proc")
    monkeypatch.setattr(layout_module.fcntl, "flock", flock)
    layout = RunLayout.create(0, base=tmp_path)
    assert swept and swept[0] != layout.root and not swept[0].exists()
    assert layout.root.is_dir() and layout.lock_file.is_file()
    monkeypatch.undo()
    assert sweep(tmp_path) == [] and layout.root.is_dir()
    layout.remove()

"""The run folder the processes of one ``yolopipe serve`` share: where each socket, ring,
status block and metrics file lives.

Each run folder holds a lock file, ``alive.lock``, locked (``flock``, shared) by every process
that uses the folder: the supervisor from the folder's first moment (``RunLayout.create``), and
every worker that receives the layout (unpickling it takes the lock: ``_attach``). The kernel
drops a process's lock when it dies, SIGKILL included, so a folder whose lock can be taken
exclusively is used by no live process. ``RunLayout.create`` first sweeps such folders (left by
killed servers) from its base folder: only this user's, named as ``create`` names them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("yolopipe.serving")

PREFIX = "yolopipe-"
LOCK_NAME = "alive.lock"
# What tempfile.mkdtemp(prefix=PREFIX) names: nothing else of ours (yolopipe-ray, yolopipe-bench-folder-*,
# shared-memory regions named /yolopipe-*) is ever swept.
_NAME = re.compile(re.escape(PREFIX) + r"[a-z0-9_]{8}")
# A run folder without a lock file (made by a yolopipe from before the lock, or this instant by
# a starting server, which locks it next) is removed only when older than this and in use by no process.
UNLOCKED_AGE_S = 600.0
_held: dict[str, list[int]] = {}  # run folder → the descriptors this process holds its lock with


@dataclass(frozen=True)
class RunLayout:
    """The run folder the supervisor owns: sockets, status blocks, rings and metrics files.

    In /dev/shm where there is one (rings and status blocks are then plain shared memory)."""

    root: Path
    workers: int  # inference workers

    @classmethod
    def create(cls, workers: int, base: str | Path | None = None) -> RunLayout:
        """A new run folder, locked, in ``base`` (default: /dev/shm where writable, else the temporary
        folder); the folders of dead servers there are removed first (``sweep``)."""
        if base is None:
            base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        sweep(base)
        for _ in range(5):
            root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
            if _lock(root):
                break
        else:
            raise OSError(f"could not create a locked run folder in {base}")
        (root / "metrics").mkdir()
        return cls(root, workers)

    def __reduce__(self) -> tuple:
        # A process that receives the layout (a spawned worker) holds the folder's lock too.
        return _attach, (self.root, self.workers)

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def starting(self) -> Path:
        """There while ``yolopipe serve`` starts its inference workers: its HTTP workers already
        answer, and are not ready until every inference worker is."""
        return self.root / "starting"

    def socket(self, worker: int) -> Path:
        return self.root / f"worker-{worker}.sock"

    def status(self, worker: int) -> Path:
        return self.root / f"worker-{worker}.status"

    def ring(self, worker: int, serial: int) -> Path:
        return self.root / f"ring-{os.getpid()}-{worker}-{serial}"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        for fd in _held.pop(str(self.root), []):
            os.close(fd)  # after the removal: never a moment when a sweeper could take it half removed


def _attach(root: Path, workers: int) -> RunLayout:
    """The layout as a worker unpickles it: this process holds the folder's lock (shared) while it lives."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        pass  # no lock file (the folder is gone, or made without one): nothing to hold
    else:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # a sweeper holds it: the supervisor is gone, and so is the folder soon
            os.close(fd)
        else:
            _held.setdefault(str(root), []).append(fd)
    return RunLayout(Path(root), workers)


def _lock(root: Path) -> bool:
    """The lock file made and locked, the first thing in a new run folder. False when a sweeper
    removed the folder before the lock was taken (the caller makes another)."""
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a sweeper's exclusive lock, if any, lasts its removal
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(path)
    except FileNotFoundError:  # swept between the open and the lock
        os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
        return False
    except BaseException:
        os.close(fd)
        raise
    _held.setdefault(str(root), []).append(fd)
    return True


def sweep(base: str | Path, *, unlocked_age_s: float = UNLOCKED_AGE_S) -> list[Path]:
    """Remove the run folders in ``base`` that no live process uses: this user's folders named
    as ``create`` names them whose lock file can be locked exclusively (without waiting), or that
    have none, are older than ``unlocked_age_s`` and hold nothing any process has open. One log
    line per folder removed; the folders removed are returned. Never raises for a folder."""
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return removed
    for name in names:
        if not _NAME.fullmatch(name):
            continue
        folder = Path(os.path.abspath(base)) / name
        try:
            if _remove_if_dead(folder, unlocked_age_s):
                removed.append(folder)
                log.info("removed %s, left by a yolopipe serve that is no longer running", folder)
        except OSError as exc:
            log.debug("left run folder %s: %s", folder, exc)
    return removed


def _remove_if_dead(folder: Path, unlocked_age_s: float) -> bool:
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or str(folder) in _held:
        return False
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return _remove_unlocked(folder, st, unlocked_age_s)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # a live process holds it
            raise
        shutil.rmtree(folder)  # while locked: a worker attaching now finds it taken
        return True
    finally:
        os.close(fd)


def _remove_unlocked(folder: Path, st: os.stat_result, unlocked_age_s: float) -> bool:
    """A folder without a lock file: made by a yolopipe before the lock (its server may still
    run), or just now by a starting server (about to lock it). Removed only when old, a run
    folder by its contents, and nothing in it is open in any process this user can see."""
    if time.time() - st.st_mtime < unlocked_age_s:
        return False
    if not (folder / "metrics").is_dir() or _in_use(folder):
        return False
    shutil.rmtree(folder)
    return True


def _in_use(folder: Path) -> bool:
    """Whether a process has a file under ``folder`` open or mapped, or a socket bound there
    (Linux's /proc; True where it cannot tell)."""
    proc = Path("/proc")
    prefix = str(folder) + "/"
    try:
        if prefix in Path("/proc/net/unix").read_text():
            return True
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return True
    for pid in pids:
        try:
            for fd in os.listdir(proc / pid / "fd"):
                if os.readlink(proc / pid / "fd" / fd).startswith(prefix):
                    return True
            if prefix in (proc / pid / "maps").read_text():
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False

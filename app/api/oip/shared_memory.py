"""Triton's system shared-memory extension: regions a client registers, tensors read from and
written to them (REST and gRPC alike).

A client on this host creates a POSIX shared-memory object (``/dev/shm/<key>``), registers a
span of it under a name, then names that region in an input's or output's parameters
(``shared_memory_region``, ``shared_memory_byte_size``, ``shared_memory_offset``): the server
reads the input's bytes from it, and writes the output there instead of into the response.

Every front-end process (HTTP and gRPC workers) may receive the register call, and any of them
the inference that uses the region, so the registry is a folder of small files in the run
folder, one per region, shared by all of them. Nothing stays mapped or open: each use opens the
object, checks it, reads or writes the span with ``pread``/``pwrite`` and closes it, so an
unregister (or the server's exit) leaves nothing behind, and an object the client shrank is an
error, never a SIGBUS.

What a client can make the server touch is bounded:

* only when the server allows it (``allow_client_shm``, off by default as in Triton) and only
  for a client on a loopback connection (shared memory is on this host anyway);
* only a key that names a POSIX shared-memory object: ``/name``, one level, no ``..``, opened
  without following a symlink and without blocking (a FIFO), and it must be a regular file;
* inputs opened read-only, outputs read-write; every span within its region, every region
  within its object (checked at registration and again at each use); an input span no larger
  than the request body limit.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import ipaddress
import json
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.config import MAX_SHM_REGIONS
from app.errors import ImageTooLarge, InvalidParameter, SharedMemoryError

SHM_ROOT = Path("/dev/shm")
# A POSIX shared-memory name as shm_open takes it: a leading slash and one path component.
_KEY = re.compile(r"/[A-Za-z0-9_.:@+=-]{1,250}")
_MAX_NAME = 256
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"


@dataclass(frozen=True)
class Region:
    """A registered region: ``byte_size`` bytes of the object ``key`` from ``offset`` on."""

    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lies: ``byte_size`` bytes at ``offset`` within the region ``region``."""

    region: str
    offset: int
    byte_size: int


def tensor_place(parameters: dict[str, Any], where: str) -> TensorPlace | None:
    """The shared-memory parameters of one input or output, checked; None when it has none."""
    region = parameters.get(REGION)
    if region is None:
        if BYTE_SIZE in parameters or OFFSET in parameters:
            raise InvalidParameter(f"{where}: {BYTE_SIZE} and {OFFSET} need {REGION}")
        return None
    if not isinstance(region, str) or not region:
        raise InvalidParameter(f"{where}: {REGION} must be a region's name")
    size = parameters.get(BYTE_SIZE)
    offset = parameters.get(OFFSET, 0)
    for value, name in ((size, BYTE_SIZE), (offset, OFFSET)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidParameter(f"{where}: {name} must be a whole number of bytes >= 0, got {str(value)[:40]!r}")
    return TensorPlace(region, offset, size)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1024)  # asked per inference request; a server sees few client addresses
def is_loopback(host: str | None) -> bool:
    """A client address on this host (``127.0.0.0/8``, ``::1``, IPv4-mapped loopback)."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


class SharedMemoryRegistry:
    """The regions of one server, in ``folder`` (shared by its processes)."""

    def __init__(self, folder: Path, *, enabled: bool, max_regions: int = MAX_SHM_REGIONS,
                 root: Path = SHM_ROOT) -> None:
        self.folder = Path(folder)
        self.enabled = enabled
        self.max_regions = max_regions
        self.root = Path(root)

    # --- the extension's calls ----------------------------------------------------------------
    def register(self, name: Any, key: Any, offset: Any, byte_size: Any, *, local: bool) -> Region:
        self.guard(local)
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            raise SharedMemoryError(f"a region's name is 1 to {_MAX_NAME} characters")
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key in ("/.", "/.."):
            raise SharedMemoryError(f"key {str(key)[:80]!r} is not a POSIX shared-memory name ('/name': a leading "
                                    "slash, then letters, digits and _.:@+=- only)")
        for value, what in ((offset, "offset"), (byte_size, "byte_size")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SharedMemoryError(f"{what} must be a whole number of bytes >= 0, got {str(value)[:40]!r}")
        if byte_size == 0:
            raise SharedMemoryError("byte_size must be at least 1")
        region = Region(name, key, offset, byte_size)
        fd = self._open(region, os.O_RDONLY)  # the object exists, is a file, and holds the span
        os.close(fd)
        self.folder.mkdir(exist_ok=True)
        if len(os.listdir(self.folder)) >= self.max_regions:
            raise SharedMemoryError(f"{self.max_regions} regions are registered, the most this server holds; "
                                    "unregister some first")
        staged = self.folder / f"{os.getpid()}-{os.urandom(6).hex()}.staged"
        staged.write_text(json.dumps(asdict(region)))
        try:
            os.link(staged, self._file(name))  # atomic: of two processes registering a name, one wins
        except FileExistsError:
            raise SharedMemoryError(f"a region named {name[:100]!r} is already registered; unregister it "
                                    "first") from None
        finally:
            staged.unlink()
        return region

    def unregister(self, name: str | None, *, local: bool) -> None:
        """One region, or every region when ``name`` is empty; an unknown name is no error."""
        self.guard(local)
        files = [self._file(name)] if name else list(self.folder.glob("*.json"))
        for path in files:
            path.unlink(missing_ok=True)

    def status(self, name: str | None, *, local: bool) -> list[Region]:
        """One region (an error when it is not registered), or all of them."""
        self.guard(local)
        if name:
            return [self.region(name)]
        regions = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                regions.append(Region(**json.loads(path.read_text())))
            except FileNotFoundError:  # unregistered meanwhile
                continue
        return sorted(regions, key=lambda r: r.name)

    # --- tensors in regions ---------------------------------------------------------------------
    def read(self, place: TensorPlace, *, local: bool, limit: int, what: str) -> bytes:
        """An input's bytes; ``limit``: the most one request may bring (the body limit)."""
        self.guard(local)
        if place.byte_size > limit:
            raise ImageTooLarge(f"{what}: {BYTE_SIZE} {place.byte_size:,} is over the limit of {limit:,} bytes")
        region = self.region(place.region)
        start = self._span(region, place, what)
        fd = self._open(region, os.O_RDONLY)
        try:
            data = os.pread(fd, place.byte_size, start)
        finally:
            os.close(fd)
        if len(data) != place.byte_size:
            raise SharedMemoryError(f"{what}: region {region.name!r} ends before its {place.byte_size} bytes")
        return data

    def check_output(self, place: TensorPlace, *, local: bool, what: str) -> None:
        """Before inference: the output's region is registered and holds its span."""
        self.guard(local)
        self._span(self.region(place.region), place, what)

    def write(self, place: TensorPlace, data: bytes, *, local: bool, what: str) -> None:
        self.guard(local)
        if len(data) > place.byte_size:
            raise SharedMemoryError(f"{what} needs {len(data):,} bytes; its {BYTE_SIZE} is {place.byte_size:,}")
        region = self.region(place.region)
        start = self._span(region, place, what)
        fd = self._open(region, os.O_RDWR)
        try:
            written = os.pwrite(fd, data, start)
        finally:
            os.close(fd)
        if written != len(data):
            raise SharedMemoryError(f"{what}: region {region.name!r} took {written} of {len(data)} bytes")

    # --- the checks -----------------------------------------------------------------------------
    def guard(self, local: bool) -> None:
        if not self.enabled:
            raise SharedMemoryError("client shared memory is off on this server; start it with --allow-client-shm "
                                    "(YOLOPIPE_ALLOW_CLIENT_SHM=true) to use it")
        if not local:
            raise SharedMemoryError("shared memory is for clients on the server's host: this connection is not "
                                    "a loopback one")

    def region(self, name: str) -> Region:
        try:
            return Region(**json.loads(self._file(name).read_text()))
        except FileNotFoundError:
            raise SharedMemoryError(f"no shared-memory region named {name[:100]!r} is registered") from None

    @staticmethod
    def _span(region: Region, place: TensorPlace, what: str) -> int:
        """The span's start in the object, once it is known to lie within its region."""
        if place.offset + place.byte_size > region.byte_size:
            raise SharedMemoryError(
                f"{what}: {place.byte_size:,} bytes at offset {place.offset:,} are outside region {region.name!r} "
                f"of {region.byte_size:,} bytes")
        return region.offset + place.offset

    def _open(self, region: Region, mode: int) -> int:
        """The object's descriptor, once it is known to be a regular file that holds the region."""
        path = self.root / region.key[1:]
        try:
            fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            reason = {errno.ENOENT: "does not exist", errno.ELOOP: "is a symbolic link",
                      errno.EACCES: "is not " + ("readable" if mode == os.O_RDONLY else "writable") + " by the server"}
            raise SharedMemoryError(f"shared-memory key {region.key!r} {reason.get(exc.errno, exc.strerror)}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise SharedMemoryError(f"shared-memory key {region.key!r} is not a shared-memory object")
        if region.offset + region.byte_size > info.st_size:
            os.close(fd)
            raise SharedMemoryError(
                f"region {region.name!r} ({region.byte_size:,} bytes at offset {region.offset:,}) is outside "
                f"shared-memory object {region.key!r} of {info.st_size:,} bytes")
        return fd

    def _file(self, name: str) -> Path:
        return self.folder / (hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest() + ".json")


@dataclass(frozen=True)
class RegionAccess:
    """One request's way to the registry: whether its client is on this host, and the most bytes
    an input may bring (the request body limit)."""

    registry: SharedMemoryRegistry
    local: bool
    limit: int

    @staticmethod
    def of(access: RegionAccess | None) -> RegionAccess:
        """``access``, or the error for a request that names a region where none can be used."""
        if access is None:
            raise SharedMemoryError("shared memory cannot be used here")
        return access

    def read(self, place: TensorPlace, what: str) -> bytes:
        return self.registry.read(place, local=self.local, limit=self.limit, what=what)

    def check_output(self, place: TensorPlace, what: str) -> None:
        self.registry.check_output(place, local=self.local, what=what)

    def write(self, place: TensorPlace, data: bytes, what: str) -> None:
        self.registry.write(place, data, local=self.local, what=what)


def run_registry(run_folder: Path, *, enabled: bool) -> SharedMemoryRegistry:
    """The registry every process of one server shares: a folder inside its run folder (removed
    with it when the server stops)."""
    return SharedMemoryRegistry(Path(run_folder) / "shared-memory", enabled=enabled)

"""The system shared-memory registry on real POSIX shared-memory objects (/dev/shm): what a
client can register and use, and everything it must not make the server touch."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from app.api.oip.shared_memory import (
    RegionAccess,
    SharedMemoryRegistry,
    TensorPlace,
    is_loopback,
    tensor_place,
)
from app.errors import ImageTooLarge, InvalidParameter, SharedMemoryError

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not os.access(SHM, os.W_OK), reason="needs a writable /dev/shm")


@pytest.fixture
def objects():
    """Make POSIX shared-memory objects (as shm_open would: files in /dev/shm); removed after."""
    made: list[Path] = []

    def make(data: bytes, mode: int = 0o600) -> str:
        key = f"/yolopipe-unit-{uuid.uuid4().hex[:12]}"
        path = SHM / key[1:]
        path.write_bytes(data)
        path.chmod(mode)
        made.append(path)
        return key

    yield make
    for path in made:
        path.unlink(missing_ok=True)


@pytest.fixture
def registry(tmp_path) -> SharedMemoryRegistry:
    return SharedMemoryRegistry(tmp_path / "regions", enabled=True)


def refused(call, words: str, error=SharedMemoryError) -> None:
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value), str(info.value)


def test_a_registered_span_reads_back_and_an_output_writes_in_place(registry, objects):
    key = objects(bytes(range(256)) * 4)
    registry.register("in", key, 100, 500, local=True)
    assert registry.read(TensorPlace("in", 10, 20), local=True, limit=1 << 20, what="x") == bytes(range(110, 130))
    registry.write(TensorPlace("in", 0, 8), b"ABCDEFGH", local=True, what="x")
    assert (SHM / key[1:]).read_bytes()[100:108] == b"ABCDEFGH"
    assert [r.name for r in registry.status("", local=True)] == ["in"]
    registry.unregister("in", local=True)
    assert registry.status(None, local=True) == []
    refused(lambda: registry.read(TensorPlace("in", 0, 1), local=True, limit=10, what="x"), "no shared-memory region")


def test_every_process_shares_the_registry_and_one_name_is_registered_once(tmp_path, objects):
    """Two registries on one folder stand for two worker processes of one server."""
    a = SharedMemoryRegistry(tmp_path / "r", enabled=True)
    b = SharedMemoryRegistry(tmp_path / "r", enabled=True)
    key = objects(b"x" * 64)
    a.register("region", key, 0, 64, local=True)
    assert b.region("region").key == key
    refused(lambda: b.register("region", key, 0, 8, local=True), "already registered")
    b.unregister(None, local=True)  # every region
    assert a.status(None, local=True) == []
    assert sorted(os.listdir(tmp_path / "r")) == []  # no staged file left behind either


@pytest.mark.parametrize("key, words", [
    ("/../etc/passwd", "not a POSIX shared-memory name"),
    ("/etc/passwd", "not a POSIX shared-memory name"),
    ("etc", "not a POSIX shared-memory name"),
    ("/", "not a POSIX shared-memory name"),
    ("/..", "not a POSIX shared-memory name"),
    ("/a\0b", "not a POSIX shared-memory name"),
    ("/yolopipe-unit-missing", "does not exist"),
    (7, "not a POSIX shared-memory name"),
])
def test_keys_name_shared_memory_objects_only(registry, key, words):
    refused(lambda: registry.register("r", key, 0, 1, local=True), words)


def test_symlinks_directories_and_fifos_are_refused(registry, objects, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 100)
    name = f"yolopipe-unit-{uuid.uuid4().hex[:12]}"
    for kind, make in (("symbolic link", lambda p: p.symlink_to(secret)), ("not a shared-memory object", os.mkdir),
                       ("not a shared-memory object", os.mkfifo)):
        path = SHM / name
        make(path)
        try:
            refused(lambda: registry.register("r", f"/{name}", 0, 10, local=True), kind)
        finally:
            path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()


def test_spans_stay_within_their_region_and_regions_within_their_object(registry, objects):
    key = objects(b"\0" * 100)
    refused(lambda: registry.register("r", key, 50, 51, local=True), "outside shared-memory object")
    refused(lambda: registry.register("r", key, 0, 0, local=True), "at least 1")
    refused(lambda: registry.register("r", key, -1, 10, local=True), "offset must be")
    registry.register("r", key, 50, 50, local=True)
    refused(lambda: registry.read(TensorPlace("r", 1, 50), local=True, limit=1000, what="input 'image'"),
            "input 'image': 50 bytes at offset 1 are outside region 'r'")
    refused(lambda: registry.check_output(TensorPlace("r", 40, 20), local=True, what="output"), "outside region")
    refused(lambda: registry.write(TensorPlace("r", 0, 8), b"x" * 9, local=True, what="output 'det_boxes'"),
            "output 'det_boxes' needs 9 bytes")
    refused(lambda: registry.read(TensorPlace("r", 0, 50), local=True, limit=49, what="input"), "over the limit",
            ImageTooLarge)


def test_an_object_shrunk_after_registration_is_an_error_not_a_crash(registry, objects):
    key = objects(b"\1" * 4096)
    registry.register("r", key, 0, 4096, local=True)
    os.truncate(SHM / key[1:], 100)
    refused(lambda: registry.read(TensorPlace("r", 0, 4096), local=True, limit=1 << 20, what="x"),
            "outside shared-memory object")


def test_inputs_are_opened_read_only(registry, objects, monkeypatch):
    key = objects(b"\2" * 64, mode=0o400)
    registry.register("r", key, 0, 64, local=True)
    modes = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *a: modes.append(flags & os.O_ACCMODE) or real_open(path, flags, *a))
    assert registry.read(TensorPlace("r", 0, 4), local=True, limit=64, what="x") == b"\2" * 4
    assert modes == [os.O_RDONLY]
    if os.geteuid() != 0:  # root may write a read-only file
        refused(lambda: registry.write(TensorPlace("r", 0, 4), b"xxxx", local=True, what="x"), "not writable")


def test_off_unless_allowed_and_only_for_clients_on_this_host(tmp_path, objects):
    key = objects(b"\0" * 8)
    off = SharedMemoryRegistry(tmp_path / "off", enabled=False)
    refused(lambda: off.register("r", key, 0, 8, local=True), "--allow-client-shm")
    refused(lambda: off.status(None, local=True), "--allow-client-shm")
    on = SharedMemoryRegistry(tmp_path / "on", enabled=True)
    refused(lambda: on.register("r", key, 0, 8, local=False), "not a loopback one")
    on.register("r", key, 0, 8, local=True)
    refused(lambda: on.read(TensorPlace("r", 0, 8), local=False, limit=8, what="x"), "not a loopback one")
    refused(lambda: RegionAccess.of(None), "cannot be used here")


def test_the_region_count_is_bounded(tmp_path, objects):
    registry = SharedMemoryRegistry(tmp_path / "r", enabled=True, max_regions=2)
    key = objects(b"\0" * 8)
    registry.register("a", key, 0, 8, local=True)
    registry.register("b", key, 0, 8, local=True)
    refused(lambda: registry.register("c", key, 0, 8, local=True), "2 regions are registered")


@pytest.mark.parametrize("parameters, expected", [
    ({}, None),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 10}, TensorPlace("r", 0, 10)),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 10, "shared_memory_offset": 4}, TensorPlace("r", 4, 10)),
])
def test_tensor_places(parameters, expected):
    assert tensor_place(parameters, "input") == expected


@pytest.mark.parametrize("parameters", [
    {"shared_memory_byte_size": 10},
    {"shared_memory_region": "", "shared_memory_byte_size": 10},
    {"shared_memory_region": "r"},
    {"shared_memory_region": "r", "shared_memory_byte_size": -1},
    {"shared_memory_region": "r", "shared_memory_byte_size": 1.5},
    {"shared_memory_region": "r", "shared_memory_byte_size": True},
    {"shared_memory_region": 3, "shared_memory_byte_size": 1},
])
def test_bad_tensor_places(parameters):
    with pytest.raises(InvalidParameter):
        tensor_place(parameters, "input")


@pytest.mark.parametrize("host, local", [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True),
                                         ("::ffff:127.0.0.1", True), ("10.0.0.1", False), ("::ffff:10.0.0.1", False),
                                         ("example.com", False), ("", False), (None, False)])
def test_loopback(host, local):
    assert is_loopback(host) is local

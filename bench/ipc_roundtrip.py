"""Which IPC carries image bytes from the HTTP workers to the inference worker: measured.

Three candidates move a 230 KB payload (a 640×480 JPEG) from a client process to a server
process and a 256-byte result back, both sides on uvloop as in the service:

* ``socket-inline``: the payload inside a length-prefixed frame on a Unix stream socket
  (the server reads it straight into a fresh buffer with ``asyncio.BufferedProtocol``);
* ``shm-ring``: the client copies the payload into a shared-memory ring (an mmap'd file in
  /dev/shm) and sends a 24-byte descriptor on the socket; the server reads it in place;
* ``zmq-ipc``: pyzmq DEALER → ROUTER over ``ipc://`` with zero-copy sends (skipped when
  pyzmq is not installed).

The server "consumes" each payload the way the inference worker does (``bytes(view)``, the
copy ``Detector.prepare`` makes). Reported per candidate: round-trip latency with one message
in flight, and with ``--inflight`` in flight: messages/s and the CPU time each side spends
per message — the server's is what matters, since one inference worker serves every HTTP
worker.

    python bench/ipc_roundtrip.py --out bench/results/<date>-ipc-roundtrip-<machine>.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import mmap
import multiprocessing
import os
import resource
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import machine_info, versions  # noqa: E402

HEADER = struct.Struct("<IQ")  # payload length, message id
DESCRIPTOR = struct.Struct("<QQI")  # message id, ring offset, length
RESULT = bytes(256)
RING_BYTES = 64 * 1024 * 1024


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _loop() -> asyncio.AbstractEventLoop:
    import uvloop

    return uvloop.new_event_loop()


# ----------------------------------------------------------------------------- servers
def _big_buffers(transport) -> None:
    """Socket buffers that hold whole payloads (as far as net.core.[rw]mem_max allow)."""
    import socket

    sock = transport.get_extra_info("socket")
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)


class InlineServer(asyncio.BufferedProtocol):
    """Frames: header, then the payload read straight into its own buffer."""

    def __init__(self, stats: dict) -> None:
        self.stats = stats
        self.header = bytearray(HEADER.size)
        self.view = memoryview(self.header)
        self.filled = 0
        self.payload: bytearray | None = None
        self.msg_id = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        _big_buffers(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled < len(self.view):
            return
        if self.payload is None:
            length, self.msg_id = HEADER.unpack(self.header)
            self.payload = bytearray(length)
            self.view, self.filled = memoryview(self.payload), 0
            return
        consumed = bytes(self.payload)  # what Detector.prepare does with its input
        self.stats["n"] += 1
        self.stats["bytes"] += len(consumed)
        self.transport.write(HEADER.pack(len(RESULT), self.msg_id) + RESULT)
        self.payload, self.view, self.filled = None, memoryview(self.header), 0


class RingServer(asyncio.Protocol):
    """Descriptors on the socket; payloads read in place from the client's ring."""

    def __init__(self, stats: dict, ring_path: str) -> None:
        self.stats = stats
        fd = os.open(ring_path, os.O_RDONLY)
        self.ring = memoryview(mmap.mmap(fd, RING_BYTES, prot=mmap.PROT_READ))
        os.close(fd)
        self.buf = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        n = len(self.buf) // DESCRIPTOR.size
        out = []
        for i in range(n):
            msg_id, offset, length = DESCRIPTOR.unpack_from(self.buf, i * DESCRIPTOR.size)
            consumed = bytes(self.ring[offset : offset + length])
            self.stats["n"] += 1
            self.stats["bytes"] += len(consumed)
            out.append(HEADER.pack(len(RESULT), msg_id) + RESULT)
        del self.buf[: n * DESCRIPTOR.size]
        if out:
            self.transport.write(b"".join(out))


def server_main(kind: str, address: str, ring_path: str, conn) -> None:
    stats = {"n": 0, "bytes": 0}
    loop = _loop()
    asyncio.set_event_loop(loop)

    async def run() -> None:
        if kind == "zmq-ipc":
            import zmq
            import zmq.asyncio

            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.bind(address)
            conn.send("ready")

            async def serve() -> None:
                while True:
                    ident, msg_id, payload = await sock.recv_multipart(copy=False)
                    consumed = bytes(payload.buffer)
                    stats["n"] += 1
                    stats["bytes"] += len(consumed)
                    await sock.send_multipart([ident, msg_id, RESULT], copy=False)

            task = asyncio.ensure_future(serve())
        else:
            factory = (lambda: InlineServer(stats)) if kind == "socket-inline" else (lambda: RingServer(stats, ring_path))
            server = await loop.create_unix_server(factory, address)
            conn.send("ready")
        while True:  # commands from the parent: "mark" (reset the counters), "stop"
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd == "mark":
                stats.update(n=0, bytes=0, cpu0=cpu_seconds())
                conn.send("ok")
            else:
                conn.send({"n": stats["n"], "cpu_s": cpu_seconds() - stats.get("cpu0", 0.0)})
                break
        if kind == "zmq-ipc":
            task.cancel()
        else:
            server.close()

    loop.run_until_complete(run())


# ----------------------------------------------------------------------------- client
class Ring:
    """The client's bump allocator over the ring (messages are freed in order here)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, RING_BYTES)
        self.map = memoryview(mmap.mmap(fd, RING_BYTES))
        os.close(fd)
        self.head = 0

    def put(self, payload: bytes) -> int:
        if self.head + len(payload) > RING_BYTES:
            self.head = 0
        offset = self.head
        self.map[offset : offset + len(payload)] = payload
        self.head += len(payload)
        return offset


class ClientProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiting: dict[int, asyncio.Future] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        pos = 0
        while len(self.buf) - pos >= HEADER.size:
            length, msg_id = HEADER.unpack_from(self.buf, pos)
            if len(self.buf) - pos - HEADER.size < length:
                break
            pos += HEADER.size + length
            self.waiting.pop(msg_id).set_result(None)
        del self.buf[:pos]


async def client_run(kind: str, address: str, ring_path: str, payload: bytes, inflight: int, seconds: float,
                     conn) -> dict:
    loop = asyncio.get_running_loop()
    ids = iter(range(1 << 62))
    if kind == "zmq-ipc":
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        waiting: dict[int, asyncio.Future] = {}

        async def receiver() -> None:
            while True:
                msg_id, _ = await sock.recv_multipart()
                waiting.pop(int.from_bytes(msg_id, "little")).set_result(None)

        recv_task = asyncio.ensure_future(receiver())

        async def one() -> None:
            msg_id = next(ids)
            fut = loop.create_future()
            waiting[msg_id] = fut
            await sock.send_multipart([msg_id.to_bytes(8, "little"), payload], copy=False)
            await fut
    else:
        transport, proto = await loop.create_unix_connection(ClientProtocol, address)
        _big_buffers(transport)
        ring = Ring(ring_path) if kind == "shm-ring" else None

        async def one() -> None:
            msg_id = next(ids)
            fut = loop.create_future()
            proto.waiting[msg_id] = fut
            if ring is None:
                proto.transport.writelines([HEADER.pack(len(payload), msg_id), payload])
            else:
                proto.transport.write(DESCRIPTOR.pack(msg_id, ring.put(payload), len(payload)))
            await fut

    # latency: one in flight
    for _ in range(200):
        await one()
    lat = []
    for _ in range(2000):
        t0 = time.perf_counter()
        await one()
        lat.append(time.perf_counter() - t0)
    lat.sort()
    # throughput: `inflight` in flight for `seconds`
    await loop.run_in_executor(None, lambda: (conn.send("mark"), conn.recv()))
    stop = time.perf_counter() + seconds
    done = 0
    cpu0, t0 = cpu_seconds(), time.perf_counter()

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await one()
            done += 1

    await asyncio.gather(*(worker() for _ in range(inflight)))
    wall, client_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    server = await loop.run_in_executor(None, lambda: (conn.send("stop"), conn.recv())[1])
    if kind == "zmq-ipc":
        recv_task.cancel()
    us = lambda v: round(v * 1e6, 1)
    return {
        "rtt_p50_us": us(lat[len(lat) // 2]), "rtt_p99_us": us(lat[int(len(lat) * 0.99)]),
        "msgs_per_s": round(done / wall), "mb_per_s": round(done * len(payload) / wall / 1e6),
        "server_cpu_us_per_msg": us(server["cpu_s"] / max(server["n"], 1)),
        "client_cpu_us_per_msg": us(client_cpu / max(done, 1)),
    }


def measure(kind: str, payload: bytes, inflight: int, seconds: float) -> dict:
    tmp = tempfile.mkdtemp(prefix="ipc-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    sock_path, ring_path = os.path.join(tmp, "s.sock"), os.path.join(tmp, "ring")
    address = f"ipc://{sock_path}" if kind == "zmq-ipc" else sock_path
    Ring(ring_path)  # create it before the server maps it
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server_main, args=(kind, address, ring_path, child), daemon=True)
    proc.start()
    assert parent.recv() == "ready"
    loop = _loop()
    try:
        return loop.run_until_complete(client_run(kind, address, ring_path, payload, inflight, seconds, parent))
    finally:
        loop.close()
        proc.join(10)
        for p in (sock_path, ring_path):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(tmp)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--payload-kb", type=int, default=230)
    p.add_argument("--inflight", type=int, default=32)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3, help="each candidate this many times, interleaved")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    payload = os.urandom(args.payload_kb * 1024)
    kinds = ["socket-inline", "shm-ring"]
    try:
        import zmq  # noqa: F401

        kinds.append("zmq-ipc")
    except ImportError:
        print("pyzmq not installed: zmq-ipc skipped")
    rows = []
    for r in range(args.rounds):  # interleaved, so that shared load hits every candidate alike
        for kind in kinds:
            row = {"ipc": kind, "round": r, "payload_bytes": len(payload), "inflight": args.inflight,
                   **measure(kind, payload, args.inflight, args.seconds)}
            print(json.dumps(row))
            rows.append(row)
    result = {
        "benchmark": "ipc_roundtrip",
        "when": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": versions(("uvloop", "pyzmq", "numpy")),
        "note": "client and server processes on the same host, rounds interleaved; server CPU per message "
                "is the cost inside the one inference worker",
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""A response's head and body leave in one write (``app.api.transport``); a head nothing follows
at once still leaves (at the loop's next turn, or before a close), and everything else passes
through as written. The wrapped transport here records its calls; the protocol's lingering
close, on real sockets, is in tests/e2e/test_hostile_http.py."""

from __future__ import annotations

import asyncio

from app.api.transport import ConnectionTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n"


class Recorded:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, parts) -> None:
        self.calls.append(("writelines", [bytes(p) for p in parts]))

    def write_eof(self) -> None:
        self.calls.append(("write_eof",))

    def close(self) -> None:
        self.closing = True
        self.calls.append(("close",))

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True


class Protocol:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lingering = False

    def _close(self, transport: Recorded) -> None:
        transport.close()


def run(steps) -> list[tuple]:
    async def main() -> list[tuple]:
        raw = Recorded()
        transport = ConnectionTransport(raw, Protocol(asyncio.get_running_loop()))
        await steps(transport)
        await asyncio.sleep(0)
        return raw.calls

    return asyncio.run(main())


def test_a_head_and_its_body_leave_in_one_write():
    async def steps(t):
        t.write(HEAD)
        t.write(b"{}")
        t.write(HEAD)
        t.write(b"")  # an empty body (Content-Length: 0)

    assert run(steps) == [("write", HEAD + b"{}"), ("write", HEAD)]


def test_a_large_body_is_written_beside_its_head_not_copied_behind_it():
    big = b"x" * (1 << 20)

    async def steps(t):
        t.write(HEAD)
        t.write(big)

    assert run(steps) == [("writelines", [HEAD, big])]


def test_a_head_alone_leaves_at_the_next_turn_of_the_loop():
    seen = []

    async def steps(t):
        t.write(HEAD)  # a streaming response: its first chunk comes later
        seen.append(list(t._transport.calls))
        await asyncio.sleep(0)
        seen.append(list(t._transport.calls))
        t.write(b"data: 1\n\n")

    assert run(steps) == [("write", HEAD), ("write", b"data: 1\n\n")]
    assert seen == [[], [("write", HEAD)]]


def test_a_head_leaves_before_a_close_or_an_end_of_output():
    async def close(t):
        t.write(HEAD)
        t.close()

    async def eof(t):
        t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        t.write_eof()

    assert run(close) == [("write", HEAD), ("close",)]
    assert run(eof) == [("write", b"HTTP/1.1 100 Continue\r\n\r\n"), ("write_eof",)]


def test_other_writes_pass_through_in_order():
    answer = b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-length: 2\r\n\r\n{}"  # head and body in one

    async def steps(t):
        t.write(answer)
        t.write(memoryview(b"chunk"))
        t.write(b"plain body")

    assert run(steps) == [("write", answer), ("write", b"chunk"), ("write", b"plain body")]

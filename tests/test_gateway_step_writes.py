"""``StepWrites``: the writes of one event-loop step leave as one, in order, and a close
sends what is pending first."""

from __future__ import annotations

import asyncio

from gateway.http_edge import StepWrites


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_writes_of_one_step_leave_as_one() -> None:
    async def main() -> FakeTransport:
        t = FakeTransport()
        w = StepWrites(t, asyncio.get_running_loop())  # type: ignore[arg-type]
        w.write(b"HTTP/1.1 200 OK\r\n\r\n")
        w.write(b"body")
        assert t.writes == []  # not before the step ends
        await asyncio.sleep(0)
        w.write(b"more")
        await asyncio.sleep(0)
        return t

    t = asyncio.run(main())
    assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]


def test_close_sends_pending_writes_first_and_later_writes_are_dropped() -> None:
    async def main() -> FakeTransport:
        t = FakeTransport()
        w = StepWrites(t, asyncio.get_running_loop())  # type: ignore[arg-type]
        w.write(b"408 answer")
        w.close()
        assert t.writes == [b"408 answer"] and t.closed and w.is_closing()
        w.write(b"late")
        await asyncio.sleep(0)
        assert w.get_extra_info("peername") == "info:peername"  # everything else is the transport's
        return t

    assert asyncio.run(main()).writes == [b"408 answer"]


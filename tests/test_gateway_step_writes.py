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



def test_a_held_head_leaves_with_the_next_write_at_once() -> None:
    async def main() -> FakeTransport:
        t = FakeTransport()
        holds = iter([True, False])
        w = StepWrites(t, asyncio.get_running_loop(), lambda: next(holds))  # type: ignore[arg-type]
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        assert t.writes == []
        w.write(b"body")
        assert t.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody"]  # within the step
        w.write(b"more")  # not held: at the end of the step, as before
        assert len(t.writes) == 1
        await asyncio.sleep(0)
        return t

    assert asyncio.run(main()).writes[1:] == [b"more"]


def test_a_held_head_without_a_body_is_sent_by_release_or_close() -> None:
    async def main() -> tuple[FakeTransport, FakeTransport]:
        loop = asyncio.get_running_loop()
        a, b = FakeTransport(), FakeTransport()
        wa = StepWrites(a, loop, lambda: True)  # type: ignore[arg-type]
        wa.write(b"HEAD answer")
        await asyncio.sleep(0)
        assert a.writes == []  # held: nothing scheduled for it
        wa.release()
        wa.release()
        wb = StepWrites(b, loop, lambda: True)  # type: ignore[arg-type]
        wb.write(b"head")
        wb.close()
        return a, b

    a, b = asyncio.run(main())
    assert a.writes == [b"HEAD answer"] and b.writes == [b"head"] and b.closed

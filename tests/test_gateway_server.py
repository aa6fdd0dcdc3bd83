"""The gateway's HTTP protocol: writes of one loop step go out as one send; responses,
keep-alive and streams through a real uvicorn server stay intact."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import uvicorn

from gateway.server import FLUSH_AT_BYTES, CoalescingTransport, GatewayHttpProtocol
from tests.stub_worker import free_port


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


async def test_writes_of_one_step_are_sent_together():
    inner = Recorder()
    t = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(b"")
    t.write(b"body")
    assert inner.writes == [] and t.get_write_buffer_size() == 23
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    t.writelines([b"a", b"b"])
    t.close()  # close sends what is buffered first
    assert inner.writes[-1] == b"ab" and inner.closed
    t.write(b"late")
    await asyncio.sleep(0)
    assert inner.writes[-1] == b"ab"  # nothing is written to a closing transport
    assert t.get_extra_info("peername") == "info:peername"


async def test_large_writes_are_not_held_back():
    inner = Recorder()
    t = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"x" * FLUSH_AT_BYTES)
    assert len(inner.writes) == 1
    await asyncio.sleep(0)
    assert len(inner.writes) == 1


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await receive()
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": f"part{i};".encode(), "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"end", "more_body": False})
        return
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def test_responses_through_uvicorn():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on",
                                           loop="asyncio", http=GatewayHttpProtocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            for i in range(20):  # one keep-alive connection
                r = c.get(f"/r{i}")
                assert r.status_code == 200 and r.text == f"/r{i}"
            r = c.get("/stream")
            assert r.text == "part0;part1;part2;end"
            r = c.get("/last", headers={"connection": "close"})
            assert r.text == "/last"
    finally:
        server.should_exit = True
        thread.join(10)

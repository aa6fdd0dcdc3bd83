"""The gateway's HTTP/1.1 keep-alive transport: bodies by length and chunked, connection reuse,
stale keep-alive retry, early close drops the connection, errors as httpx exceptions."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from gateway.transport import H11Transport
from loraplex.settings import DEV_WORKER_SECRET
from loraplex.wire import HDR_WORKER_SECRET
from tests.stub_worker import StubProcess, free_port

SECRET_LINE = f"{HDR_WORKER_SECRET}: {DEV_WORKER_SECRET}\r\n".encode()
"""The stub worker refuses requests without the worker secret, as a real one does."""


class RawServer:
    """A tiny HTTP/1.1 server on loopback whose behaviour each test scripts."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.port = free_port()
        self.connections = 0
        self.closed = 0

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed += 1
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc):
        self.server.close()


async def _read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


@pytest.fixture(scope="module")
def stub():
    with StubProcess("t1", extra=("--chunks", "4")) as p:
        yield p


async def test_json_and_sse_through_httpx_client(stub):
    t = H11Transport()
    async with httpx.AsyncClient(transport=t, headers={HDR_WORKER_SECRET: DEV_WORKER_SECRET}) as c:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(3):
            r = await c.post(stub.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert len(t._idle[("127.0.0.1", stub.port)]) == 1  # one connection, reused
        async with c.stream("POST", stub.url + "/v1/chat/completions", json=body | {"stream": True}) as r:
            chunks = [ch async for ch in r.aiter_bytes()]
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
        assert len(chunks) >= 2  # streamed chunk by chunk, not buffered
        r = await c.get(stub.url + "/stub/stats")
        assert r.json()["worker_id"] == "t1"


async def test_fast_post_path(stub):
    t = H11Transport()
    payload = orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 2})
    resp = await t.post("127.0.0.1", stub.port, "/v1/completions", b"content-type: application/json\r\n" + SECRET_LINE, payload)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    data = b"".join([c async for c in resp.aiter_bytes()])
    await resp.aclose()
    assert orjson.loads(data)["usage"]["completion_tokens"] == 2
    await t.aclose()


async def test_stale_keepalive_is_retried_on_a_fresh_connection():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        # keep-alive announced, but the server drops the idle connection right away

    async with RawServer(handler) as srv:
        t = H11Transport()
        for _ in range(3):
            resp = await t.post("127.0.0.1", srv.port, "/", b"", b"{}")
            assert b"".join([c async for c in resp.aiter_bytes()]) == b"ok"
            await resp.aclose()
            await asyncio.sleep(0.05)
        assert srv.connections == 3
        await t.aclose()


async def test_early_close_drops_the_connection_so_the_server_sees_it():
    seen_eof = asyncio.Event()

    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        if not await reader.read(1):
            seen_eof.set()

    async with RawServer(handler) as srv:
        t = H11Transport()
        resp = await t.post("127.0.0.1", srv.port, "/", b"", b"{}")
        it = resp.aiter_bytes()
        assert await it.__anext__() == b"hello"
        await resp.aclose()  # before the end of the body
        await asyncio.wait_for(seen_eof.wait(), 2)
        assert not t._idle.get(("127.0.0.1", srv.port))


async def test_errors_are_httpx_exceptions():
    t = H11Transport(connect_timeout=0.5)
    with pytest.raises(httpx.ConnectError):
        await t.post("127.0.0.1", free_port(), "/", b"", b"{}")

    async def broken(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async with RawServer(broken) as srv:
        resp = await t.post("127.0.0.1", srv.port, "/", b"", b"{}")
        with pytest.raises(httpx.HTTPError):
            _ = [c async for c in resp.aiter_bytes()]
        await resp.aclose()

    async def garbage(reader, writer):
        await _read_request(reader)
        writer.write(b"NOT HTTP\r\n\r\n")
        await writer.drain()

    async with RawServer(garbage) as srv:
        with pytest.raises(httpx.RemoteProtocolError):
            await t.post("127.0.0.1", srv.port, "/", b"", b"{}")


async def test_aread_reads_whole_bodies_and_keeps_the_connection():
    async def handler(reader, writer):
        for body, chunked in ((b'{"a":1}', False), (b"chunked body", True)):
            await _read_request(reader)
            if chunked:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\nchunked\r\n5\r\n body\r\n"
                             b"0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")  # then the connection drops
        await writer.drain()

    async with RawServer(handler) as srv:
        t = H11Transport()
        for expected in (b'{"a":1}', b"chunked body"):
            resp = await t.post("127.0.0.1", srv.port, "/", b"", b"{}")
            assert await resp.aread() == expected
            await resp.aclose()
        resp = await t.post("127.0.0.1", srv.port, "/", b"", b"{}")
        with pytest.raises(httpx.ReadError):
            await resp.aread()
        await resp.aclose()
        assert srv.connections == 1  # both complete answers left the connection reusable
        await t.aclose()


def test_response_heads_are_searched_for_framing_and_parsed_on_demand():
    class Conn:
        closed = False

        def close(self) -> None:
            self.closed = True

    t = H11Transport()
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-A: 1\r\nTransfer-Encoding: chunked\r\n"
            b"x-a: 2\r\nConnection: keep-alive, close\r\n\r\n")
    r = t._response(("h", 1), Conn(), head)  # type: ignore[arg-type]
    body = r._stream
    assert r.status_code == 200 and r.content_type == "text/event-stream"
    assert body.chunked and body.length is None and not body.keep_alive
    assert r.headers == {"content-type": "text/event-stream", "x-a": "2", "transfer-encoding": "chunked",
                         "connection": "keep-alive, close"}
    assert r.raw_headers[1:2] == [(b"x-a", b"1")]
    r = t._response(("h", 1), Conn(), b"HTTP/1.0 404 Not Found\r\ncontent-length: 3\r\nContent-Length: 5\r\n\r\n")
    assert (r.status_code, r.content_type, r._stream.length, r._stream.keep_alive) == (404, None, 5, False)
    r = t._response(("h", 1), Conn(), b"HTTP/1.0 204 No Content\r\nconnection: Keep-Alive\r\n\r\n")
    assert r._stream.length == 0 and r._stream.keep_alive
    conn = Conn()
    with pytest.raises(httpx.RemoteProtocolError):
        t._response(("h", 1), conn, b"SPDY/3 200 OK\r\n\r\n")  # type: ignore[arg-type]
    assert conn.closed

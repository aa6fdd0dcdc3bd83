"""The gateway's client to its workers: the secret and request id on every call, bodies whole
and chunk by chunk, connection reuse, a stale keep-alive retried on a fresh connection, an early
close that the worker sees, and failures as ``WorkerUnreachable`` / ``WorkerBroke`` only."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.worker_client import WorkerBroke, WorkerClient, WorkerUnreachable
from loraplex.settings import DEV_WORKER_SECRET
from loraplex.wire import HDR_REQUEST_ID, HDR_WORKER_SECRET
from tests.stub_worker import StubProcess, free_port


class RawServer:
    """A tiny HTTP/1.1 server on loopback whose behaviour each test scripts."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.heads: list[bytes] = []

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return await reader.readexactly(length)

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc):
        self.server.close()


@pytest.fixture(scope="module")
def stub():
    with StubProcess("t1", extra=("--chunks", "4")) as p:
        yield p


async def test_json_and_sse_from_a_worker(stub):
    client = WorkerClient(DEV_WORKER_SECRET)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    try:
        for _ in range(3):
            r = await client.post(stub.url + "/v1/chat/completions", orjson.dumps(body), "rid-1")
            assert r.status == 200 and r.content_type == "application/json"
            assert orjson.loads(await r.read())["usage"]["completion_tokens"] == 3
            r.close()
        r = await client.post(stub.url + "/v1/chat/completions", orjson.dumps(body | {"stream": True, "metadata": {"stub_chunk_delay": "0.05"}}), "rid-2")
        assert r.content_type.startswith("text/event-stream")
        chunks = [c async for c in r.chunks()]
        r.close()
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
        assert len(chunks) >= 3  # passed on as it arrives, not buffered
        status, raw = await client.call("GET", stub.url + "/stub/stats")
        assert status == 200 and orjson.loads(raw)["worker_id"] == "t1"  # the secret went along
    finally:
        await client.close()


async def test_secret_and_request_id_on_every_call_one_connection_reused():
    async def handler(srv, reader, writer):
        while True:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with RawServer(handler) as srv:
        client = WorkerClient("s3cret")
        for i in range(3):
            r = await client.post(srv.url + "/v1/completions", b"{}", f"req-{i}")
            assert await r.read() == b"ok"
            r.close()
        assert await client.call("GET", srv.url + "/internal/tokenizer") == (200, b"ok")
        await client.close()
    assert srv.connections == 1
    assert len(srv.heads) == 4
    for i, head in enumerate(srv.heads):
        low = head.lower()
        assert f"{HDR_WORKER_SECRET}: s3cret".encode() in low
        if i < 3:
            assert f"{HDR_REQUEST_ID}: req-{i}".encode() in low


def test_a_secret_that_would_split_headers_is_refused():
    with pytest.raises(ValueError, match="line breaks"):
        WorkerClient("s\r\nx-evil: 1")


async def test_stale_keepalive_is_retried_on_a_fresh_connection():
    async def handler(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        # keep-alive announced, but the next request on it gets the connection closed unanswered
        await srv.read_request(reader)

    async with RawServer(handler) as srv:
        client = WorkerClient(DEV_WORKER_SECRET)
        for _ in range(3):
            r = await client.post(srv.url + "/", b"{}", "r")
            assert await r.read() == b"ok"
            r.close()
        await client.close()
    assert srv.connections >= 3


async def test_early_close_drops_the_connection_so_the_worker_sees_it():
    seen_eof = asyncio.Event()

    async def handler(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        if not await reader.read(1):
            seen_eof.set()

    async with RawServer(handler) as srv:
        client = WorkerClient(DEV_WORKER_SECRET)
        r = await client.post(srv.url + "/", b"{}", "r")
        it = r.chunks()
        assert await it.__anext__() == b"hello"
        r.close()  # before the end of the body
        await asyncio.wait_for(seen_eof.wait(), 2)
        await client.close()


async def test_failures_are_unreachable_or_broke():
    client = WorkerClient(DEV_WORKER_SECRET, connect_timeout_s=0.5)
    with pytest.raises(WorkerUnreachable):
        await client.post(f"http://127.0.0.1:{free_port()}/", b"{}", "r")

    async def broken(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async with RawServer(broken) as srv:
        r = await client.post(srv.url + "/", b"{}", "r")
        with pytest.raises(WorkerBroke):
            _ = [c async for c in r.chunks()]
        r.close()
        r = await client.post(srv.url + "/", b"{}", "r")
        with pytest.raises(WorkerBroke):
            await r.read()
        r.close()

    async def garbage(srv, reader, writer):
        await srv.read_request(reader)
        writer.write(b"NOT HTTP\r\n\r\n")
        await writer.drain()

    async with RawServer(garbage) as srv:
        with pytest.raises(WorkerBroke):
            await client.post(srv.url + "/", b"{}", "r")
    await client.close()


async def test_a_control_call_that_gets_no_answer_times_out_as_broke():
    async def silent(srv, reader, writer):
        await srv.read_request(reader)
        await asyncio.sleep(10)

    client = WorkerClient(DEV_WORKER_SECRET)
    try:
        async with RawServer(silent) as srv:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(WorkerBroke, match=r"no answer within 0\.3 s"):
                await client.call("GET", srv.url + "/probe", timeout_s=0.3)
            assert loop.time() - t0 < 5.0 and len(srv.heads) == 1
    finally:
        await client.close()

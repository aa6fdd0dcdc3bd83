"""The gateway's HTTP/1.1 server protocol under a real uvicorn server, spoken to over raw
sockets: framing, keep-alive, pipelining, flow control, disconnects, errors, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.server import MAX_HEAD_BYTES, GatewayHttpProtocol, _Exchange
from tests.stub_worker import free_port


class Events:
    """What the test app saw (shared with the server thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.messages: dict[str, list[dict[str, Any]]] = {}
        self.disconnected = threading.Event()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    ev: Events = app.events  # type: ignore[attr-defined]
    with ev.lock:
        ev.running += 1
        ev.max_running = max(ev.max_running, ev.running)
    try:
        await _route(scope, receive, send, ev)
    finally:
        with ev.lock:
            ev.running -= 1


async def _read_all(receive: Any) -> tuple[bytes, list[dict[str, Any]]]:
    parts, msgs = [], []
    while True:
        msg = await receive()
        msgs.append(msg)
        parts.append(msg.get("body", b""))
        if msg["type"] != "http.request" or not msg.get("more_body"):
            return b"".join(parts), msgs


async def _plain(send: Any, body: bytes, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"Content-Type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _route(scope: dict[str, Any], receive: Any, send: Any, ev: Events) -> None:
    path = scope["path"]
    if path == "/echo":
        body, msgs = await _read_all(receive)
        ev.messages[scope["query_string"].decode()] = msgs
        info = f"{scope['method']} {scope['http_version']} {scope['raw_path'].decode()} {scope['query_string'].decode()}"
        await _plain(send, info.encode() + b"|" + body)
    elif path == "/slow":
        await receive()
        await asyncio.sleep(float(scope["query_string"] or 0.05))
        await _plain(send, b"slow")
    elif path == "/stream":
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": f"part{i};".encode(), "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await send({"type": "http.response.body", "body": b"end", "more_body": False})
    elif path == "/refuse":  # answers without reading the body (a 413, say)
        await _plain(send, b"too large", status=413)
    elif path == "/hang":  # waits for its client to go away
        await receive()
        msg = await receive()
        if msg["type"] == "http.disconnect":
            ev.disconnected.set()
    elif path == "/raise":
        await receive()
        raise RuntimeError("boom")
    elif path == "/raise-late":
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"12345", "more_body": True})
        raise RuntimeError("boom")
    elif path == "/nothing":
        await receive()
    elif path == "/bad-header":
        await receive()
        await _plain(send, b"x", headers=[(b"x-evil", b"a\r\nset-cookie: 1")])
    elif path == "/after":  # the request is answered, the app goes on and then reads once more
        await receive()
        await _plain(send, b"done")
        msg = await receive()
        ev.messages["after"] = [msg]
    else:
        await receive()
        await _plain(send, path.encode(), headers=[(b"X-Custom", b"v")])


class Served:
    def __init__(self, port: int, events: Events, server: uvicorn.Server) -> None:
        self.port = port
        self.events = events
        self.server = server


@contextlib.contextmanager
def serve(loop: str = "uvloop", **config: Any) -> Iterator[Served]:
    port = free_port()
    app.events = Events()  # type: ignore[attr-defined]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="on",
                                           loop=loop, http=GatewayHttpProtocol, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield Served(port, app.events, server)  # type: ignore[attr-defined]
    finally:
        server.should_exit = True
        thread.join(10)


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


class Reader:
    """Reads HTTP/1.1 responses off a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            if not self._more():
                raise EOFError(self.buf)
        out, self.buf = self.buf.split(sep, 1)
        return out

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._more():
                raise EOFError(self.buf)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        lines = self._until(b"\r\n\r\n").decode().split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            assert name == name.lower(), name
            headers[name] = value.strip()
        if head_only or status in (100, 204, 304):
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, self._exactly(int(headers["content-length"]))
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int(self._until(b"\r\n"), 16)
                chunk = self._exactly(size + 2)
                if size == 0:
                    return status, headers, body
                body += chunk[:-2]
        while self._more():  # delimited by the end of the connection
            pass
        body, self.buf = self.buf, b""
        return status, headers, body

    def closed(self) -> bool:
        """True when the server closed the connection (EOF after anything left over)."""
        try:
            return not self._more() and not self.buf
        except ConnectionResetError:
            return True


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            version: str = "1.1") -> bytes:
    h = {"host": "test", **({"content-length": str(len(body))} if body or method == "POST" else {}),
         **(headers or {})}
    return (f"{method} {path} HTTP/{version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items())
            + "\r\n").encode() + body


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_keep_alive_framing_and_streams(loop):
    with serve(loop) as srv, connect(srv.port) as s:
        r = Reader(s)
        for i in range(5):
            s.sendall(request("GET", f"/r{i}"))
            status, headers, body = r.response()
            assert (status, body) == (200, f"/r{i}".encode())
            assert headers["x-custom"] == "v" and headers["content-type"] == "text/plain"
            assert "connection" not in headers and "date" in headers
        s.sendall(request("POST", "/echo?q=1", b"hello"))
        assert r.response()[2] == b"POST 1.1 /echo q=1|hello"
        s.sendall(request("GET", "/stream"))
        status, headers, body = r.response()
        assert headers["transfer-encoding"] == "chunked" and body == b"part0;part1;part2;end"
        s.sendall(request("HEAD", "/head"))
        status, headers, body = r.response(head_only=True)
        assert status == 200 and headers["content-length"] == "5" and body == b""
        s.sendall(request("GET", "/last", headers={"connection": "close"}))
        status, headers, body = r.response()
        assert body == b"/last" and headers["connection"] == "close"
        assert r.closed()


def test_paths_are_decoded_and_raw_paths_kept():
    with serve() as srv, connect(srv.port) as s:
        r = Reader(s)
        s.sendall(request("POST", "/echo?a=%20b", b"x"))
        assert r.response()[2] == b"POST 1.1 /echo a=%20b|x"
        s.sendall(request("POST", "/ec%68o", b"y"))  # %68 = h
        assert r.response()[2] == b"POST 1.1 /ec%68o |y"
        s.sendall(request("POST", "http://test/echo?z", b"z"))  # absolute form
        assert r.response()[2] == b"POST 1.1 /echo z|z"


def test_http_1_0_closes_and_length_less_body_ends_with_the_connection():
    with serve() as srv:
        with connect(srv.port) as s:
            s.sendall(request("GET", "/x", version="1.0"))
            r = Reader(s)
            _, headers, body = r.response()
            assert body == b"/x" and headers["connection"] == "close"
            assert r.closed()
        with connect(srv.port) as s:  # HTTP/1.0 cannot read chunked: the body runs to the end of the connection
            s.sendall(request("GET", "/stream", version="1.0"))
            _, headers, body = Reader(s).response()
            assert "transfer-encoding" not in headers and body == b"part0;part1;part2;end"


def test_pipelined_requests_are_answered_in_order_one_at_a_time():
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("GET", "/slow") + request("POST", "/echo?p", b"abc") + request("GET", "/slow")
                  + request("GET", "/z"))
        r = Reader(s)
        assert [r.response()[2] for _ in range(4)] == [b"slow", b"POST 1.1 /echo p|abc", b"slow", b"/z"]
        assert srv.events.max_running == 1


def test_request_body_in_parts_and_over_the_buffer_limit():
    big = bytes(range(256)) * 1024  # 256 KiB: reading pauses until the app asks for more
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("POST", "/echo?big", big))
        r = Reader(s)
        status, _, body = r.response()
        assert status == 200 and body == b"POST 1.1 /echo big|" + big
        assert len(srv.events.messages["big"]) >= 2 and not srv.events.messages["big"][-1]["more_body"]
        chunked = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        s.sendall(b"POST /echo?chunked HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n" + chunked)
        assert r.response()[2] == b"POST 1.1 /echo chunked|hello world"


def test_expect_100_continue():
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("POST", "/echo?e", headers={"content-length": "4", "expect": "100-continue"}))
        r = Reader(s)
        assert r.response()[0] == 100
        s.sendall(b"body")
        assert r.response()[2] == b"POST 1.1 /echo e|body"


def test_answer_before_the_body_was_read_closes_the_connection():
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("POST", "/refuse", headers={"content-length": "100000"}) + b"x" * 1000)
        r = Reader(s)
        status, headers, body = r.response()
        assert (status, body, headers["connection"]) == (413, b"too large", "close")
        assert r.closed()


def test_a_client_that_goes_away_is_reported_to_its_request():
    with serve() as srv:
        s = connect(srv.port)
        s.sendall(request("GET", "/hang"))
        time.sleep(0.1)
        s.close()
        assert srv.events.disconnected.wait(5)


def test_receive_after_the_response_reports_a_disconnect():
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("GET", "/after"))
        r = Reader(s)
        assert r.response()[2] == b"done"
        deadline = time.monotonic() + 5
        while "after" not in srv.events.messages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.events.messages["after"] == [{"type": "http.disconnect"}]
        s.sendall(request("GET", "/again"))  # the connection is still good
        assert r.response()[2] == b"/again"


@pytest.mark.parametrize("path", ["/raise", "/nothing", "/bad-header"])
def test_app_failures_before_the_response_answer_500(path):
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("GET", path))
        r = Reader(s)
        status, headers, body = r.response()
        assert (status, body, headers["connection"]) == (500, b"Internal Server Error", "close")
        assert r.closed()


def test_app_failure_mid_response_cuts_the_connection():
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("GET", "/raise-late"))
        r = Reader(s)
        with pytest.raises(EOFError):
            r.response()


def test_malformed_requests_and_oversized_heads_are_refused():
    with serve() as srv:
        with connect(srv.port) as s:
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            r = Reader(s)
            assert r.response()[0] == 400 and r.closed()
        with connect(srv.port) as s:
            s.sendall(request("GET", "/x", headers={"x-big": "a" * MAX_HEAD_BYTES}))
            r = Reader(s)
            assert r.response()[0] == 431 and r.closed()


def test_idle_connections_are_closed_after_the_keep_alive_timeout():
    with serve(timeout_keep_alive=0.3) as srv, connect(srv.port) as s:
        r = Reader(s)
        for _ in range(3):  # activity keeps it open past the timeout
            s.sendall(request("GET", "/x"))
            assert r.response()[2] == b"/x"
            time.sleep(0.2)
        t0 = time.monotonic()
        assert r.closed()
        assert time.monotonic() - t0 < 2


def test_graceful_shutdown_finishes_the_running_request():
    with serve() as srv:
        busy, idle = connect(srv.port), connect(srv.port)
        with busy, idle:
            idle.sendall(request("GET", "/x"))
            assert Reader(idle).response()[2] == b"/x"
            busy.sendall(request("GET", "/slow?0.5"))
            time.sleep(0.01)
            srv.server.should_exit = True  # seen by the server within 0.1 s
            r = Reader(busy)
            _, headers, body = r.response()
            assert body == b"slow" and headers.get("connection") == "close"
            assert r.closed() and Reader(idle).closed()


def test_through_httpx():
    with serve() as srv, httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=10) as c:
        for i in range(20):
            assert c.get(f"/r{i}").text == f"/r{i}"
        assert c.post("/echo", content=b"q").text == "POST 1.1 /echo |q"
        with c.stream("GET", "/stream") as resp:
            assert b"".join(resp.iter_raw()) == b"part0;part1;part2;end"


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _protocol() -> tuple[GatewayHttpProtocol, FakeTransport]:
    config = uvicorn.Config(app, http=GatewayHttpProtocol)
    state = uvicorn.server.ServerState()
    proto = GatewayHttpProtocol(config, state, {}, _loop=asyncio.get_running_loop())
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    return proto, transport


async def test_send_waits_while_the_transport_is_full_and_one_step_is_one_write():
    proto, transport = _protocol()
    scope = {"method": "GET", "http_version": "1.1"}
    ex = _Exchange(proto, scope, keep_alive=True, expect_100=False)
    ex.more_body = False
    proto.exchange = ex
    await ex.send({"type": "http.response.start", "status": 200, "headers": []})
    await ex.send({"type": "http.response.body", "body": b"a", "more_body": True})
    assert transport.writes == []
    await asyncio.sleep(0)
    assert transport.writes == [ex.head + b"1\r\na\r\n"]  # head and first part in one write
    proto.pause_writing()
    sending = asyncio.ensure_future(ex.send({"type": "http.response.body", "body": b"b", "more_body": False}))
    await asyncio.sleep(0.01)
    assert not sending.done() and len(transport.writes) == 1
    proto.resume_writing()
    await sending
    assert transport.writes[-1] == b"1\r\nb\r\n0\r\n\r\n" and ex.complete and proto.exchange is None
    with pytest.raises(RuntimeError):
        await ex.send({"type": "http.response.body", "body": b""})
    proto.connection_lost(None)
    assert transport.closed


async def test_content_length_is_enforced():
    proto, _ = _protocol()
    ex = _Exchange(proto, {"method": "GET", "http_version": "1.1"}, keep_alive=True, expect_100=False)
    ex.more_body = False
    await ex.send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    with pytest.raises(RuntimeError, match="longer"):
        await ex.send({"type": "http.response.body", "body": b"abc"})
    ex = _Exchange(proto, {"method": "GET", "http_version": "1.1"}, keep_alive=True, expect_100=False)
    ex.more_body = False
    await ex.send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    with pytest.raises(RuntimeError, match="shorter"):
        await ex.send({"type": "http.response.body", "body": b"a"})

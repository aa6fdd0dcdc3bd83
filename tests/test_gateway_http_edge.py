"""The gateway's HTTP edge (uvicorn's httptools protocol with ``EdgeProtocol``'s deadlines)
under a real uvicorn server, spoken to over raw sockets: framing, keep-alive, pipelining,
flow control, disconnects, malformed input, head/body deadlines, shutdown; and the
internal metrics port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.http_edge import MAX_HEAD_BYTES, gateway_config
from loraplex.settings import Settings
from tests.stub_worker import free_port
from tests.worker_double import worker_client


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
    """``app`` served as the gateway's public port; ``config``: settings fields or uvicorn options."""
    port = free_port()
    app.events = Events()  # type: ignore[attr-defined]
    fields = {k: config.pop(k) for k in list(config) if k.startswith("gateway_")}
    settings = Settings(gateway_host="127.0.0.1", gateway_port=port, **fields)
    server = uvicorn.Server(gateway_config(app, settings, log_level="critical", loop=loop, **config))
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
        with connect(srv.port) as s:
            s.sendall(request("GET", "/stream", version="1.0"))
            r = Reader(s)
            _, headers, body = r.response()
            assert body == b"part0;part1;part2;end" and headers["connection"] == "close"
            assert r.closed()


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


def test_answer_before_the_body_was_read_skips_the_rest_of_it():
    with serve(gateway_body_timeout_s=0.5) as srv:
        with connect(srv.port) as s:
            s.sendall(request("POST", "/refuse", headers={"content-length": "3000"}) + b"x" * 1000)
            r = Reader(s)
            assert r.response()[:1] == (413,)
            s.sendall(b"x" * 2000 + request("GET", "/next"))  # the rest is read past, not taken for a request
            assert r.response()[2] == b"/next"
        with connect(srv.port) as s:  # the rest never comes: closed at the body deadline, nothing more sent
            s.sendall(request("POST", "/refuse", headers={"content-length": "3000"}) + b"x" * 1000)
            r = Reader(s)
            assert r.response()[0] == 413
            t0 = time.monotonic()
            assert r.closed() and time.monotonic() - t0 < 3


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


@pytest.mark.parametrize("path", ["/raise", "/nothing"])
def test_app_failures_before_the_response_answer_500(path):
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("GET", path))
        r = Reader(s)
        status, headers, body = r.response()
        assert (status, body, headers["connection"]) == (500, b"Internal Server Error", "close")
        assert r.closed()


@pytest.mark.parametrize("path", ["/raise-late", "/bad-header"])
def test_app_failure_mid_response_cuts_the_connection(path):
    with serve() as srv, connect(srv.port) as s:
        s.sendall(request("GET", path))
        r = Reader(s)
        with pytest.raises(EOFError):
            r.response()


def _refused(s: socket.socket, status: int, code: str) -> None:
    """The edge answered ``status`` in the OpenAI error shape and closed the connection."""
    r = Reader(s)
    got, headers, body = r.response()
    assert (got, headers["connection"], headers["content-type"]) == (status, "close", "application/json")
    err = json.loads(body)["error"]
    assert err["code"] == code and set(err) == {"message", "type", "code", "param"}
    assert r.closed()


CHUNKED_POST = b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("data", [
    b"NOT HTTP AT ALL\r\n\r\n",
    CHUNKED_POST + b"FFFFFFFFFFFFFFFFFFFF\r\nabc\r\n",  # chunk size overflow
    CHUNKED_POST + b"5\nhello\n0\n\n",  # LF-only chunk lines
    b"POST /echo HTTP/1.1\nhost: t\ncontent-length: 1\n\nx",  # LF-only head
    b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
], ids=["garbage", "chunk-size-overflow", "lf-only-chunks", "lf-only-head", "length-and-chunked",
        "two-lengths"])
def test_malformed_requests_are_400_and_closed(data):
    with serve() as srv, connect(srv.port) as s:
        s.sendall(data)
        _refused(s, 400, "invalid_http")


def test_oversized_heads_are_431():
    with serve() as srv:
        with connect(srv.port) as s:
            s.sendall(request("GET", "/x", headers={"x-big": "a" * MAX_HEAD_BYTES}))
            _refused(s, 431, "head_too_large")
        with connect(srv.port) as s:  # one header line that never ends
            s.sendall(b"GET /x HTTP/1.1\r\nx-endless: ")
            with contextlib.suppress(OSError):
                for _ in range(2 * MAX_HEAD_BYTES // 4096 + 1):
                    s.sendall(b"a" * 4096)
                    time.sleep(0.001)
            _refused(s, 431, "head_too_large")


def test_many_header_lines_over_the_cap_are_431_whether_the_head_ends_or_not():
    lines = "".join(f"x-h{i}: {'v' * 1000}\r\n" for i in range(MAX_HEAD_BYTES // 1000 + 2)).encode()
    with serve(gateway_head_timeout_s=30) as srv:
        with connect(srv.port) as s:  # every line finished, the head too
            s.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n" + lines + b"\r\n")
            _refused(s, 431, "head_too_large")
        with connect(srv.port) as s:  # every line finished, the head never: refused at once all the same
            s.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n" + lines)
            s.settimeout(10)
            _refused(s, 431, "head_too_large")
        with connect(srv.port) as s:  # just under the cap: served
            s.sendall(request("GET", "/fits", headers={"x-big": "a" * (MAX_HEAD_BYTES - 200)}))
            assert Reader(s).response()[0] == 200


def test_half_sent_heads_are_answered_408_and_silent_connections_closed():
    with serve(gateway_head_timeout_s=1.0) as srv:
        half = [connect(srv.port) for _ in range(30)]
        silent = [connect(srv.port) for _ in range(3)]
        t0 = time.monotonic()
        for s in half:
            s.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-le")
        for s in half:
            _refused(s, 408, "request_timeout")
        for s in silent:
            assert Reader(s).closed()
        assert time.monotonic() - t0 < 5
        for s in half + silent:
            s.close()
        with connect(srv.port) as s:  # a head sent slowly but within the deadline is served
            s.sendall(b"GET /slowhead HTTP/1.1\r\n")
            time.sleep(0.2)
            s.sendall(b"host: t\r\n\r\n")
            assert Reader(s).response()[2] == b"/slowhead"


def test_waiting_behind_a_pipelined_request_does_not_count():
    """The deadlines count only time the server is reading: a head or a body queued behind a
    request still being answered (3 s) waits past its deadline (1.5 s) and is still served. The
    deadline is wide enough that the client's own turnaround on a loaded machine never crosses it."""
    with serve(gateway_head_timeout_s=1.5, gateway_body_timeout_s=1.5) as srv:
        with connect(srv.port) as s:
            s.sendall(b"GET /slow?3.0 HTTP/1.1\r\nhost: t\r\n\r\nGET /behind HTTP/1.1\r\nho")
            r = Reader(s)
            assert r.response()[2] == b"slow"
            s.sendall(b"st: t\r\n\r\n")
            assert r.response()[2] == b"/behind"
        with connect(srv.port) as s:
            s.sendall(request("GET", "/slow?2.8") + request("POST", "/echo?queued", headers={"content-length": "6"})
                      + b"abc")
            r = Reader(s)
            assert r.response()[2] == b"slow"
            # The body's deadline starts when the server turns to it (2.8 s), not when its head was
            # queued: the rest arriving 0.5 s later, past the head's time + 2 deadlines, is served.
            time.sleep(0.5)
            s.sendall(b"def")
            assert r.response()[2] == b"POST 1.1 /echo queued|abcdef"


def test_a_body_that_does_not_arrive_in_time_is_408():
    with serve(gateway_body_timeout_s=1.0) as srv:
        with connect(srv.port) as s:
            s.sendall(request("POST", "/echo?slow", headers={"content-length": "10"}) + b"abc")
            _refused(s, 408, "request_timeout")
        with connect(srv.port) as s:  # chunked, trickling: the deadline is for the whole body
            s.sendall(CHUNKED_POST)
            with contextlib.suppress(OSError):
                for _ in range(20):
                    s.sendall(b"1\r\nx\r\n")
                    time.sleep(0.1)
            _refused(s, 408, "request_timeout")
        with connect(srv.port) as s:  # a body within the deadline is served
            s.sendall(request("POST", "/echo?ok", headers={"content-length": "6"}) + b"abc")
            time.sleep(0.2)
            s.sendall(b"def")
            assert Reader(s).response()[2] == b"POST 1.1 /echo ok|abcdef"


def test_idle_connections_are_closed_after_the_keep_alive_timeout():
    with serve(timeout_keep_alive=1.0) as srv, connect(srv.port) as s:
        r = Reader(s)
        for _ in range(6):  # activity keeps it open past the timeout (1.8 s in all)
            s.sendall(request("GET", "/x"))
            assert r.response()[2] == b"/x"
            time.sleep(0.3)
        t0 = time.monotonic()
        assert r.closed()
        assert time.monotonic() - t0 < 3


def test_the_keep_alive_timeout_counts_only_idle_time():
    with serve(timeout_keep_alive=1.0) as srv, connect(srv.port) as s:
        r = Reader(s)
        s.sendall(request("GET", "/x"))  # idle from its answer on: the keep-alive timer is set
        assert r.response()[2] == b"/x"
        s.sendall(request("GET", "/slow?1.6"))  # busy past the timer: it must not close the connection
        assert r.response()[2] == b"slow"
        s.sendall(request("GET", "/y"))
        assert r.response()[2] == b"/y"
        t0 = time.monotonic()
        assert r.closed()
        assert 0.5 <= time.monotonic() - t0 < 3


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


# -- the gateway's two ports, and its shutdown ------------------------------------------------------

TENANTS = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}}}
CHAT = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_metrics_are_served_on_the_internal_port_only():
    from gateway.app import create_app
    from gateway.http_edge import gateway_servers, serve_all
    from gateway.ratelimit import LocalLimiter
    from loraplex.residency import MemoryResidency
    from loraplex.tokens import mint
    from tests.stub_worker import MutableSnapshots, make_snapshot, mock_worker_transport

    settings = Settings(gateway_host="127.0.0.1", gateway_port=free_port(), gateway_metrics_port=free_port(),
                        worker_urls=("http://worker",), gateway_shutdown_grace_s=1.0)
    app = create_app(settings, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), http_client=worker_client(mock_worker_transport()),
                     mount_admin=False)
    servers = gateway_servers(app, settings, log_level="critical")
    thread = threading.Thread(target=asyncio.run, args=(serve_all(servers),), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not all(s.started for s in servers) and time.monotonic() < deadline:
            time.sleep(0.01)
        public = f"http://127.0.0.1:{settings.gateway_port}"
        internal = f"http://127.0.0.1:{settings.gateway_metrics_port}"
        token = mint(settings, "u", tenant="acme")
        r = httpx.post(public + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200
        r = httpx.get(public + "/metrics")  # anonymous, on the public port: nothing there
        assert r.status_code == 404 and "loraplex_gateway" not in r.text and "acme" not in r.text
        r = httpx.get(internal + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert 'loraplex_gateway_requests_total{adapter="sup@1",status="2xx",tenant="acme"} 1.0' in r.text
        assert "loraplex_gateway_inflight" in r.text

        def lag_count() -> float:
            text = httpx.get(internal + "/metrics").text
            return float(next(line.split()[-1] for line in text.splitlines()
                              if line.startswith("loraplex_gateway_event_loop_lag_seconds_count")))

        deadline = time.monotonic() + 10
        while lag_count() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lag_count() >= 1  # the app runs the loop-lag watcher
        assert httpx.get(internal + "/v1/models").status_code == 404  # the metrics port serves metrics only
    finally:
        for s in servers:
            s.should_exit = True
        thread.join(10)
    assert not thread.is_alive()


def _snapshot_file(path: Any) -> str:
    path.write_text(json.dumps({
        "version": 1, "base_models": {"smol": {"revision": "r1"}},
        "adapters": {"sup-v1": {"name": "sup", "version": 1, "base_model": "smol", "uri": "file:///a/sup/1",
                                "sha256": "0" * 64, "rank": 8, "alpha": 16, "status": "ready"}},
        "tenants": {"acme": {"bindings": {"support": {"active": "sup-v1"}}}}}))
    return str(path)


def test_sigterm_drains_then_answers_what_is_still_running(tmp_path):
    """``loraplex gateway`` on SIGTERM: a request that ends within the grace is answered; after it,
    a waiting request gets a JSON 503 and a stream an error event, then the process exits."""
    import os
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from loraplex.tokens import mint
    from tests.stub_worker import StubProcess

    secret = "edge-test-" + "s" * 40
    port, metrics_port = free_port(), free_port()
    worker_secret = "edge-test-worker-" + "w" * 40
    with StubProcess("w1", extra=("--chunks", "5", "--worker-secret", worker_secret)) as stub:
        env = dict(os.environ, LORAPLEX_HOME=str(tmp_path), LORAPLEX_JWT_SECRET=secret,
                   LORAPLEX_WORKER_SECRET=worker_secret, LORAPLEX_REDIS_URL="",
                   LORAPLEX_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path}/registry.db",
                   LORAPLEX_REGISTRY_SNAPSHOT_FILE=_snapshot_file(tmp_path / "snapshot.json"),
                   LORAPLEX_WORKER_URLS=stub.url, LORAPLEX_GATEWAY_HOST="127.0.0.1",
                   LORAPLEX_GATEWAY_PORT=str(port), LORAPLEX_GATEWAY_METRICS_PORT=str(metrics_port),
                   LORAPLEX_GATEWAY_SHUTDOWN_GRACE_S="1.5", LORAPLEX_LOG_LEVEL="WARNING")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        log = open(tmp_path / "gateway.log", "w+")
        gw = subprocess.Popen([sys.executable, "-m", "loraplex_cli", "gateway", "--no-access-log"], cwd=root,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/readyz").status_code == 200:
                        break
                time.sleep(0.1)
            assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").status_code == 200
            h = {"authorization": f"Bearer {mint(Settings(jwt_secret=secret), 'u', tenant='acme')}"}

            def post(body: dict[str, Any]) -> httpx.Response:
                return httpx.post(url + "/v1/chat/completions", json=CHAT | body, headers=h, timeout=30)

            with ThreadPoolExecutor(3) as pool:
                waiting = pool.submit(post, {"metadata": {"stub_delay": "30"}})
                stream = pool.submit(post, {"stream": True, "metadata": {"stub_chunk_delay": "1.5"}})
                time.sleep(2.0)  # the stream's first event is out
                seen = stub.stats()["requests"]
                quick = pool.submit(post, {"metadata": {"stub_delay": "0.5"}})
                deadline = time.monotonic() + 10
                while stub.stats()["requests"] == seen and time.monotonic() < deadline:
                    time.sleep(0.02)  # the quick request has reached the worker before the signal
                t0 = time.monotonic()
                gw.send_signal(signal.SIGTERM)
                assert quick.result().status_code == 200  # finished within the grace
                r = waiting.result()
                cut_after = time.monotonic() - t0
                assert r.status_code == 503 and r.headers["content-type"] == "application/json"
                assert r.json()["error"]["code"] == "shutting_down"
                assert 1.0 < cut_after < 10
                r = stream.result()
                events = [e[len("data: "):] for e in r.text.split("\n\n") if e.startswith("data: ")]
                assert r.status_code == 200 and len(events) >= 2 and "[DONE]" not in events
                assert json.loads(events[-1])["error"]["code"] == "shutting_down"
            gw.wait(15)
            log.seek(0)
            output = log.read()
            assert "Traceback" not in output, output
        finally:
            if gw.poll() is None:
                gw.kill()
                gw.wait(5)
            log.close()

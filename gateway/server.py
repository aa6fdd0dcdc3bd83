"""The gateway's HTTP/1.1 server protocol: a lean ASGI server on httptools, run by uvicorn.

uvicorn's own httptools protocol costs the gateway a good part of its CPU per request,
and on a machine where the clients, the gateway and the workers share a few cores every
microsecond of it is latency. Per request it arms and cancels a keep-alive timer, runs a
regex over every response header name and value, builds a ``RequestResponseCycle`` with
an ``asyncio.Event`` and a wrapper coroutine around the app, and writes a response's
head and body with a send each. ``GatewayHttpProtocol`` keeps uvicorn's server (sockets,
lifespan, signals, graceful shutdown) and replaces only the protocol
(``uvicorn.run(app, http=GatewayHttpProtocol)``), doing the same job with less:

* keep-alive: one timer per connection that, when it fires, closes the connection if it
  has been idle for ``timeout_keep_alive`` and otherwise waits the rest of that time
  again (instead of a timer per response);
* response heads: status lines and the default headers (``date``) pre-encoded; a header
  name is checked and lower-cased once per process (a dict lookup afterwards), the values
  of one response are checked by one regex search over all of them;
* one send per response: a head waits in a buffer that goes out at the end of the
  current loop step or with the last body part, whichever comes first; SSE parts sent in
  one step go out together;
* the app runs as the task itself, with a done-callback for what the wrapper coroutine
  did (500 when no response was started, logging, closing a half-sent response).

It speaks what the gateway needs: Content-Length and chunked responses (a length-less
response to an HTTP/1.0 client is delimited by closing), HEAD, ``Expect: 100-continue``,
keep-alive with pipelined requests served one at a time (reading pauses while one
waits), HTTP/1.0 and ``Connection: close``, flow control both ways (reading pauses
while 64 KiB of request body wait for the app; ``send`` waits while the transport's
buffer is over its high-water mark), ``http.disconnect`` for a request whose client
went away, and uvicorn's graceful shutdown. A response started before the request body
was read to its end (a 413, say) closes the connection after it. Request heads are
limited to ``MAX_HEAD_BYTES`` (431). Not supported (the gateway uses none of them):
WebSocket upgrades (an upgrade request is answered as plain HTTP, then the connection
closes), uvicorn's access log, ``limit_concurrency`` and ``reset_contextvars``.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
import urllib.parse
from collections import deque
from typing import Any

import httptools

log = logging.getLogger("uvicorn.error")

MAX_HEAD_BYTES = 65536
"""Largest request line plus headers accepted (431 beyond)."""
BODY_HIGH_WATER = 65536
"""Request body bytes buffered for the app before reading from the client pauses."""
FLUSH_AT_BYTES = 65536
"""Buffered response bytes that are sent at once instead of at the end of the loop step."""

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_STATUS_LINES = {code: f"HTTP/1.1 {code} {http.HTTPStatus(code).phrase}\r\n".encode()
                 for code in (s.value for s in http.HTTPStatus)}
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_PLAIN, _LENGTH, _ENCODING, _CONNECTION = range(4)
_NAMES: dict[bytes, tuple[bytes, int]] = {}
"""Response header names seen so far -> (lower-cased name, kind)."""
_MAX_NAMES = 4096


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise RuntimeError(f"Invalid HTTP status code {status}.")
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} \r\n".encode()
    return line


def _name(name: bytes) -> tuple[bytes, int]:
    """A response header name checked and lower-cased, and what it means for framing."""
    hit = _NAMES.get(name)
    if hit is None:
        if not name or _BAD_NAME.search(name):
            raise RuntimeError("Invalid HTTP header name.")
        low = name.lower()
        kind = {b"content-length": _LENGTH, b"transfer-encoding": _ENCODING, b"connection": _CONNECTION}.get(
            low, _PLAIN)
        hit = (low, kind)
        if len(_NAMES) < _MAX_NAMES:
            _NAMES[name] = hit
    return hit


class _Defaults:
    """uvicorn's default response headers (``date`` changes every second) as one block."""

    source: list[tuple[bytes, bytes]] | None = None
    block = b""

    @classmethod
    def encoded(cls, headers: list[tuple[bytes, bytes]]) -> bytes:
        if headers is not cls.source:
            cls.block = b"".join([name + b": " + value + b"\r\n" for name, value in headers])
            cls.source = headers
        return cls.block


class _Exchange:
    """One request and its response: the ASGI ``receive`` and ``send`` of one app call."""

    __slots__ = ("body", "buffered", "chunked", "complete", "conn", "disconnected", "end_delivered", "expect_100",
                 "head", "is_head", "keep_alive", "left", "more_body", "scope", "started", "waiter")

    def __init__(self, conn: GatewayHttpProtocol, scope: dict[str, Any], keep_alive: bool,
                 expect_100: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_100 = expect_100
        self.is_head = scope["method"] == "HEAD"
        self.body: list[bytes] = []
        self.buffered = 0
        self.more_body = True
        """The client has more request body to send."""
        self.end_delivered = False
        """The app was given the last part of the request body."""
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.complete = False
        self.disconnected = False
        self.head = b""
        self.chunked = False
        self.left: int | None = None
        """Body bytes still owed under the response's Content-Length."""

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self.expect_100:
            self.expect_100 = False
            if not self.started:
                conn.write(b"HTTP/1.1 100 Continue\r\n\r\n", now=True)
        while not (self.disconnected or self.complete):
            if self.body or not (self.more_body or self.end_delivered):
                body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body = []
                self.buffered = 0
                if not self.more_body:
                    self.end_delivered = True
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            if conn.exchange is self:
                conn.resume_reading()
            self.waiter = conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self._start(message["status"], message.get("headers", ()))
            conn.write(self.head, now=False)
            return
        if self.complete:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.is_head:
            data = b""
        elif self.chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            data = body
            if self.left is not None:
                self.left -= len(body)
                if self.left < 0:
                    raise RuntimeError("Response content longer than Content-Length")
        if more:
            conn.write(data, now=False)
            return
        if self.left and not self.is_head:
            raise RuntimeError("Response content shorter than Content-Length")
        conn.write(data, now=True)
        self.complete = True
        self.wake()
        conn.finished(self)

    def _start(self, status: int, headers: Any) -> None:
        """Encode the response head into ``self.head`` (the response counts as started only
        when that worked: a bad header leaves room for the 500)."""
        parts = [_status_line(status), _Defaults.encoded(self.conn.server_state.default_headers)]
        values = []
        length = None
        chunked = close = False
        names = _NAMES
        for raw_name, value in headers:
            name, kind = names.get(raw_name) or _name(raw_name)
            values.append(value)
            if kind:
                if kind == _LENGTH and length is None and not chunked:
                    length = int(value)
                elif kind == _ENCODING and value.lower() == b"chunked":
                    chunked = True
                    length = None
                elif kind == _CONNECTION and b"close" in [t.strip() for t in value.lower().split(b",")]:
                    close = True
            parts += (name, b": ", value, b"\r\n")
        if values and _BAD_VALUE.search(b"".join(values)):
            raise RuntimeError("Invalid HTTP header value.")
        if self.more_body:
            # The request was not read to its end: its rest cannot be told from the next request.
            self.keep_alive = False
        if close:
            self.keep_alive = False
        elif not self.keep_alive:
            parts.append(b"connection: close\r\n")
        if length is None and not chunked and not self.is_head and status not in (204, 304) and status >= 200:
            if self.scope["http_version"] == "1.1":
                chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                self.keep_alive = False  # delimited by closing the connection
        parts.append(b"\r\n")
        self.head = b"".join(parts)
        self.chunked = chunked
        self.left = length
        self.started = True
        self.expect_100 = False


class GatewayHttpProtocol(asyncio.Protocol):
    """HTTP/1.1 for uvicorn's server (``uvicorn.run(app, http=GatewayHttpProtocol)``); see the module."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.app_state = app_state
        self.root_path: str = config.root_path
        self.keep_alive_s: float = config.timeout_keep_alive
        self.parser = httptools.HttpRequestParser(self)
        # Answer the first of pipelined requests even when the client closes after sending them.
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.exchange: _Exchange | None = None
        """The exchange whose app is running (at most one per connection)."""
        self.parsing: _Exchange | None = None
        """The exchange whose request the parser fills (the running one, or one queued behind it)."""
        self.queue: deque[_Exchange] = deque()
        self.reading_paused = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._out: list[bytes] = []
        self._out_size = 0
        self._flush: asyncio.Handle | None = None
        """The end-of-step flush, while one is due."""
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._expect_100 = False
        self._in_message = False
        self._idle_since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- connection -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server_state.connections.add(self)
        sock = transport.get_extra_info("socket")
        try:
            local, peer = sock.getsockname(), sock.getpeername()
        except (AttributeError, OSError):
            local, peer = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
        self.server = (str(local[0]), int(local[1])) if isinstance(local, tuple) else \
            (local, None) if isinstance(local, str) else None  # type: ignore[assignment]
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self._idle_since = self.loop.time()
        self._timer = self.loop.call_later(self.keep_alive_s, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for ex in (self.exchange, *self.queue):
            if ex is not None and not ex.complete:
                ex.disconnected = True
                ex.wake()
        self.queue.clear()
        self._out = []
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if exc is None:
            self.transport.close()
        self.parser = None  # type: ignore[assignment]

    def eof_received(self) -> None:
        pass  # the transport closes itself

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close when idle, else after the running response."""
        if self.exchange is None:
            self.close()
        else:
            self.exchange.keep_alive = False
            self.queue.clear()

    def close(self) -> None:
        self.flush()
        if not self.transport.is_closing():
            self.transport.close()

    def _check_idle(self) -> None:
        """The keep-alive timer: close a connection idle for ``keep_alive_s``, else look again
        when it could be."""
        self._timer = None
        if self.transport.is_closing():
            return
        wait = self.keep_alive_s
        if self.exchange is None and not self._in_message:
            idle = self.loop.time() - self._idle_since
            if idle >= self.keep_alive_s:
                self.close()
                return
            wait -= idle
        self._timer = self.loop.call_later(wait, self._check_idle)

    # -- flow control -----------------------------------------------------------------------------

    def pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and not self.queue:
            self.reading_paused = False
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = self.loop.create_future()
        await self._drain

    # -- writing ----------------------------------------------------------------------------------

    def write(self, data: bytes, *, now: bool) -> None:
        """Send ``data`` with whatever is buffered: ``now``, or at the end of this loop step."""
        if data:
            self._out.append(data)
            self._out_size += len(data)
        if now or self._out_size >= FLUSH_AT_BYTES:
            self.flush()
        elif self._out and self._flush is None:
            self._flush = self.loop.call_soon(self.flush)

    def flush(self) -> None:
        if self._flush is not None:
            self._flush.cancel()  # (a no-op when it is the one running)
            self._flush = None
        out = self._out
        if not out:
            return
        self._out = []
        self._out_size = 0
        if not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # -- parser callbacks -------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No upgrades here: the request was answered as plain HTTP; nothing after it is read.
            if self.parsing is not None:
                self.parsing.keep_alive = False
            self.pause_reading()
        except httptools.HttpParserError as exc:
            too_large = isinstance(exc.__context__, _HeadTooLarge)
            if self.exchange is None:
                self._refuse(431 if too_large else 400,
                             "Request header fields too large." if too_large else "Invalid HTTP request received.")
            else:
                self.exchange.keep_alive = False  # close once the running request is answered
                self.queue.clear()
                self.pause_reading()

    def _refuse(self, status: int, message: str) -> None:
        body = message.encode()
        self.write(_status_line(status) + b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                   b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body, now=True)
        self.close()

    def on_message_begin(self) -> None:
        self._in_message = True
        self._url = b""
        self._headers = []
        self._head_size = 0
        self._expect_100 = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self._headers.append((name, value))
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD_BYTES:
            raise _HeadTooLarge
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_100 = True

    def on_headers_complete(self) -> None:
        parser = self.parser
        version = parser.get_http_version()
        url = self._url
        if url[:1] == b"/" and b"?" not in url and b"%" not in url and b"#" not in url:
            raw_path, query = url, b""
            path = url.decode("ascii")
        else:
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path, parsed.query or b""
            path = raw_path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
        root = self.root_path
        scope = {
            "type": "http", "asgi": _ASGI, "http_version": version, "server": self.server, "client": self.client,
            "scheme": self.scheme, "method": parser.get_method().decode("ascii"), "root_path": root,
            "path": root + path if root else path, "raw_path": root.encode() + raw_path if root else raw_path,
            "query_string": query, "headers": self._headers, "state": self.app_state.copy(),
        }
        ex = _Exchange(self, scope, version == "1.1" and parser.should_keep_alive(), self._expect_100)
        self.parsing = ex
        if self.exchange is None:
            self._run(ex)
        else:
            self.queue.append(ex)  # pipelined: runs when the one before it has its response
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is None or ex.complete:
            return
        ex.body.append(body)
        ex.buffered += len(body)
        if ex.buffered > BODY_HIGH_WATER:
            self.pause_reading()  # until the app asks for more
        ex.wake()

    def on_message_complete(self) -> None:
        self._in_message = False
        ex = self.parsing
        if ex is None:
            return
        ex.more_body = False
        ex.wake()

    # -- running the app --------------------------------------------------------------------------

    def _run(self, ex: _Exchange) -> None:
        self.exchange = ex
        task = self.loop.create_task(self.app(ex.scope, ex.receive, ex.send))
        self.server_state.tasks.add(task)
        task.add_done_callback(lambda t: self._app_done(t, ex))

    def finished(self, ex: _Exchange) -> None:
        """``ex`` sent its whole response: close, or go on with the next request."""
        self.server_state.total_requests += 1
        if self.exchange is ex:
            self.exchange = None
        if not ex.keep_alive:
            self.close()
            return
        if self.transport.is_closing():
            return
        self._idle_since = self.loop.time()
        if self.queue:
            self._run(self.queue.popleft())
        self.resume_reading()

    def _app_done(self, task: asyncio.Task[None], ex: _Exchange) -> None:
        """What uvicorn's wrapper coroutine does when the app returns or raises."""
        self.server_state.tasks.discard(task)
        exc = asyncio.CancelledError() if task.cancelled() else task.exception()
        if exc is not None:
            log.error("Exception in ASGI application\n", exc_info=exc)
        if ex.complete or ex.disconnected:
            return
        if exc is None:
            log.error("ASGI callable returned without %s response.", "completing" if ex.started else "starting")
        if ex.started:
            self.close()  # a half-sent response: the client sees it cut short
            return
        ex.keep_alive = False
        ex._start(500, [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21")])
        self.write(ex.head + (b"" if ex.is_head else b"Internal Server Error"), now=True)
        ex.complete = True
        ex.wake()
        self.finished(ex)


class _HeadTooLarge(Exception):
    """The request line and headers are over ``MAX_HEAD_BYTES``."""

"""A lean HTTP/1.1 keep-alive transport for the gateway's ``httpx.AsyncClient``.

httpcore's pool checks every pooled connection's socket on each request (a ``poll``
per connection) and goes through anyio; at thousands of requests per second that was
most of the gateway's CPU per request. Workers are a handful of loopback/cluster-local
HTTP/1.1 servers, so this transport keeps a LIFO stack of idle connections per host,
writes the request in one call and streams the response body (content-length or
chunked) as it arrives, chunk by chunk, which is what SSE passthrough needs.

A connection goes back to the pool only when its response was read to the end; a
response closed early (client gone, deadline) closes the connection, so the worker sees
the disconnect and frees its slot. A reused connection that the server had already
closed (EOF before any response byte) is retried once on a fresh connection.
Errors are raised as httpx exceptions (``ConnectError``, ``ReadError``,
``RemoteProtocolError``, ``ConnectTimeout``) so callers treat both transports alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable

import httpx


class _Conn:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, expiry: float) -> bool:
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and now - self.idle_since < expiry)

    def close(self) -> None:
        self.writer.close()


class _Body(httpx.AsyncByteStream):
    def __init__(self, pool: H11Transport, key: tuple[str, int], conn: _Conn, length: int | None,
                 chunked: bool, keep_alive: bool) -> None:
        self.pool = pool
        self.key = key
        self.conn: _Conn | None = conn
        self.length = length
        self.chunked = chunked
        self.keep_alive = keep_alive
        self.complete = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        if conn is None:
            return
        reader = conn.reader
        try:
            if self.chunked:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        # trailers (if any) end with an empty line
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self.length is not None:
                left = self.length
                while left > 0:
                    data = await reader.read(min(left, 262144))
                    if not data:
                        raise httpx.RemoteProtocolError("connection closed before the end of the body")
                    left -= len(data)
                    yield data
            else:  # read to EOF (Connection: close)
                self.keep_alive = False
                while data := await reader.read(262144):
                    yield data
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise httpx.ReadError(f"worker connection broke: {type(exc).__name__}") from None
        except asyncio.LimitOverrunError:
            raise httpx.RemoteProtocolError("chunk header too long") from None
        except ValueError:
            raise httpx.RemoteProtocolError("malformed chunked encoding") from None
        self.complete = True

    async def read_all(self) -> bytes:
        """The whole body; a content-length body in one read, without iterating."""
        conn = self.conn
        if conn is None or self.chunked or self.length is None:
            return b"".join([chunk async for chunk in self])
        try:
            data = await conn.reader.readexactly(self.length)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise httpx.ReadError(f"worker connection broke: {type(exc).__name__}") from None
        self.complete = True
        return data

    def close(self) -> None:
        """Give the connection back (a body read to its end) or close it."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if self.complete and self.keep_alive:
            self.pool._release(self.key, conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self.close()


class RawResponse:
    """The minimal response surface the gateway's proxy uses (``httpx.Response`` has the same).

    Only what framing needs and the content type are taken from the head when it arrives
    (a few searches of the lower-cased head, no per-line parsing); ``headers`` and
    ``raw_headers`` are parsed on first use."""

    __slots__ = ("_head", "_headers", "_stream", "content_type", "status_code")

    def __init__(self, status: int, head: bytes, content_type: str | None, stream: _Body) -> None:
        self.status_code = status
        self._head = head
        self.content_type = content_type
        self._stream = stream
        self._headers: list[tuple[bytes, bytes]] | None = None

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """(lower-case name, value) in order."""
        if self._headers is None:
            out = []
            for line in self._head.split(b"\r\n")[1:]:
                if line:
                    name, _, value = line.partition(b":")
                    out.append((name.strip().lower(), value.strip()))
            self._headers = out
        return self._headers

    @property
    def headers(self) -> dict[str, str]:
        """Lower-case names (the last value of a repeated header)."""
        return {name.decode("latin-1"): value.decode("latin-1") for name, value in self.raw_headers}

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self._stream.__aiter__()

    def aread(self) -> Awaitable[bytes]:
        return self._stream.read_all()

    def close(self) -> None:
        """``aclose`` without a coroutine (nothing in it waits)."""
        self._stream.close()

    async def aclose(self) -> None:
        self._stream.close()


def _field(head: bytes, low: bytes, name: bytes) -> bytes | None:
    """The value of the last ``name`` header (``name``: ``b"\\r\\nlower-case-name:"``) in
    ``head``, whose lower-cased copy is ``low``."""
    i = low.rfind(name)
    if i < 0:
        return None
    i += len(name)
    return head[i: head.index(b"\r\n", i)].strip()


class H11Transport(httpx.AsyncBaseTransport):
    def __init__(self, *, connect_timeout: float = 2.0, keepalive_expiry: float = 30.0,
                 max_idle_per_host: int = 256) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_expiry = keepalive_expiry
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        stack = self._idle.setdefault(key, [])
        if len(stack) >= self.max_idle_per_host:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        stack.append(conn)

    def _pooled(self, key: tuple[str, int]) -> _Conn | None:
        stack = self._idle.get(key)
        if not stack:
            return None
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            if conn.usable(now, self.keepalive_expiry):
                return conn
            conn.close()
        return None

    async def _connect(self, host: str, port: int) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        return _Conn(reader, writer)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol("this transport speaks plain HTTP/1.1 only")
        host = url.host
        port = url.port or 80
        extra = b"".join(k + b": " + v + b"\r\n" for k, v in request.headers.raw
                         if k.lower() not in (b"host", b"content-length", b"transfer-encoding", b"connection"))
        raw = await self._roundtrip(host, port, request.method, url.raw_path.decode("ascii"), extra,
                                    request.content)
        return httpx.Response(raw.status_code, headers=raw.raw_headers, stream=raw._stream,
                              extensions={"http_version": b"HTTP/1.1"})

    def post(self, host: str, port: int, target: str, extra_headers: bytes, body: bytes) -> Awaitable[RawResponse]:
        """The gateway's fast path: POST without building httpx models (``extra_headers``
        are complete ``name: value\r\n`` lines). Not a coroutine of its own: awaiting it
        awaits the exchange directly (one frame less to resume on every read)."""
        return self._roundtrip(host, port, "POST", target, extra_headers, body)

    async def _roundtrip(self, host: str, port: int, method: str, target: str, extra: bytes,
                         body: bytes) -> RawResponse:
        key = (host, port)
        head = (f"{method} {target} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-length: {len(body)}\r\n"
                .encode() + extra + b"\r\n")
        for attempt in (0, 1):
            conn = self._pooled(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port)
            try:
                if len(body) < 65536:
                    conn.writer.write(head + body)
                else:
                    conn.writer.writelines((head, body))
                status_head = await conn.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
                conn.close()
                got_nothing = not (isinstance(exc, asyncio.IncompleteReadError) and exc.partial)
                if reused and got_nothing:
                    continue  # the server had closed the idle connection: retry on a fresh one
                raise httpx.ReadError(f"worker connection broke: {type(exc).__name__}") from None
            except asyncio.LimitOverrunError:
                conn.close()
                raise httpx.RemoteProtocolError("response headers too large") from None
            except BaseException:
                conn.close()
                raise
            return self._response(key, conn, status_head)
        raise httpx.ReadError("worker closed the connection")  # pragma: no cover

    def _response(self, key: tuple[str, int], conn: _Conn, raw: bytes) -> RawResponse:
        try:
            parts = raw[: raw.index(b"\r\n")].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                raise ValueError
            status = int(parts[1])
            low = raw.lower()
            value = _field(raw, low, b"\r\ncontent-length:")
            length = int(value) if value is not None else None
            value = _field(low, low, b"\r\ntransfer-encoding:")
            chunked = value is not None and b"chunked" in value
            keep_alive = parts[0] == b"HTTP/1.1"
            value = _field(low, low, b"\r\nconnection:")
            if value is not None:
                keep_alive = b"close" not in value and (keep_alive or b"keep-alive" in value)
            value = _field(raw, low, b"\r\ncontent-type:")
            ctype = value.decode("latin-1") if value is not None else None
        except ValueError:
            conn.close()
            raise httpx.RemoteProtocolError("malformed response from worker") from None
        if status in (204, 304) or 100 <= status < 200:
            length = 0
        return RawResponse(status, raw, ctype, _Body(self, key, conn, length, chunked, keep_alive))

    async def aclose(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()

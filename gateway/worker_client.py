"""The gateway's one HTTP client to its workers: aiohttp's response protocol over a keep-alive pool.

Every call to a worker (completions, the activation probe, the tokenizer fetch) goes
through ``WorkerClient``, which sends the worker secret, keeps connections alive and
raises two errors only: ``WorkerUnreachable`` (nothing was sent: the next worker may
try) and ``WorkerBroke`` (the exchange broke or timed out after it started).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Protocol

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.helpers import TimerNoop
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from yarl import URL

from loraplex.wire import HDR_CACHE, HDR_REQUEST_ID, HDR_WORKER_SECRET

CONNECT_TIMEOUT_S = 2.0
KEEPALIVE_S = 4.0
"""Idle connections are dropped before the worker's own keep-alive timeout (uvicorn: 5 s)."""
MAX_IDLE_PER_WORKER = 256

_BROKEN = (aiohttp.ClientError, HttpProcessingError, OSError, TimeoutError)
"""What aiohttp's protocol raises when an exchange breaks: a lost or reset connection, a
payload cut short, a head it cannot parse."""


class WorkerUnreachable(Exception):
    """The worker could not be connected to: the request never reached it."""


class WorkerBroke(Exception):
    """The exchange with the worker broke off (or timed out) after it was sent."""


class WorkerResponse(Protocol):
    """A worker's answer, headers read and body not yet."""

    status: int
    content_type: str
    cache: str
    """``x-loraplex-cache``: ``cold`` when the worker had to load the adapter first."""

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def close(self) -> None: ...


class _Target:
    """A worker URL parsed once: where to connect and what the request line and Host say."""

    __slots__ = ("host", "key", "line", "port")

    def __init__(self, url: str) -> None:
        u = URL(url)
        if u.scheme != "http" or not u.host:
            raise WorkerUnreachable(f"not an http:// worker URL: {url!r}")
        self.host = u.host
        self.port = u.port or 80
        self.key = (self.host, self.port)
        self.line = b" %s HTTP/1.1\r\nhost: %s\r\n" % (u.raw_path_qs.encode("ascii"),
                                                         f"{u.raw_host}:{self.port}".encode("ascii"))


class Exchange:
    """``WorkerResponse`` over the response aiohttp's protocol parsed; ``close`` pools the
    connection when the body was read to its end."""

    __slots__ = ("_client", "_key", "_payload", "_proto", "cache", "content_type", "status")

    def __init__(self, client: WorkerClient, key: tuple[str, int], proto: ResponseHandler,
                 message: aiohttp.http.RawResponseMessage, payload: StreamReader) -> None:
        self._client = client
        self._key = key
        self._proto: ResponseHandler | None = proto
        self._payload = payload
        self.status = message.code
        self.content_type = message.headers.get("content-type", "application/json")
        self.cache = message.headers.get(HDR_CACHE, "")
        """``x-loraplex-cache``: ``cold`` when the worker had to load the adapter first."""

    async def read(self) -> bytes:
        payload = self._payload
        try:
            if payload.is_eof():  # all of the body is here (a small answer usually is)
                return payload.read_nowait()
            return await payload.read()
        except _BROKEN as exc:
            raise WorkerBroke(_why(exc)) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (each SSE write of the worker as soon as it lands)."""
        payload = self._payload
        try:
            while True:
                data = await payload.readany()
                if not data:
                    return
                yield data
        except _BROKEN as exc:
            raise WorkerBroke(_why(exc)) from None

    def close(self) -> None:
        """Back to the pool when read to its end; else the connection closes, so the worker
        sees the disconnect and frees its slot."""
        proto = self._proto
        if proto is None:
            return
        self._proto = None
        if self._payload.is_eof() and not proto.should_close and proto.is_connected():
            self._client._release(self._key, proto)
        else:
            proto.close()


class WorkerClient:
    """Keep-alive connections per worker, per event loop (the app may be built outside one).

    A request goes out in one write (head and body); aiohttp's ``ResponseHandler`` parses the
    answer (llhttp: status, headers, content-length or chunked body, keep-alive) into a
    ``StreamReader``. Idle connections wait in a LIFO stack per worker for ``keepalive_s``."""

    def __init__(self, worker_secret: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        if "\r" in worker_secret or "\n" in worker_secret:
            raise ValueError("the worker secret must not contain line breaks")
        self.secret = worker_secret
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._headers = {"content-type": "application/json", HDR_WORKER_SECRET: worker_secret,
                         "user-agent": "loraplex-gateway"}
        """Sent with every call (``post`` adds the request id to a copy)."""
        self._targets: dict[str, _Target] = {}
        """Parsed once per URL (a handful of workers x routes)."""
        self._idle: dict[tuple[str, int], list[tuple[ResponseHandler, float]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def post(self, url: str, body: bytes, request_id: str) -> Awaitable[WorkerResponse]:
        """POST a JSON body; (awaited) the response with its headers read. A plain function:
        the awaiting request's coroutine chain is a frame shorter on every resume."""
        headers = self._headers.copy()
        headers[HDR_REQUEST_ID] = request_id
        return self.exchange("POST", url, body, headers)

    async def call(self, method: str, url: str, *, body: bytes | None = None,
                   timeout_s: float | None = None) -> tuple[int, bytes]:
        """A whole exchange (control calls: probe, tokenizer): (status, body)."""
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self.exchange(method, url, body, self._headers)
                try:
                    return resp.status, await resp.read()
                finally:
                    resp.close()
        except TimeoutError:  # ``timeout_s`` expired (the exchange maps its own timeouts)
            raise WorkerBroke(f"no answer within {timeout_s or 0:g} s") from None

    async def exchange(self, method: str, url: str, body: bytes | None,
                       headers: Mapping[str, str]) -> WorkerResponse:
        """The one place a request leaves the gateway (the seam a test double replaces)."""
        loop = self._loop
        if loop is None or not loop.is_running():  # connections belong to the loop that made them
            # (asking asyncio for the running loop costs a getpid system call on Python 3.11)
            self._loop = loop = asyncio.get_running_loop()
            self._idle = {}
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= 4096:
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
            bad = next(name for name, value in headers.items() if "\r" in f"{name}{value}" or "\n" in f"{name}{value}")
            raise ValueError(f"header {bad} must not contain line breaks")
        request = b"".join((method.encode("ascii"), target.line, lines.encode("latin-1"),
                            b"\r\n" if body is None else b"content-length: %d\r\n\r\n" % len(body), body or b""))
        for attempt in (0, 1):
            proto = self._pooled(target.key, loop) if attempt == 0 else None
            reused = proto is not None
            if proto is None:
                proto = await self._connect(target, loop)
            try:
                proto.transport.write(request)  # type: ignore[union-attr]
                message, payload = await proto.read()
            except aiohttp.ServerDisconnectedError:
                proto.close()
                if reused:
                    continue  # a pooled connection the worker had just closed: once more, fresh
                raise WorkerBroke("the worker closed the connection without answering") from None
            except _BROKEN as exc:
                proto.close()
                raise WorkerBroke(_why(exc)) from None
            except BaseException:
                proto.close()
                raise
            return Exchange(self, target.key, proto, message, payload)
        raise AssertionError("unreachable")  # pragma: no cover

    def _pooled(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> ResponseHandler | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = loop.time()
        while idle:
            proto, since = idle.pop()
            if proto.is_connected() and now - since < self.keepalive_s:
                return proto
            proto.close()
        return None

    async def _connect(self, target: _Target, loop: asyncio.AbstractEventLoop) -> ResponseHandler:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await loop.create_connection(lambda: ResponseHandler(loop), target.host, target.port)
        except (OSError, TimeoutError) as exc:
            raise WorkerUnreachable(_why(exc)) from None
        # One parser for the connection's life: llhttp reads response after response.
        proto.set_response_params(timer=_NO_TIMER, auto_decompress=False)
        return proto

    def _release(self, key: tuple[str, int], proto: ResponseHandler) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            proto.close()
            return
        idle = self._idle.setdefault(key, [])
        if len(idle) >= MAX_IDLE_PER_WORKER:
            proto.close()
            return
        idle.append((proto, loop.time()))

    async def close(self) -> None:
        for idle in self._idle.values():
            for proto, _ in idle:
                proto.close()
        self._idle = {}


_NO_TIMER = TimerNoop()
"""No per-request timer: a completion's deadline is the gateway's, a control call's ``call``'s."""


def _why(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

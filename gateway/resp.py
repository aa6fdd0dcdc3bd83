"""A minimal pipelined Redis connection for the rate limiter's hot path.

redis-py's asyncio client spends more CPU per command (connection checkout,
observability hooks, argument encoding) than the whole rest of a gateway request, and
the limiter only ever sends ``EVALSHA``/``SCRIPT LOAD``. This connection writes RESP
frames on one TCP connection, keeps a FIFO of waiting futures and lets ``hiredis``
parse the replies in a reader task: many requests share one connection and one
``write`` per event-loop tick, with no lock, no checkout and no task per call
(``push`` writes and returns; the reader resolves the callers' own futures).

Any I/O error or timeout (a reply missing ``timeout`` seconds after its command went
out) closes the connection and fails every waiting call (replies could otherwise be
matched to the wrong caller); the next call reconnects. Error replies (e.g.
``NOSCRIPT``) are ``ReplyError`` values for their own caller only.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import hiredis


class RespError(ConnectionError):
    """The connection to Redis failed or timed out."""


class ReplyError(Exception):
    """Redis answered a command with an error."""


def bulk(value: Any) -> bytes:
    """One RESP bulk string (``bytes`` as they are, anything else as its ``str``)."""
    b = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(b), b)


def head(total: int, *leading: Any) -> bytes:
    """The start of a command of ``total`` arguments: its header and the ``leading`` ones
    (callers cache it and append the ``bulk`` of the remaining arguments)."""
    return b"*%d\r\n" % total + b"".join(bulk(a) for a in leading)


def encode(args: tuple[Any, ...] | list[Any]) -> bytes:
    return head(len(args), *args)


class _Link:
    """One TCP connection: its writer, the futures waiting for replies in order, and the
    reply-deadline check (one timer at a time)."""

    __slots__ = ("answered", "sent", "timer", "waiting", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.sent = 0
        self.answered = 0
        self.timer: asyncio.TimerHandle | None = None


class RespConnection:
    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None,
                 password: str | None = None, timeout: float = 0.5) -> None:
        self.host = host
        self.port = port
        self.db = db
        self.username = username
        self.password = password
        self.timeout = timeout
        self._link: _Link | None = None
        self._ready = False
        self._reader_task: asyncio.Task[None] | None = None
        self._connecting: asyncio.Future[None] | None = None

    @classmethod
    def from_redis(cls, redis: Any, timeout: float = 0.5) -> RespConnection | None:
        """Same server and credentials as a ``redis.asyncio.Redis`` over plain TCP, else None."""
        pool = getattr(redis, "connection_pool", None)
        if pool is None:
            return None
        from redis.asyncio.connection import Connection

        if pool.connection_class is not Connection:  # TLS, unix sockets: leave them to redis-py
            return None
        kw = pool.connection_kwargs
        return cls(kw.get("host", "localhost"), int(kw.get("port", 6379)), db=int(kw.get("db", 0) or 0),
                   username=kw.get("username"), password=kw.get("password"),
                   timeout=float(kw.get("socket_timeout") or timeout))

    @property
    def connected(self) -> bool:
        """Connected and set up: ``push`` may be used."""
        return self._ready and self._link is not None and not self._link.writer.is_closing()

    async def _connect(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise RespError(f"cannot connect to Redis at {self.host}:{self.port}: {exc}") from None
        link = self._link = _Link(writer)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader, link))
        setup: list[bytes] = []
        if self.password:
            setup.append(encode(("AUTH", self.username, self.password) if self.username
                                else ("AUTH", self.password)))
        if self.db:
            setup.append(encode(("SELECT", self.db)))
        if setup:
            for res in await self._send(setup):
                if isinstance(res, ReplyError):
                    self._fail(link, RespError(f"Redis refused the connection setup: {res}"))
                    raise RespError(str(res))
        self._ready = True

    async def connect(self) -> None:
        """Connect (once, however many callers wait) unless connected."""
        if self.connected:
            return
        if self._connecting is not None:
            await asyncio.shield(self._connecting)
            return
        self._ready = False
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            await self._connect()
            self._connecting.set_result(None)
        except BaseException as exc:
            if self._link is not None:  # a half set-up connection
                self._fail(self._link, RespError("connection setup failed"))
            self._connecting.set_exception(exc if isinstance(exc, Exception) else RespError("cancelled"))
            self._connecting.exception()  # mark retrieved
            raise
        finally:
            self._connecting = None

    async def _read(self, reader: asyncio.StreamReader, link: _Link) -> None:
        parser = hiredis.Reader(replyError=ReplyError)
        waiting = link.waiting
        try:
            while data := await reader.read(65536):
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    link.answered += 1
                    fut = waiting.popleft()
                    if not fut.done():
                        fut.set_result(reply)
        except (OSError, IndexError, hiredis.ProtocolError) as exc:
            self._fail(link, RespError(f"Redis connection broke: {type(exc).__name__}"))
            return
        self._fail(link, RespError("Redis closed the connection"))

    def _fail(self, link: _Link, exc: Exception) -> None:
        if link is self._link:
            self._link = None
            self._ready = False
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        waiting, link.waiting = link.waiting, collections.deque()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # callers that gave up must not warn "never retrieved"
        link.writer.close()

    def _check(self, link: _Link, target: int) -> None:
        link.timer = None
        if link.answered < target:
            self._fail(link, RespError("Redis did not answer in time"))
        elif link.sent > link.answered:
            link.timer = asyncio.get_running_loop().call_later(self.timeout, self._check, link, link.sent)

    def push(self, data: bytes, futs: list[asyncio.Future[Any]]) -> None:
        """Write ``data`` (one frame per future) now; each future gets its reply in order.
        Needs a connection (``connect`` first)."""
        link = self._link
        if link is None:
            raise RespError("not connected")
        link.waiting.extend(futs)
        link.sent += len(futs)
        link.writer.write(data)
        if link.timer is None:
            link.timer = asyncio.get_running_loop().call_later(self.timeout, self._check, link, link.sent)

    async def _send(self, frames: list[bytes]) -> list[Any]:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in frames]
        self.push(b"".join(frames), futs)
        return [await f for f in futs]

    async def execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` in one write; their replies (``ReplyError`` for error replies)."""
        await self.connect()
        return await self._send([encode(c) for c in commands])

    async def close(self) -> None:
        if self._link is not None:
            self._fail(self._link, RespError("connection closed"))
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._reader_task = None

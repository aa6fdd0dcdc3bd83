"""A minimal pipelined Redis connection for the rate limiter's hot path.

redis-py's asyncio client spends more CPU per command (connection checkout,
observability hooks, argument encoding) than the whole rest of a gateway request, and
the limiter only ever sends ``EVALSHA``/``SCRIPT LOAD``. This connection writes RESP
frames on one TCP connection, keeps a FIFO of waiting futures and lets ``hiredis``
parse the replies as they arrive (the connection is its transport's protocol): many
requests share one connection and one ``write`` per event-loop tick, with no lock, no
checkout and no task (``push`` writes and returns; replies resolve the callers' own futures).

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


class _Link(asyncio.Protocol):
    """One TCP connection, as its transport's protocol: replies are parsed in
    ``data_received`` straight into the futures waiting for them in order; one reply-deadline
    timer at a time."""

    def __init__(self, owner: RespConnection) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.parser = hiredis.Reader(replyError=ReplyError)
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.sent = 0
        self.answered = 0
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        parser.feed(data)
        waiting = self.waiting
        try:
            while (reply := parser.gets()) is not False:
                self.answered += 1
                fut = waiting.popleft()
                if not fut.done():
                    fut.set_result(reply)
        except (IndexError, hiredis.ProtocolError) as exc:
            self.owner._fail(self, RespError(f"Redis connection broke: {type(exc).__name__}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._fail(self, RespError("Redis closed the connection" if exc is None
                                         else f"Redis connection broke: {type(exc).__name__}"))

    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()


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
        return self._ready and self._link is not None and not self._link.closing()

    async def _connect(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                _, link = await asyncio.get_running_loop().create_connection(lambda: _Link(self), self.host,
                                                                             self.port)
        except (OSError, TimeoutError) as exc:
            raise RespError(f"cannot connect to Redis at {self.host}:{self.port}: {exc}") from None
        self._link = link
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
        if link.transport is not None:
            link.transport.close()

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
        link.transport.write(data)  # type: ignore[union-attr]
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

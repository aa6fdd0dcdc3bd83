"""A minimal pipelined Redis connection for the rate limiter's hot path.

redis-py's asyncio client spends more CPU per command (connection checkout,
observability hooks, argument encoding) than the whole rest of a gateway request, and
the limiter only ever sends ``EVALSHA``/``SCRIPT LOAD``. This connection writes RESP
frames on one TCP connection, keeps a FIFO of waiting futures and lets ``hiredis``
parse the replies in a reader task: many requests share one connection and one
``write`` per event-loop tick, with no lock and no checkout.

Any I/O error or timeout closes the connection and fails every waiting call (replies
could otherwise be matched to the wrong caller); the next call reconnects.
``ReplyError``s (e.g. ``NOSCRIPT``) are returned to their own caller only.
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


def encode(args: tuple[Any, ...] | list[Any]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RespConnection:
    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None,
                 password: str | None = None, timeout: float = 0.5) -> None:
        self.host = host
        self.port = port
        self.db = db
        self.username = username
        self.password = password
        self.timeout = timeout
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
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

    async def _connect(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise RespError(f"cannot connect to Redis at {self.host}:{self.port}: {exc}") from None
        self._writer = writer
        self._waiting = collections.deque()
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader, writer, self._waiting))
        setup: list[bytes] = []
        if self.password:
            setup.append(encode(("AUTH", self.username, self.password) if self.username
                                else ("AUTH", self.password)))
        if self.db:
            setup.append(encode(("SELECT", self.db)))
        if setup:
            for res in await self._send(setup):
                if isinstance(res, ReplyError):
                    self._fail(RespError(f"Redis refused the connection setup: {res}"))
                    raise RespError(str(res))

    async def _ensure(self) -> None:
        if self._writer is not None and not self._writer.is_closing():
            return
        if self._connecting is not None:
            await asyncio.shield(self._connecting)
            return
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            await self._connect()
            self._connecting.set_result(None)
        except BaseException as exc:
            self._connecting.set_exception(exc if isinstance(exc, Exception) else RespError("cancelled"))
            self._connecting.exception()  # mark retrieved
            raise
        finally:
            self._connecting = None

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    waiting: collections.deque[asyncio.Future[Any]]) -> None:
        parser = hiredis.Reader(replyError=ReplyError)
        try:
            while data := await reader.read(65536):
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    fut = waiting.popleft()
                    if not fut.done():
                        fut.set_result(reply)
        except (OSError, IndexError, hiredis.ProtocolError) as exc:
            self._fail(RespError(f"Redis connection broke: {type(exc).__name__}"), writer)
            return
        self._fail(RespError("Redis closed the connection"), writer)

    def _fail(self, exc: Exception, writer: asyncio.StreamWriter | None = None) -> None:
        w = writer or self._writer
        if w is not None and w is self._writer:
            self._writer = None
            waiting, self._waiting = self._waiting, collections.deque()
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # callers that gave up must not warn "never retrieved"
        if w is not None:
            w.close()

    async def _send(self, frames: list[bytes]) -> list[Any]:
        writer = self._writer
        if writer is None:
            raise RespError("not connected")
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in frames]
        self._waiting.extend(futs)
        writer.write(b"".join(frames))
        try:
            async with asyncio.timeout(self.timeout):
                return [await f for f in futs]
        except TimeoutError:
            self._fail(RespError("Redis did not answer in time"), writer)
            raise RespError("Redis did not answer in time") from None

    async def execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` in one write; their replies (``ReplyError`` for error replies)."""
        await self._ensure()
        return await self._send([encode(c) for c in commands])

    async def close(self) -> None:
        self._fail(RespError("connection closed"))
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._reader_task = None

"""The gateway's one HTTP client to its workers: aiohttp's requests over a pooled session's connector.

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
from aiohttp.helpers import TimerNoop
from multidict import CIMultiDict
from yarl import URL

from loraplex.wire import HDR_REQUEST_ID, HDR_WORKER_SECRET

CONNECT_TIMEOUT_S = 2.0
KEEPALIVE_S = 4.0
"""Idle connections are dropped before the worker's own keep-alive timeout (uvicorn: 5 s)."""


class WorkerUnreachable(Exception):
    """The worker could not be connected to: the request never reached it."""


class WorkerBroke(Exception):
    """The exchange with the worker broke off (or timed out) after it was sent."""


class WorkerResponse(Protocol):
    """A worker's answer, headers read and body not yet."""

    status: int
    content_type: str

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def close(self) -> None: ...


class Exchange:
    """``WorkerResponse`` over an aiohttp response."""

    __slots__ = ("_resp", "content_type", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("content-type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WorkerBroke(_why(exc)) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (each SSE write of the worker as soon as it lands)."""
        content = self._resp.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    return
                yield data
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WorkerBroke(_why(exc)) from None

    def close(self) -> None:
        """Back to the pool when read to its end; else the connection closes, so the worker
        sees the disconnect and frees its slot."""
        resp = self._resp
        if resp.content.at_eof():
            resp.release()
        else:
            resp.close()


class WorkerClient:
    """One aiohttp session per event loop (made on first use: the app may be built outside one)."""

    def __init__(self, worker_secret: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        if "\r" in worker_secret or "\n" in worker_secret:
            raise ValueError("the worker secret must not contain line breaks")
        self.secret = worker_secret
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        """Connecting only: a completion's deadline is the gateway's (``gateway.app._Guard``)."""
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._headers = CIMultiDict({
            "content-type": "application/json", HDR_WORKER_SECRET: worker_secret,
            # Given, so aiohttp adds none of its own (its skip list costs more than the headers).
            "accept": "*/*", "accept-encoding": "identity", "user-agent": "loraplex-gateway"})
        """Sent with every call (``post`` adds the request id to a copy)."""
        self._urls: dict[str, URL] = {}
        """Parsed once per target (a handful of workers x routes)."""

    def _current(self) -> aiohttp.ClientSession:
        session = self._session
        loop = asyncio.get_running_loop()
        if session is None or self._loop is not loop:  # ``close`` drops the session
            self._loop = loop
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s, use_dns_cache=True)
            session = self._session = aiohttp.ClientSession(
                connector=connector, timeout=self.timeout, auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar())  # nothing a worker sets may follow another request
        return session

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
        """The one place a request leaves the gateway (the seam a test double replaces).

        aiohttp's request, connector and response used directly, as ``ClientSession.request``
        does after its per-request set-up (timeouts, cookies, redirects, tracing, middlewares),
        none of which a call to a worker uses: that set-up was about a fifth of the client's
        CPU per request (docs/DESIGN.md, "Gateway"). pyproject.toml pins aiohttp's minor version."""
        session = self._current()
        target = self._urls.get(url)
        if target is None:
            if len(self._urls) >= 4096:
                self._urls.clear()
            target = self._urls[url] = URL(url)
        connector = session.connector
        assert connector is not None
        for attempt in (0, 1):
            req = aiohttp.ClientRequest(method, target, headers=headers, data=body, loop=self._loop,
                                        session=session, timer=_NO_TIMER)
            try:
                conn = await connector.connect(req, traces=[], timeout=self.timeout)
            except (aiohttp.ClientConnectorError, TimeoutError) as exc:  # sock_connect expired: TimeoutError
                raise WorkerUnreachable(_why(exc)) from None
            except aiohttp.ClientError as exc:
                raise WorkerBroke(_why(exc)) from None
            assert conn.protocol is not None
            conn.protocol.set_response_params(timer=_NO_TIMER, auto_decompress=False)
            try:
                resp = await req.send(conn)
                try:
                    await resp.start(conn)
                except BaseException:
                    resp.close()
                    raise
            except aiohttp.ServerDisconnectedError:
                conn.close()
                if attempt == 0:
                    continue  # a pooled connection the worker had just closed: once more, fresh
                raise WorkerBroke("the worker closed the connection without answering") from None
            except (aiohttp.ClientError, TimeoutError) as exc:
                conn.close()
                raise WorkerBroke(_why(exc)) from None
            except BaseException:
                conn.close()
                raise
            return Exchange(resp)
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


_NO_TIMER = TimerNoop()
"""No per-request timer: a completion's deadline is the gateway's, a control call's ``call``'s."""


def _why(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""How the gateway is served: uvicorn's httptools protocol with the gateway's edge policy.

``EdgeProtocol`` adds head and body deadlines (408), 431 for heads over ``MAX_HEAD_BYTES`` and
protocol refusals in the OpenAI error shape (docs/DESIGN.md, "Edge"); ``gateway_servers``
builds the public server and the internal metrics server. It subclasses uvicorn's protocol
class and reads its per-request state, so pyproject.toml pins uvicorn's minor version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from loraplex.settings import Settings
from loraplex.wire import error_body

MAX_HEAD_BYTES = 65536
"""Largest request line plus headers accepted (431 beyond)."""


class _HeadTooLarge(Exception):
    """The request line and headers are over ``MAX_HEAD_BYTES``."""


class StepWrites:
    """A transport whose writes of one event-loop step leave as one: uvicorn writes a response's
    head and body separately, which costs a ``send`` and a TCP segment each. Every write and
    close of the connection (uvicorn's and the edge's) goes through here, so their order holds.

    A write that ``holds`` (called with the buffer empty) says is a head whose body is still to
    come is held for the next write, which sends both at once: no callback at the end of the
    step, and no loop iteration more for a response written whole (``release`` sends a head
    left without a body)."""

    __slots__ = ("_buf", "_held", "_holds", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 holds: Callable[[], bool] | None = None) -> None:
        self._transport = transport
        self._loop = loop
        self._holds = holds
        self._buf: list[bytes] | None = None
        self._held = False

    def write(self, data: bytes) -> None:
        buf = self._buf
        if buf is not None:
            buf.append(data)
            if self._held:
                self.flush()
        elif self._holds is not None and self._holds():
            self._buf = [data]
            self._held = True
        else:
            self._buf = [data]
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        buf, self._buf = self._buf, None
        self._held = False
        if buf and not self._transport.is_closing():
            self._transport.write(buf[0] if len(buf) == 1 else b"".join(buf))

    def release(self) -> None:
        """Send a held write now."""
        if self._held:
            self.flush()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` with head/body deadlines and a head size cap."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        """Waiting for a head to complete (a new connection waits for its first)."""
        self._begun = False
        """Bytes of the current head have arrived."""
        self._began_here = False
        self._in_body = False
        self._since = 0.0
        self._head_raw = 0
        """Bytes of the reads that went wholly into the head after the one it began in."""
        self._too_large = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._idle_since: float | None = None
        """Since when the connection waits for a next request (None: busy, or no request yet)."""
        self._held_for: Any = None
        """The response cycle whose head ``StepWrites`` held (one head per cycle)."""

    @classmethod
    def configured(cls, settings: Settings) -> type[EdgeProtocol]:
        """This protocol with the deadlines of ``settings``."""
        return type(cls.__name__, (cls,), {"head_timeout_s": settings.gateway_head_timeout_s,
                                          "body_timeout_s": settings.gateway_body_timeout_s})

    # -- connection -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(StepWrites(transport, self.loop, self._holds_head))  # type: ignore[arg-type]
        self._since = self.loop.time()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        super().connection_lost(exc)

    def _unset_keepalive_if_required(self) -> None:
        """The connection is busy (uvicorn calls this on every read): the keep-alive timer, if
        set, finds it so when it runs out."""
        self._idle_since = None

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        since = self._idle_since
        if since is None or self.transport.is_closing():
            return
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
            return
        self.timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        was_head = self._in_head
        self._began_here = False
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
            return
        if self._in_head and self._begun:
            # A head still unfinished: its finished parts, and the reads that went wholly into it
            # after the one it began in (httptools holds an unfinished header line in memory).
            if was_head and not self._began_here:
                self._head_raw += len(data)
            if self._head_raw > MAX_HEAD_BYTES or self._head_size() > MAX_HEAD_BYTES:
                self._too_large = True
                self.send_400_response("")
                return
        self._arm()

    # -- parser callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:
            self._in_head = True
            self._since = self.loop.time()
        self._begun = self._began_here = True
        self._head_raw = 0

    def on_headers_complete(self) -> None:
        if self._head_size() > MAX_HEAD_BYTES:
            self._too_large = True
            raise _HeadTooLarge
        self._in_head = self._begun = False
        self._in_body = True
        self._since = self.loop.time()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self.transport.release()  # type: ignore[attr-defined]  # a head without a body (HEAD)
        # uvicorn's ``on_response_complete``, except that the keep-alive timer is not armed and
        # cancelled for every request: one stays set while the connection is busy and is moved
        # on when it finds the connection idle for less than the timeout (``_keep_alive_due``).
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_since = None
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self._idle_since = self.loop.time()
            if self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)
        if self._in_head or self._in_body:
            # The server's wait is over (a request queued behind this response is now served):
            # the client's time for what it still owes counts from here.
            self._since = self.loop.time()
            self._arm()

    def _holds_head(self) -> bool:
        """Whether a write (into an empty buffer) is the head of a response of known, non-empty
        length that was just started: its body follows, so the head waits for it (``StepWrites``)."""
        cycle = self.cycle
        if (cycle is None or cycle is self._held_for or not cycle.response_started or cycle.response_complete
                or cycle.chunked_encoding is not False or cycle.expected_content_length <= 0):
            return False
        self._held_for = cycle
        return True

    def _head_size(self) -> int:
        """Bytes of the head's finished parts: the request line's target and the header lines
        (checked when the head completes and after each read that ends inside one, not per
        header: that runs for every header of every request)."""
        return len(self.url) + sum([len(name) + len(value) + 4 for name, value in self.headers])

    # -- deadlines --------------------------------------------------------------------------------

    def _arm(self) -> None:
        if self._in_head:
            at = self._since + self.head_timeout_s
        elif self._in_body:
            at = self._since + self.body_timeout_s
        else:
            self._disarm()
            return
        if self._timer is None or at != self._timer_at:
            self._disarm()
            self._timer_at = at
            self._timer = self.loop.call_at(at, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _busy(self) -> bool:
        """The wait is the server's, not the client's: reading is paused, the request waits
        behind a pipelined one, or a head follows a request still being answered."""
        return self.flow.read_paused or bool(self.pipeline) or (
            self._in_head and self.cycle is not None and not self.cycle.response_complete)

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing() or not (self._in_head or self._in_body):
            return
        if self._busy():
            self._since = self.loop.time()
            self._arm()
            return
        if self._in_head:
            if not self._begun:
                self.transport.close()  # nothing sent at all: nobody to answer
                return
            self._refuse(408, f"the request head did not arrive within {self.head_timeout_s:g} s",
                         "request_timeout")
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
            return
        self._refuse(408, f"the request body did not arrive within {self.body_timeout_s:g} s", "request_timeout")

    # -- refusals ---------------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (431 for an oversized head)."""
        if self._too_large:
            self._refuse(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes", "head_too_large")
        else:
            self._refuse(400, "invalid HTTP request", "invalid_http")

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._disarm()
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()  # a response is under way: it cannot be replaced, only cut
            return
        body = orjson.dumps(error_body(message, "invalid_request_error", code))
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def gateway_config(app: Any, settings: Settings, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn config of the public gateway port (``kwargs`` override, e.g. ``loop``)."""
    options: dict[str, Any] = {
        "host": settings.gateway_host, "port": settings.gateway_port, "http": EdgeProtocol.configured(settings),
        "lifespan": "on", "access_log": False, "log_config": None, "log_level": settings.log_level.lower(),
        "timeout_graceful_shutdown": settings.gateway_shutdown_grace_s, "proxy_headers": False,
        "server_header": False, "backlog": 4096, "ws": "none",
    }
    options.update(kwargs)
    return uvicorn.Config(app, **options)


def metrics_config(app: Any, settings: Settings, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn config of the internal metrics port (``app.metrics_app``)."""
    options: dict[str, Any] = {
        "host": settings.gateway_metrics_host, "port": settings.gateway_metrics_port, "lifespan": "off",
        "access_log": False, "log_config": None, "log_level": settings.log_level.lower(),
        "timeout_graceful_shutdown": 1, "server_header": False, "ws": "none",
    }
    options.update(kwargs)
    return uvicorn.Config(app.metrics_app, http=EdgeProtocol.configured(settings), **options)


def gateway_servers(app: Any, settings: Settings, **kwargs: Any) -> list[uvicorn.Server]:
    """The metrics server (when ``gateway_metrics_port`` is set) and the public server, in the
    order to start them: the last started gets SIGTERM first (uvicorn chains the signal
    handlers), so the public port drains while metrics are still served."""
    servers = [uvicorn.Server(gateway_config(app, settings, **kwargs))]
    if settings.gateway_metrics_port:
        servers.insert(0, uvicorn.Server(metrics_config(app, settings, **kwargs)))
    return servers


async def serve_all(servers: list[uvicorn.Server]) -> None:
    """Run ``servers`` on this loop until one stops (a signal, a failure), then stop all."""
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)

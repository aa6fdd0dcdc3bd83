"""The gateway's HTTP server protocol: uvicorn's httptools protocol, one send per response.

uvicorn writes a response's head and each body part with a system call of their own
(uvloop sends every ``write`` at once). Each send wakes the client, and on a machine
where the client, the gateway and the workers share a few cores, a woken client often
takes the gateway's core: the gateway is descheduled between the head and the body of
one small response. ``GatewayHttpProtocol`` hands uvicorn a transport that gathers the
writes made in one event-loop step and sends them together right after it: one send per
response (and per burst of SSE events) instead of two or more.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

FLUSH_AT_BYTES = 65536
"""Buffered bytes that are sent at once instead of at the end of the step."""


class CoalescingTransport:
    """Wraps a transport: ``write`` buffers and schedules one flush at the end of the current
    loop step. Whatever could observe the order (close, EOF) flushes first; everything else
    goes to the wrapped transport."""

    __slots__ = ("_buf", "_loop", "_size", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._buf: list[bytes] = []
        self._size = 0

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._buf:
            self._loop.call_soon(self.flush)
        self._buf.append(data)
        self._size += len(data)
        if self._size >= FLUSH_AT_BYTES:
            self.flush()

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if not self._buf:
            return
        buf, self._buf, self._size = self._buf, [], 0
        if not self._transport.is_closing():
            self._transport.write(buf[0] if len(buf) == 1 else b"".join(buf))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through a ``CoalescingTransport``
    (``uvicorn.run(app, http=GatewayHttpProtocol)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

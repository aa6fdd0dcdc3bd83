"""One request's engine events, handed from the engine thread to the asyncio loop that waits."""

from __future__ import annotations

import asyncio
import contextlib

from engine.sequence import SeqEvent


class RequestEvents:
    """Pass :meth:`listener` to ``Engine.add_request``; await :meth:`next` / :meth:`finished`."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[SeqEvent] = asyncio.Queue()

    def listener(self, ev: SeqEvent) -> None:
        """Called on the engine thread for every event of the request."""
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)

    async def next(self) -> SeqEvent:
        return await self._queue.get()

    async def finished(self) -> SeqEvent:
        """The request's final event."""
        while True:
            ev = await self._queue.get()
            if ev.finished:
                return ev

"""One request's engine events, handed from the engine thread to the asyncio loop that waits.

A step produces one event per running request (32 at a time under load). Handing each over with
its own ``call_soon_threadsafe`` costs a wake-up write to the loop's self-pipe on the engine
thread and a selector round on the loop, per token. The loop's :class:`_Pump` collects the
events of a burst and delivers them in one callback: one wake-up per step, however many
requests it served.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque

from engine.sequence import SeqEvent


class _Pump:
    """Events for queues of one loop, delivered in batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: deque[tuple[asyncio.Queue[SeqEvent | None], SeqEvent]] = deque()
        self._scheduled = False

    def push(self, queue: asyncio.Queue[SeqEvent | None], ev: SeqEvent) -> None:
        with self._lock:
            self._pending.append((queue, ev))
            if self._scheduled:
                return  # the callback already on its way delivers this one too
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody waits any more
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            batch = list(self._pending)
            self._pending.clear()
            self._scheduled = False
        for queue, ev in batch:
            queue.put_nowait(ev)


_pumps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pump] = weakref.WeakKeyDictionary()
_pumps_lock = threading.Lock()


def _pump_for(loop: asyncio.AbstractEventLoop) -> _Pump:
    with _pumps_lock:
        pump = _pumps.get(loop)
        if pump is None:
            pump = _pumps[loop] = _Pump(loop)
        return pump


class RequestEvents:
    """Pass :meth:`listener` to ``Engine.add_request``; await :meth:`next` / :meth:`finished`."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[SeqEvent | None] = asyncio.Queue()
        """Engine events, and None for a wake-up (``wake_at``)."""
        self._pump = _pump_for(asyncio.get_running_loop())

    def listener(self, ev: SeqEvent) -> None:
        """Called on the engine thread for every event of the request."""
        self._pump.push(self._queue, ev)

    async def next(self) -> SeqEvent:
        while True:
            ev = await self._queue.get()
            if ev is not None:  # not a wake-up
                return ev

    async def next_or_wake(self) -> SeqEvent | None:
        """The next event, or None when a wake-up (``wake_at``) came first."""
        return await self._queue.get()

    def wake_at(self, when: float) -> asyncio.TimerHandle:
        """Have ``next_or_wake`` return None at loop time ``when`` (one timer, not one per event: a
        stream's quiet check costs nothing per token)."""
        queue = self._queue
        return asyncio.get_running_loop().call_at(when, queue.put_nowait, None)

    async def finished(self) -> SeqEvent:
        """The request's final event."""
        while True:
            ev = await self._queue.get()
            if ev is not None and ev.finished:
                return ev

"""Outlier detection: workers that keep failing are ejected for a while (as Envoy's).

Every attempt on a worker ends as a success or a failure (a connect error, a 5xx of its
own, no first byte within the deadline, a stream that stalled). ``failures`` failures in a
row eject the worker for ``base_s`` x 2^k (k: the ejections in a row before this one),
at most ``max_s``; a success resets the count and k. While ejected a worker is skipped by
the router, unless every candidate is ejected (then it is tried anyway: Envoy's
``max_ejection_percent``). When an ejection ends the worker is back on probation: one more
failure ejects it again, for twice as long.

With Redis, each ejection is also kept there (``SharedEjections``: a key per worker and
gateway, expiring when the ejection ends) so that the console's fleet view shows every
gateway's, whichever process serves it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import orjson

log = logging.getLogger("loraplex.gateway.outliers")

CONNECT = "connect"
STATUS_5XX = "5xx"
FIRST_BYTE = "first_byte_timeout"
STALL = "stall"
BROKE = "broke"
QUIET = "stopped_reporting"
"""Waiting for its first byte, the worker stopped reporting (hung)."""
REASONS = (CONNECT, STATUS_5XX, FIRST_BYTE, STALL, BROKE, QUIET)
"""Why an attempt failed (the label of an ejection)."""


@dataclass(slots=True)
class Ejection:
    until: float
    """``time.time()`` when the ejection ends."""
    reason: str
    """The failure that ejected it (one of ``REASONS``)."""
    streak: int
    """Ejections in a row (this one included): it lasts ``base_s`` x 2^(streak-1), capped."""


@dataclass(slots=True)
class _State:
    failures: int = 0
    """Failures in a row since the last success (or the last ejection)."""
    streak: int = 0
    """Ejections in a row since the last success."""
    until: float = 0.0
    reason: str = ""


class Outliers:
    def __init__(self, failures: int = 3, base_s: float = 5.0, max_s: float = 120.0,
                 on_eject: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.time, shared: SharedEjections | None = None) -> None:
        self.failures = max(1, failures)
        self.base_s = base_s
        self.max_s = max_s
        self.on_eject = on_eject
        """Called with (worker id, reason) on each ejection (the metrics count them)."""
        self._clock = clock
        self.shared = shared
        """Where the fleet's ejections are kept for the console (None: this process's only)."""
        self._state: dict[str, _State] = {}
        self.any_ejected = False
        """Some worker may be ejected (the router skips the check while none is)."""

    def success(self, worker_id: str) -> None:
        if worker_id in self._state:
            st = self._state.pop(worker_id)
            if st.until > self._clock():
                log.info("worker %s answered while ejected: back in", worker_id)
                if self.shared is not None:
                    self.shared.clear(worker_id)
            self.any_ejected = any(s.until for s in self._state.values())

    def failure(self, worker_id: str, reason: str) -> None:
        st = self._state.get(worker_id)
        if st is None:
            st = self._state[worker_id] = _State()
        now = self._clock()
        if st.until > now:
            return  # already ejected (attempts that started before it end now)
        st.failures += 1
        # After an ejection the worker is on probation: one failure ejects it again.
        if st.failures < self.failures and st.streak == 0:
            return
        st.streak += 1
        st.failures = 0
        seconds = min(self.max_s, self.base_s * 2 ** (st.streak - 1))
        st.until = now + seconds
        st.reason = reason
        self.any_ejected = True
        log.warning("worker %s ejected for %.1fs (%s, ejection %d in a row)", worker_id, seconds, reason, st.streak)
        if self.on_eject is not None:
            self.on_eject(worker_id, reason)
        if self.shared is not None:
            self.shared.publish(worker_id, Ejection(st.until, reason, st.streak))

    def ejected(self, worker_id: str, now: float | None = None) -> bool:
        st = self._state.get(worker_id)
        return st is not None and st.until > (self._clock() if now is None else now)

    def ejections(self) -> dict[str, Ejection]:
        """The workers ejected now."""
        now = self._clock()
        out = {w: Ejection(st.until, st.reason, st.streak) for w, st in self._state.items() if st.until > now}
        if not out:
            self.any_ejected = False
        return out

    async def fleet(self) -> dict[str, Ejection]:
        """The workers ejected now by any gateway (``shared``), else by this one."""
        if self.shared is not None:
            try:
                return await self.shared.read()
            except Exception as exc:
                log.warning("reading the fleet's ejections failed (%s); showing this gateway's", type(exc).__name__)
        return self.ejections()

    def forget(self, keep: set[str]) -> None:
        """Drop the state of workers no longer known (``keep``: the live ones), but for an ejection
        still running: a hung worker leaves the live set, and when it comes back it is still out."""
        now = self._clock()
        for w in [w for w, st in self._state.items() if w not in keep and st.until <= now]:
            del self._state[w]


class SharedEjections:
    """Ejections in Redis: ``{prefix}:ejected:{worker}:{gateway}`` holds one gateway's ejection of
    a worker (JSON ``Ejection``) and expires when it ends. Written in the background (a failed
    write is only logged: routing never waits for Redis); read by the console."""

    def __init__(self, redis: Any, prefix: str = "loraplex") -> None:
        self._r = redis
        self._prefix = f"{prefix}:ejected:"
        self._gateway = uuid.uuid4().hex[:12]
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop (a test calling from outside one): nothing to share with
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def publish(self, worker_id: str, ejection: Ejection) -> None:
        ms = int((ejection.until - time.time()) * 1000)
        if ms > 0:
            self._spawn(self._put(self._prefix + f"{worker_id}:{self._gateway}", orjson.dumps(asdict(ejection)), ms))

    def clear(self, worker_id: str) -> None:
        self._spawn(self._put(self._prefix + f"{worker_id}:{self._gateway}", None, 0))

    async def _put(self, key: str, value: bytes | None, ms: int) -> None:
        """Set (for ``ms``) or, with ``value`` None, delete one key; a failure is only logged."""
        try:
            if value is None:
                await self._r.delete(key)
            else:
                await self._r.set(key, value, px=ms)
        except Exception as exc:
            log.warning("sharing an ejection in Redis failed (%s)", type(exc).__name__)

    async def read(self) -> dict[str, Ejection]:
        """Per worker, the ejection that ends last among every gateway's."""
        keys = [k async for k in self._r.scan_iter(match=self._prefix + "*", count=500)]
        if not keys:
            return {}
        out: dict[str, Ejection] = {}
        now = time.time()
        for key, raw in zip(keys, await self._r.mget(keys), strict=True):
            if not raw:
                continue
            name = key.decode() if isinstance(key, bytes) else key
            worker = name[len(self._prefix):].rsplit(":", 1)[0]
            e = Ejection(**orjson.loads(raw))
            if e.until > now and (worker not in out or e.until > out[worker].until):
                out[worker] = e
        return out

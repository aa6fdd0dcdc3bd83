"""Where workers publish their residency/load reports and the gateway reads them.

``MemoryResidency`` (a process-global table, the embedded default) or ``RedisResidency``
(one key per worker with a TTL plus a sorted set of ids), chosen by configuration.
"""

from __future__ import annotations

import time
from typing import Protocol

from loraplex.wire import WorkerReport


class ResidencyStore(Protocol):
    async def publish(self, report: WorkerReport, ttl_s: float) -> None: ...

    async def remove(self, worker_id: str) -> None: ...

    async def live(self) -> list[WorkerReport]:
        """Reports of workers whose last report has not expired."""
        ...


class MemoryResidency:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, WorkerReport]] = {}

    async def publish(self, report: WorkerReport, ttl_s: float) -> None:
        self._reports[report.worker_id] = (time.monotonic() + ttl_s, report)

    async def remove(self, worker_id: str) -> None:
        self._reports.pop(worker_id, None)

    async def live(self) -> list[WorkerReport]:
        now = time.monotonic()
        for wid in [w for w, (exp, _) in self._reports.items() if exp < now]:
            del self._reports[wid]
        return [r for _, r in self._reports.values()]


_PROCESS_RESIDENCY = MemoryResidency()


def process_residency() -> MemoryResidency:
    """The residency table shared by every component of this process (embedded mode)."""
    return _PROCESS_RESIDENCY


class RedisResidency:
    def __init__(self, redis, prefix: str = "loraplex") -> None:  # redis.asyncio.Redis
        self._r = redis
        self._ids = f"{prefix}:workers"
        self._key = f"{prefix}:worker:"

    async def publish(self, report: WorkerReport, ttl_s: float) -> None:
        ms = max(1, int(ttl_s * 1000))
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(self._key + report.worker_id, report.to_json(), px=ms)
            pipe.zadd(self._ids, {report.worker_id: time.time() + ttl_s})
            await pipe.execute()

    async def remove(self, worker_id: str) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(self._key + worker_id)
            pipe.zrem(self._ids, worker_id)
            await pipe.execute()

    async def live(self) -> list[WorkerReport]:
        now = time.time()
        await self._r.zremrangebyscore(self._ids, "-inf", now)
        ids = await self._r.zrange(self._ids, 0, -1)
        if not ids:
            return []
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        raws = await self._r.mget([self._key + i for i in ids])
        return [WorkerReport.from_json(raw) for raw in raws if raw]

"""Recent adapter traffic, published for workers' warm start.

Requests per adapter version are counted in memory and added to Redis about once a second:
``{prefix}:adapter-traffic`` (sorted set: version id -> requests) and ``{prefix}:adapter-refs``
(hash: version id -> ``AdapterRef`` JSON), both expiring ``ttl_s`` after the last flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson

log = logging.getLogger("loraplex.gateway.traffic")


class AdapterTraffic:
    def __init__(self, redis: Any, prefix: str, *, interval_s: float = 1.0, ttl_s: float = 86400.0) -> None:
        self.redis = redis
        self.scores_key = f"{prefix}:adapter-traffic"
        self.refs_key = f"{prefix}:adapter-refs"
        self.interval_s = interval_s
        self.ttl_s = int(ttl_s)
        self._counts: dict[str, int] = {}
        self._refs: dict[str, dict[str, Any]] = {}
        self._known: set[str] = set()

    def record(self, ref: dict[str, Any]) -> None:
        """Count one request for ``ref`` (an ``AdapterRef`` dict)."""
        aid = ref["id"]
        self._counts[aid] = self._counts.get(aid, 0) + 1
        if aid not in self._known:
            self._refs[aid] = ref

    async def flush(self) -> None:
        if not self._counts:
            return
        counts, refs = self._counts, self._refs
        self._counts, self._refs = {}, {}
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for aid, n in counts.items():
                    pipe.zincrby(self.scores_key, n, aid)
                if refs:
                    pipe.hset(self.refs_key, mapping={aid: orjson.dumps(r) for aid, r in refs.items()})
                pipe.expire(self.scores_key, self.ttl_s)
                pipe.expire(self.refs_key, self.ttl_s)
                await pipe.execute()
            self._known.update(refs)
        except Exception as exc:  # Redis down: keep the counts for the next flush
            log.debug("adapter traffic flush failed: %s", exc)
            for aid, n in counts.items():
                self._counts[aid] = self._counts.get(aid, 0) + n
            self._refs.update(refs)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            with contextlib.suppress(Exception):
                await self.flush()

"""Live numbers per adapter version over the last few minutes, for the console.

Each request that reached a worker adds to a 10-second bucket of its version (``name@version``
or ``base``): requests, errors (5xx), cold loads (the worker's ``x-loraplex-cache: cold``) and
its time to first token (streamed requests; at most ``TTFT_KEEP`` per bucket and version).
The console reads ``WINDOW_S`` seconds of buckets: requests/s, error rate, TTFT p50/p99 and
cold loads per version, and each version's ``series`` (per bucket: its start, requests, errors
and TTFT p50) for the live page's charts.

TTFT is the time to the first streamed token: a non-streamed answer arrives whole, so its
requests count everywhere but carry no TTFT (a version with only those shows none).

With Redis every gateway replica publishes its buckets every ``PUBLISH_S`` to
``{prefix}:live:{replica}`` (expiring after ``3 * WINDOW_S``) and the console merges every
replica's, so any gateway's console shows the whole fleet's traffic; embedded, a process's own.
Versions are capped (``MAX_VERSIONS`` per bucket, the rest as ``other``) so a flood of
versions cannot grow memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import orjson

log = logging.getLogger("loraplex.gateway.live")

BUCKET_S = 10
WINDOW_S = 300
PUBLISH_S = 5.0
TTFT_KEEP = 200
MAX_VERSIONS = 1000

Bucket = dict[str, list[Any]]
"""version -> [requests, errors, cold, [ttft s...]]"""


class LiveStats:
    def __init__(self, redis: Any = None, prefix: str = "loraplex") -> None:
        self._buckets: dict[int, Bucket] = {}
        self._redis = redis
        self._key = f"{prefix}:live:{uuid.uuid4().hex[:12]}"
        self._pattern = f"{prefix}:live:*"

    def record(self, version: str, status: int, ttft_s: float | None, cold: bool) -> None:
        b = int(time.time()) // BUCKET_S
        bucket = self._buckets.get(b)
        if bucket is None:
            bucket = self._buckets[b] = {}
            for old in [k for k in self._buckets if k <= b - WINDOW_S // BUCKET_S]:
                del self._buckets[old]
        row = bucket.get(version)
        if row is None:
            if len(bucket) >= MAX_VERSIONS:
                version = "other"
            row = bucket.setdefault(version, [0, 0, 0, []])
        row[0] += 1
        row[1] += status >= 500
        row[2] += cold
        if ttft_s is not None and len(row[3]) < TTFT_KEEP:
            row[3].append(round(ttft_s, 4))

    def _window(self) -> dict[int, Bucket]:
        first = int(time.time()) // BUCKET_S - WINDOW_S // BUCKET_S + 1
        return {k: v for k, v in self._buckets.items() if k >= first}

    async def publish(self) -> None:
        """Put this replica's window where the other replicas' consoles read it (with Redis)."""
        if self._redis is not None:
            data = orjson.dumps({str(k): v for k, v in self._window().items()})
            await self._redis.set(self._key, data, ex=3 * WINDOW_S)

    async def publish_forever(self) -> None:
        """``publish`` every ``PUBLISH_S`` (a failure is logged and retried)."""
        if self._redis is None:
            return
        while True:
            await asyncio.sleep(PUBLISH_S)
            try:
                await self.publish()
            except Exception as exc:  # Redis down: the console shows what it can
                log.warning("publishing live numbers failed: %s", exc)

    async def _all(self) -> list[dict[int, Bucket]]:
        mine = self._window()
        if self._redis is None:
            return [mine]
        out = [mine]
        with contextlib.suppress(Exception):  # Redis down: this replica's numbers only
            keys = [k async for k in self._redis.scan_iter(match=self._pattern, count=500)
                    if (k.decode() if isinstance(k, bytes) else k) != self._key]
            for raw in await self._redis.mget(keys) if keys else []:
                if raw:
                    out.append({int(k): v for k, v in orjson.loads(raw).items()})
        return out

    async def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per version over the window: requests, requests_per_s, error_rate, ttft_p50_s, ttft_p99_s,
        cold_loads, streamed (requests with a TTFT, up to ``TTFT_KEEP`` a bucket) and ``series``:
        ``[bucket start (epoch s), requests, errors, TTFT p50 s or None]`` per bucket with traffic."""
        first = int(time.time()) // BUCKET_S - WINDOW_S // BUCKET_S + 1
        merged: dict[str, list[Any]] = {}
        per_bucket: dict[str, dict[int, list[Any]]] = {}
        for replica in await self._all():
            for b, bucket in replica.items():
                if b < first:
                    continue
                for version, (n, err, cold, ttfts) in bucket.items():
                    for row in (merged.setdefault(version, [0, 0, 0, []]),
                                per_bucket.setdefault(version, {}).setdefault(b, [0, 0, 0, []])):
                        row[0] += n
                        row[1] += err
                        row[2] += cold
                        row[3].extend(ttfts)
        out = {}
        for version, (n, err, cold, ttfts) in merged.items():
            ttfts.sort()
            series = [[b * BUCKET_S, bn, berr, _pct(sorted(bt), 0.50)]
                      for b, (bn, berr, _, bt) in sorted(per_bucket[version].items())]
            out[version] = {"requests": n, "requests_per_s": round(n / WINDOW_S, 3),
                            "error_rate": round(err / n, 4) if n else 0.0, "cold_loads": cold,
                            "ttft_p50_s": _pct(ttfts, 0.50), "ttft_p99_s": _pct(ttfts, 0.99),
                            "streamed": len(ttfts), "series": series}
        return out


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]

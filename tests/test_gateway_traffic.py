"""Adapter traffic counts reach Redis for workers' warm start (real Redis)."""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from gateway.traffic import AdapterTraffic


def _ref(i: int) -> dict:
    return {"id": f"id-{i}", "name": f"bot@{i}", "uri": f"/a/{i}", "sha256": None, "rank": 8}


async def test_counts_and_refs_are_flushed_and_ranked(redis_url, redis_prefix):
    r = aioredis.Redis.from_url(redis_url)
    t = AdapterTraffic(r, redis_prefix, ttl_s=60)
    for i, n in ((1, 5), (2, 1), (3, 9)):
        for _ in range(n):
            t.record(_ref(i))
    await t.flush()
    t.record(_ref(2))
    await t.flush()
    top = await r.zrevrange(f"{redis_prefix}:adapter-traffic", 0, -1, withscores=True)
    assert [(m.decode(), s) for m, s in top] == [("id-3", 9.0), ("id-1", 5.0), ("id-2", 2.0)]
    refs = await r.hgetall(f"{redis_prefix}:adapter-refs")
    assert json.loads(refs[b"id-3"]) == _ref(3)
    assert 0 < await r.ttl(f"{redis_prefix}:adapter-traffic") <= 60
    await r.aclose()


async def test_redis_down_keeps_counts_for_the_next_flush(redis_url, redis_prefix):
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    t = AdapterTraffic(dead, redis_prefix)
    t.record(_ref(1))
    t.record(_ref(1))
    await t.flush()  # fails quietly
    live = aioredis.Redis.from_url(redis_url)
    t.redis = live
    await t.flush()
    assert await live.zscore(f"{redis_prefix}:adapter-traffic", "id-1") == 2.0
    assert await live.hexists(f"{redis_prefix}:adapter-refs", "id-1")
    await live.aclose()
    await dead.aclose()

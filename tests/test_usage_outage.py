"""The usage ledger through a PostgreSQL outage: a cluster of the test's own (``tests.fault_fleet``)
is stopped while a gateway's ledger keeps taking requests. Its flushes fail and are counted, the
buckets wait (bounded) and are written when PostgreSQL answers again; meanwhile another gateway
rolled the hour they belong to up, so they arrive late: every width is still exact."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.metrics import GatewayMetrics
from gateway.usage_ledger import LedgerFlusher, UsageLedger
from loraplex.settings import Settings
from registry.migrate import upgrade_async
from registry.usage import DAY, HOUR, UsageStore, roll_up, totals
from tests.fault_fleet import PrivatePostgres

pytestmark = pytest.mark.e2e  # a PostgreSQL cluster of its own, started and stopped

H = 1_700_000_000 - 1_700_000_000 % DAY + 5 * HOUR  # an hour's start


@pytest.fixture(scope="module")
def cluster():
    pg = PrivatePostgres()
    try:
        pg.create()
        asyncio.run(upgrade_async(pg.url))
        yield pg
    finally:
        pg.drop()


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _sample(metrics: GatewayMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


async def test_buckets_wait_through_an_outage_and_land_exactly(cluster):
    settings = Settings(database_url=cluster.url)
    store = UsageStore(settings)
    clock = Clock(H + 10 * 60)
    ledger = UsageLedger(clock)
    metrics = GatewayMetrics()
    metrics.track_usage()
    flusher = LedgerFlusher(ledger, store.write, gateway="g-outage", metrics=metrics, write_timeout_s=10)
    sent = {"requests": 0, "tokens": 0}

    def traffic(n: int) -> None:
        for i in range(n):
            ledger.record(f"t{i % 3}", "bot", "bot-v1", "ok" if i % 4 else "cancelled", 10 + i, i % 5, 3, 1)
            sent["requests"] += 1
            sent["tokens"] += 10 + i + 3
            clock.t += 7

    try:
        traffic(20)
        assert await flusher.flush()
        cluster.stop()
        down = time.monotonic()
        traffic(40)
        assert not await flusher.flush()
        traffic(40)
        assert not await flusher.flush()
        assert flusher.pending > 0 and flusher.dropped == 0
        assert _sample(metrics, "loraplex_gateway_usage_flush_failures_total") == 2
        assert _sample(metrics, "loraplex_gateway_usage_pending_buckets") == flusher.pending
        await asyncio.sleep(max(0.0, 20 - (time.monotonic() - down)))  # PostgreSQL away for 20 s
        cluster.start()
        # Another gateway rolls the hour (and its day) up before this one's buckets arrive.
        other = UsageStore(settings)
        try:
            await roll_up(other.engine, H + DAY + HOUR)
        finally:
            await other.close()
        traffic(5)
        assert await flusher.flush()
        assert flusher.pending == 0 and flusher.dropped == 0
        assert _sample(metrics, "loraplex_gateway_usage_pending_buckets") == 0
        await roll_up(store.engine, H + 3 * DAY)
        for width in ("m", "h", "d"):
            got = (await totals(store.engine, width=width, by=()))[()]
            assert (got.requests, got.prompt_tokens + got.completion_tokens) == (sent["requests"], sent["tokens"]), \
                width
        by_minute = await totals(store.engine, by=("tenant", "outcome"))
        by_hour = await totals(store.engine, width="h", by=("tenant", "outcome"))
        assert by_minute == by_hour
    finally:
        await store.close()

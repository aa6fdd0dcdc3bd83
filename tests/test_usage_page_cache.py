"""Finished days' pages kept by each engine (``registry.usage_query.FinishedPages``), on PostgreSQL
and SQLite: a kept page is byte for byte what an engine with nothing kept reads (the general path),
a day still open is read afresh every time, and a late minute added to a finished day (a gateway
back from an outage) is in the very next page read. Ledger rows are written the way gateways write
them (``apply_flush``, ``roll_up``)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from sqlalchemy import delete

from registry.db import make_engine, session_factory
from registry.migrate import upgrade_async
from registry.models import UsageBucket, UsageFlush, UsageLateWrites, UsageRollup, UsageTenantDay
from registry.usage import DAY, HOUR, apply_flush, roll_up, totals
from registry.usage_query import FinishedPages, finished_pages, parse_usage_query, read_usage
from tests.usage_support import fresh, page

D0 = 1_765_000_000 - 1_765_000_000 % DAY
"""A finished day (rolled up); ``D0 + DAY`` is today, still open."""
NOW = D0 + DAY + 5 * HOUR


def row(start: int, tenant: str, outcome: str = "ok", n: int = 1, alias: str = "bot", version: str = "v1"
        ) -> tuple[Any, ...]:
    return (start, tenant, alias, version, outcome, n, 40 * n, 10 * n, 7 * n, 1)


def day_of_traffic(day: int, tenants: int = 30) -> list[tuple[Any, ...]]:
    """Minutes of ``tenants`` tenants over the day, some on two aliases and with refused requests."""
    out = []
    for i in range(tenants):
        t = f"tenant-{i:02}"
        out.append(row(day + (i * 37 % 1440) * 60, t, n=1 + i % 5))
        if i % 3 == 0:
            out.append(row(day + (i * 53 % 1440) * 60, t, alias="tiny", version="", n=2))
        if i % 4 == 0:
            out.append(row(day + (i * 11 % 1440) * 60, t, outcome="429:tokens", n=1))
    return sorted(out)


@pytest.fixture
async def engines(db_url):
    """Two engines on one ledger: the first finished day rolled up, today's minutes not yet."""
    await upgrade_async(db_url)
    one, two = make_engine(db_url), make_engine(db_url)
    async with one.begin() as conn:  # the PostgreSQL database is the module's: start empty
        for model in (UsageBucket, UsageFlush, UsageRollup, UsageLateWrites, UsageTenantDay):
            await conn.execute(delete(model))
    assert await apply_flush(one, "g1", 1, day_of_traffic(D0), now=D0 + DAY)
    assert await apply_flush(one, "g1", 2, day_of_traffic(D0 + DAY, tenants=12), now=NOW)
    await roll_up(one, NOW)
    yield one, two, db_url
    await one.dispose()
    await two.dispose()


def q_day(day: int, days: int = 1, **more: str) -> Any:
    params = {"start_time": [str(day)], "end_time": [str(day + days * DAY)], "bucket_width": ["1d"],
              "group_by": ["tenant"], **{k: [v] for k, v in more.items()}}
    return parse_usage_query(params, max_rows=10_000, now=NOW)


def requests_by_tenant(body: bytes) -> dict[str, int]:
    return {r["tenant"]: r["num_model_requests"] for b in orjson.loads(body)["data"] for r in b["results"]}


async def minutes_by_tenant(engine, day: int) -> dict[str, int]:
    got = await totals(engine, width="m", by=("tenant",), start=day, end=day + DAY)
    return {k[0]: v.requests for k, v in got.items()}


async def test_a_finished_day_is_kept_and_equals_the_general_path(engines):
    one, two, url = engines
    kept = finished_pages(one)
    for q in (q_day(D0), q_day(D0, group_by="outcome"), q_day(D0 - 2 * DAY, days=3),
              q_day(D0, tenants="tenant-03,tenant-04")):
        first = await page(one, q)
        assert await page(one, q) == first
        assert await page(two, q) == first
        assert await fresh(url, q) == first
    assert (kept.misses, kept.hits, len(kept)) == (4, 4, 4)
    assert requests_by_tenant(await page(one, q_day(D0))) == await minutes_by_tenant(one, D0)
    async with session_factory(one)() as s:  # read_usage (GET /v1/usage) reads the same page
        assert await read_usage(s, q_day(D0)) == orjson.loads(await page(two, q_day(D0)))


async def test_a_day_still_open_is_read_afresh_every_time(engines):
    one, _, url = engines
    kept = finished_pages(one)
    today, across = q_day(D0 + DAY), q_day(D0, days=2)
    before = await page(one, today)
    assert before == await fresh(url, today)
    assert requests_by_tenant(before) == await minutes_by_tenant(one, D0 + DAY)
    across_before = await page(one, across)
    assert await apply_flush(one, "g2", 1, [row(NOW - 60, "tenant-03", n=5), row(NOW - 60, "newcomer")], now=NOW)
    after = await page(one, today)
    assert after != before and after == await fresh(url, today)
    assert requests_by_tenant(after) == await minutes_by_tenant(one, D0 + DAY)
    assert requests_by_tenant(after)["newcomer"] == 1
    assert await page(one, across) != across_before
    hour = parse_usage_query({"start_time": [str(D0)], "bucket_width": ["1h"], "group_by": ["tenant"]},
                             max_rows=10_000, now=D0 + DAY)  # hours are pruned in time: never kept
    assert await page(one, hour) == await fresh(url, hour)
    assert (kept.misses, kept.hits, len(kept)) == (0, 0, 0)


async def test_a_late_minute_in_a_finished_day_is_in_the_next_page(engines):
    one, two, url = engines
    q = q_day(D0)
    before = await page(one, q)
    assert await page(one, q) == before and finished_pages(one).hits == 1
    assert await page(two, q) == before
    late = [row(D0 + 10 * 60, "tenant-05", n=3), row(D0 + 20 * HOUR, "late-tenant", outcome="cancelled")]
    assert await apply_flush(one, "g9", 1, late, now=NOW)
    for engine in (one, two):  # each had the page kept at the count before the late flush
        after = await page(engine, q)
        assert after != before and after == await fresh(url, q)
        assert requests_by_tenant(after) == await minutes_by_tenant(one, D0)
        assert requests_by_tenant(after)["late-tenant"] == 1
        assert await page(engine, q) == after
    assert finished_pages(one).hits == 2 and finished_pages(two).hits == 1


def test_finished_pages_keep_one_count_and_their_budget():
    a, b, c = (q_day(D0 + i * DAY) for i in range(3))
    kept = FinishedPages(budget=100)
    assert kept.get(a, 0) is None
    kept.put(a, 0, b"x" * 40)
    kept.put(b, 0, b"y" * 40)
    assert kept.get(a, 0) == b"x" * 40  # a is now the most recently read
    kept.put(c, 0, b"z" * 40)  # over the budget: b goes
    assert (kept.get(b, 0), kept.bytes, len(kept)) == (None, 80, 2)
    kept.put(a, 0, b"w" * 150)  # larger than the whole budget: not kept, a stays as it was
    assert kept.get(a, 0) == b"x" * 40
    assert kept.get(a, 1) is None and len(kept) == 0  # another count: the rows changed
    kept.put(a, 0, b"x" * 40)  # read at the count before: maybe stale, not kept
    assert len(kept) == 0
    kept.put(a, 1, b"v" * 10)
    assert kept.get(a, 1) == b"v" * 10 and (kept.hits, kept.bytes) == (3, 10)

"""Finished days' results kept per tenant (``usage_tenant_days``, ``registry.usage_tenant_days``),
on PostgreSQL and SQLite: the rollup renders a day in the transaction that closes it, so the
first read of a day by tenant is made of them, byte for byte the page summed from the ledger;
late minutes (one flush, several at once) render their tenants again; a ledger rolled up before
the table existed is rendered by the next rollups, and read from the ledger until then. SQLite
keeps none and reads every page from the ledger. Ledger rows are written the way gateways write
them (``apply_flush``, ``roll_up``)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from sqlalchemy import delete, func, insert, select, text, update

from registry.db import is_postgres, make_engine, session_factory
from registry.migrate import upgrade_async
from registry.models import UsageBucket, UsageFlush, UsageLateWrites, UsageRollup, UsageTenantDay
from registry.usage import DAY, HOUR, apply_flush, roll_up, totals
from registry.usage_query import finished_pages, parse_usage_query, read_usage_json
from tests.usage_support import fresh, from_the_ledger

D0 = 1_766_000_000 - 1_766_000_000 % DAY
"""The first of three finished days; ``D0 + 3 * DAY`` is today, still open."""
NOW = D0 + 3 * DAY + 5 * HOUR
TENANTS = 40


def row(start: int, tenant: str, outcome: str = "ok", n: int = 1, alias: str = "bot", version: str = "v1"
        ) -> tuple[Any, ...]:
    return (start, tenant, alias, version, outcome, n, 40 * n, 10 * n, 7 * n, 1)


def traffic(day: int, tenants: int = TENANTS) -> list[tuple[Any, ...]]:
    """Minutes of ``tenants`` tenants over the day, some on two aliases and with refused requests
    (names that JSON escapes among them)."""
    out = []
    for i in range(tenants):
        t = f"tenant-{i:02}" if i % 9 else f'tenant "{i:02}"\\é'
        out.append(row(day + (i * 37 % 1440) * 60, t, n=1 + i % 5))
        if i % 3 == 0:
            out.append(row(day + (i * 53 % 1440) * 60, t, alias="tiny", version="", n=2))
        if i % 4 == 0:
            out.append(row(day + (i * 11 % 1440) * 60, t, outcome="429:tokens", n=1))
        if i % 7 == 0:
            out.append(row(day + (i * 13 % 1440) * 60, t, outcome="cancelled", n=3))
    return sorted(out)


@pytest.fixture
async def ledger(db_url):
    """Three finished days rolled up (the second one empty), today's minutes not yet."""
    await upgrade_async(db_url)
    engine = make_engine(db_url)
    async with engine.begin() as conn:  # the PostgreSQL database is the module's: start empty
        for model in (UsageBucket, UsageFlush, UsageRollup, UsageLateWrites, UsageTenantDay):
            await conn.execute(delete(model))
    assert await apply_flush(engine, "g1", 1, traffic(D0), now=D0 + DAY)
    assert await apply_flush(engine, "g1", 2, traffic(D0 + 2 * DAY, tenants=25), now=D0 + 3 * DAY)
    assert await apply_flush(engine, "g1", 3, traffic(D0 + 3 * DAY, tenants=12), now=NOW)
    done = await roll_up(engine, NOW, max_steps=200)
    assert done.days == 2 and done.rendered == 0  # the empty day is passed over
    yield engine, db_url
    await engine.dispose()


def q_days(day: int, days: int = 1, **more: str) -> Any:
    params = {"start_time": [str(day)], "end_time": [str(day + days * DAY)], "bucket_width": ["1d"],
              "group_by": ["tenant"], **{k: [v] for k, v in more.items()}}
    return parse_usage_query(params, max_rows=10_000, now=NOW)


QUERIES = (q_days(D0), q_days(D0, days=3), q_days(D0 + DAY), q_days(D0, tenants="tenant-03"),
           q_days(D0 - DAY, days=4, tenants='tenant-04,tenant-10,nobody,tenant "09"\\é'))


async def kept(engine) -> dict[int, int]:
    """Results kept per day."""
    async with engine.connect() as conn:
        rows = (await conn.execute(select(UsageTenantDay.day, func.count()).group_by(UsageTenantDay.day))).all()
    return {int(d): int(n) for d, n in rows}


async def marks(engine) -> dict[str, int]:
    async with engine.connect() as conn:
        return {w: int(u) for w, u in (await conn.execute(select(UsageRollup.width, UsageRollup.done_until))).all()}


def requests_by_tenant(body: bytes) -> dict[str, int]:
    return {r["tenant"]: r["num_model_requests"] for b in orjson.loads(body)["data"] for r in b["results"]}


async def minutes_by_tenant(engine, day: int) -> dict[str, int]:
    got = await totals(engine, width="m", by=("tenant",), start=day, end=day + DAY)
    return {k[0]: v.requests for k, v in got.items()}


async def test_the_rollup_renders_a_day_as_it_closes_it_and_its_first_read_is_made_of_them(ledger):
    engine, url = ledger
    if not is_postgres(url):  # SQLite keeps none: every page from the ledger
        assert await kept(engine) == {} and "t" not in await marks(engine)
    else:
        assert await kept(engine) == {D0: TENANTS, D0 + 2 * DAY: 25}
        assert (await marks(engine))["t"] == D0 + 3 * DAY
    for q in QUERIES:
        assert await fresh(url, q) == await from_the_ledger(url, q)
    assert requests_by_tenant(await fresh(url, q_days(D0))) == await minutes_by_tenant(engine, D0)
    if is_postgres(url):  # the first read is the rows kept: a row changed by hand shows
        async with engine.begin() as conn:
            await conn.execute(update(UsageTenantDay).where(UsageTenantDay.tenant == "tenant-03")
                               .values(result='{"marked":1}'))
        assert b'{"marked":1}' in await fresh(url, q_days(D0, days=3))
        assert b'{"marked":1}' not in await from_the_ledger(url, q_days(D0, days=3))


async def test_a_late_minute_renders_its_tenants_again(ledger):
    engine, url = ledger
    before = await fresh(url, q_days(D0))
    late = [row(D0 + 10 * 60, "tenant-05", n=3), row(D0 + 10 * 60, "tenant-05", outcome="5xx:no_worker"),
            row(D0 + 20 * HOUR, "late-tenant", outcome="cancelled"), row(D0 + 2 * DAY + HOUR, "tenant-01")]
    assert await apply_flush(engine, "g9", 1, sorted(late), now=NOW)
    if is_postgres(url):
        assert await kept(engine) == {D0: TENANTS + 1, D0 + 2 * DAY: 25}
    for q in QUERIES:
        assert await fresh(url, q) == await from_the_ledger(url, q)
    after = await fresh(url, q_days(D0))
    assert after != before
    assert requests_by_tenant(after) == await minutes_by_tenant(engine, D0)
    assert requests_by_tenant(after)["late-tenant"] == 1


async def test_late_flushes_at_once_render_exactly(ledger):
    """Gateways back from an outage flush late minutes of the same tenants and days at once, each
    to day rows of its own (another outcome): no bucket row makes one wait for the other."""
    engine, url = ledger
    writers = [make_engine(url) for _ in range(4)]
    outcomes = ("ok", "cancelled", "429:tokens", "5xx:no_worker")

    async def flushes(i: int) -> None:
        for seq in range(1, 9):
            rows = [row(D0 + (i * 60 + seq) * 60, f"tenant-{t:02}", outcome=outcomes[i]) for t in range(1, TENANTS, 3)]
            rows.append(row(D0 + 2 * DAY + seq * 60, f"new-{seq % 3}", outcome=outcomes[i]))
            assert await apply_flush(writers[i], f"late-{i}", seq, sorted(rows), now=NOW)

    try:
        await asyncio.wait_for(asyncio.gather(*(flushes(i) for i in range(4))), 120)
    finally:
        for w in writers:
            await w.dispose()
    for q in QUERIES:
        assert await fresh(url, q) == await from_the_ledger(url, q)
    for day in (D0, D0 + 2 * DAY):
        assert requests_by_tenant(await fresh(url, q_days(day))) == await minutes_by_tenant(engine, day)


async def test_a_ledger_rolled_up_before_the_table_is_rendered_by_the_next_rollups(ledger):
    """As after the upgrade that added the table: no ``t`` watermark, no rows. Pages are read from
    the ledger until the rollup has rendered the days behind, a day per transaction."""
    engine, url = ledger
    async with engine.begin() as conn:
        await conn.execute(delete(UsageTenantDay))
        await conn.execute(delete(UsageRollup).where(UsageRollup.width == "t"))
    expected = {q: await from_the_ledger(url, q) for q in QUERIES}
    for q in QUERIES:
        assert await fresh(url, q) == expected[q]
    assert await apply_flush(engine, "g9", 1, [row(D0 + 60, "tenant-07", n=4)], now=NOW)  # a late minute meanwhile
    done = await roll_up(engine, NOW + 10 * 60, max_steps=200)
    assert done.days == 0
    if is_postgres(url):
        assert done.rendered == 2
        assert await kept(engine) == {D0: TENANTS, D0 + 2 * DAY: 25}
        assert (await marks(engine))["t"] == D0 + 3 * DAY
    for q in QUERIES:
        assert await fresh(url, q) == await from_the_ledger(url, q)
    assert requests_by_tenant(await fresh(url, q_days(D0)))["tenant-07"] == (await minutes_by_tenant(engine, D0))[
        "tenant-07"]
    again = await roll_up(engine, D0 + 4 * DAY + HOUR, max_steps=200)  # today closes: rendered as it is rolled up
    assert again.days == 1 and again.rendered == 0
    if is_postgres(url):
        assert (await kept(engine))[D0 + 3 * DAY] == 12
    assert await fresh(url, q_days(D0 + 3 * DAY)) == await from_the_ledger(url, q_days(D0 + 3 * DAY))


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite keeps no results per tenant
async def test_a_page_is_in_tenant_order_whatever_the_rows_order_on_disk_and_the_plan(ledger):
    """The results kept are written back in reverse key order and read with index scans off: a
    sequential scan then meets them backwards, so only the read's own ORDER BY puts the page in
    tenant order, byte for byte the page summed from the ledger."""
    engine, url = ledger
    expected = {q: await from_the_ledger(url, q) for q in QUERIES}
    async with engine.begin() as conn:
        kept_rows = (await conn.execute(select(UsageTenantDay.day, UsageTenantDay.tenant, UsageTenantDay.result)
                                        .order_by(UsageTenantDay.day.desc(), UsageTenantDay.tenant.desc()))).all()
        await conn.execute(delete(UsageTenantDay))
        await conn.execute(insert(UsageTenantDay), [{"day": d, "tenant": t, "result": r} for d, t, r in kept_rows])
    reader = make_engine(url)
    try:
        for q in QUERIES:
            async with session_factory(reader)() as s:
                await s.execute(text("SET LOCAL enable_indexscan = off"))
                await s.execute(text("SET LOCAL enable_indexonlyscan = off"))
                await s.execute(text("SET LOCAL enable_bitmapscan = off"))
                assert await read_usage_json(s, q) == expected[q]
            finished_pages(reader).clear()
    finally:
        await reader.dispose()

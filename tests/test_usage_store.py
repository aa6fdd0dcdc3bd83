"""The usage ledger in the registry database, on PostgreSQL and SQLite: a flush is applied once
however often it is retried, gateways flushing at once add up exactly, rollups to hours and days
equal the minutes (late minutes included, while rollups run), pruning keeps what it must."""

from __future__ import annotations

import asyncio
import random

import pytest
from sqlalchemy import delete, func, select

from gateway.usage_ledger import LedgerFlusher, UsageLedger
from registry.db import make_engine
from registry.migrate import upgrade_async
from registry.models import UsageBucket, UsageFlush, UsageRollup, UsageTenantDay
from registry.usage import ADVISORY_KEY, DAY, HOUR, FlushInDoubt, apply_flush, prune, roll_up, totals

T0 = 1_700_000_000 - 1_700_000_000 % DAY  # a day's start (UTC)


@pytest.fixture
async def engine(db_url):
    await upgrade_async(db_url)
    eng = make_engine(db_url)
    async with eng.begin() as conn:  # the PostgreSQL database is the module's: start empty
        for model in (UsageBucket, UsageFlush, UsageRollup, UsageTenantDay):
            await conn.execute(delete(model))
    yield eng
    await eng.dispose()


def row(start, tenant="acme", alias="bot", version="bot-v1", result="ok", n=1, p=10, c=2, k=5, peak=1):
    return (start, tenant, alias, version, result, n, p, c, k, peak)


async def test_a_flush_is_applied_once_however_often_it_is_retried(engine):
    rows = [row(T0), row(T0 + 60, result="429:tokens", p=0, c=0, k=0, peak=3)]
    assert await apply_flush(engine, "g1", 1, rows) is True
    assert await apply_flush(engine, "g1", 1, rows) is False  # a retry after an unknown commit outcome
    assert await apply_flush(engine, "g2", 1, rows) is True  # another gateway's seq 1
    got = await totals(engine, by=("tenant", "outcome"))
    assert got[("acme", "ok")].requests == 2 and got[("acme", "ok")].prompt_tokens == 20
    assert got[("acme", "429:tokens")].peak_concurrent == 3


async def test_a_commit_whose_reply_was_lost_is_retried_by_the_flusher_and_counted_once(engine):
    led = UsageLedger(lambda: T0 + 5)
    lost = []

    async def write(gateway, seq, rows):
        applied = await apply_flush(engine, gateway, seq, rows)
        if not lost:
            lost.append(seq)
            raise FlushInDoubt("the connection broke as the commit was answered")
        return applied

    f = LedgerFlusher(led, write, gateway="g1")
    led.record("acme", "bot", "bot-v1", "ok", 10, 3, 5, 1)
    assert not await f.flush()
    assert await f.flush()  # the same seq again: the database says it is applied already
    got = await totals(engine, by=("tenant",))
    assert (got[("acme",)].requests, got[("acme",)].prompt_tokens, got[("acme",)].cached_tokens) == (1, 10, 3)


async def test_gateways_flushing_at_once_add_up_exactly(engine, db_url):
    """Four gateways, each with its own engine, flush overlapping keys (in varying key sets)
    concurrently: nothing is lost, nothing counted twice, no deadlock."""
    rng = random.Random(7)
    expect: dict[tuple, list[int]] = {}
    engines = [make_engine(db_url) for _ in range(4)]

    async def gateway(i: int) -> None:
        for seq in range(1, 16):
            rows = []
            for tenant in rng.sample(["a", "b", "c", "d", "e"], 3):
                for minute in rng.sample(range(5), 2):
                    r = row(T0 + 60 * minute, tenant, n=1, p=rng.randrange(100), c=0, k=rng.randrange(50),
                            peak=rng.randrange(1, 9))
                    rows.append(r)
                    t = expect.setdefault((tenant,), [0, 0, 0, 0, 0])
                    t[0] += 1
                    t[1] += r[6]
                    t[3] += r[8]
                    t[4] = max(t[4], r[9])
            rows.sort()
            assert await apply_flush(engines[i], f"g{i}", seq, rows)

    try:
        await asyncio.wait_for(asyncio.gather(*(gateway(i) for i in range(4))), 120)
    finally:
        for e in engines:
            await e.dispose()
    got = await totals(engine, by=("tenant",))
    assert {k: [v.requests, v.prompt_tokens, v.cached_tokens, v.completion_tokens, v.peak_concurrent]
            for k, v in got.items()} == expect


def _flat(t):
    return {k: (v.requests, v.prompt_tokens, v.cached_tokens, v.completion_tokens, v.peak_concurrent)
            for k, v in t.items()}


async def test_rollups_equal_the_minutes_and_are_idempotent(engine):
    # Minutes over the last two hours of one day and the first of the next.
    rows = [row(T0 + DAY - 2 * HOUR + 60 * m + 0, tenant=t, p=m + 1, peak=m % 7)
            for m in range(0, 180, 7) for t in ("a", "b")]
    rows.sort()
    assert await apply_flush(engine, "g", 1, rows)
    now = T0 + 2 * DAY + 600
    done = await roll_up(engine, now)
    assert done.hours == 3 and done.days == 2
    minutes = _flat(await totals(engine, by=("tenant", "outcome")))
    assert _flat(await totals(engine, width="h", by=("tenant", "outcome"))) == minutes
    assert _flat(await totals(engine, width="d", by=("tenant", "outcome"))) == minutes
    again = await roll_up(engine, now)
    assert again.hours == 0 and again.days == 0
    assert _flat(await totals(engine, width="d", by=("tenant", "outcome"))) == minutes
    per_hour = _flat(await totals(engine, width="h", by=("tenant",), start=T0 + DAY, end=T0 + DAY + HOUR))
    assert per_hour[("a",)][0] == len([m for m in range(0, 180, 7) if m >= 120])


async def test_an_hour_is_rolled_only_after_its_grace(engine):
    assert await apply_flush(engine, "g", 1, [row(T0 + 30 * 60)])
    assert (await roll_up(engine, T0 + HOUR + 10, grace_s=120)).hours == 0
    assert (await roll_up(engine, T0 + HOUR + 130, grace_s=120)).hours == 1


async def test_late_minutes_land_in_rolled_hours_and_days(engine):
    """A gateway whose database was down flushes minutes of an hour (and a day) already rolled
    up: every width still equals the minutes."""
    assert await apply_flush(engine, "g1", 1, [row(T0 + 10 * 60), row(T0 + HOUR + 60)])
    await roll_up(engine, T0 + DAY + 2 * HOUR)
    late = [row(T0 + 10 * 60, p=7, peak=9), row(T0 + 59 * 60, tenant="z"), row(T0 + DAY + HOUR + 60)]
    assert await apply_flush(engine, "g2", 1, late)
    assert await apply_flush(engine, "g2", 1, late) is False
    minutes = _flat(await totals(engine, by=("tenant", "version", "outcome")))
    await roll_up(engine, T0 + 3 * DAY)  # the rest (the second day) too
    for width in ("h", "d"):
        assert _flat(await totals(engine, width=width, by=("tenant", "version", "outcome"))) == minutes
    assert minutes[("acme", "bot-v1", "ok")] == (4, 37, 8, 20, 9)


async def test_rollups_running_while_gateways_flush_stay_exact(engine, db_url):
    """Flushes into the hours being rolled up, concurrently with rollups from another process:
    whichever wins each race, every width equals the minutes."""
    writers = [make_engine(db_url) for _ in range(2)]
    roller = make_engine(db_url)
    rng = random.Random(3)
    stop = asyncio.Event()

    async def flushes(i: int) -> None:
        for seq in range(1, 41):
            minutes = sorted(rng.sample(range(0, 6 * 60, 3), 4))
            await apply_flush(writers[i], f"g{i}", seq, [row(T0 + 60 * m, tenant=f"t{i}") for m in minutes])
        stop.set()

    async def rollups() -> None:
        now = T0 + 3 * HOUR
        while not stop.is_set():
            await roll_up(roller, now, grace_s=0)
            now += 600  # the watermark moves through the hours being written
            await asyncio.sleep(0)

    try:
        await asyncio.wait_for(asyncio.gather(flushes(0), flushes(1), rollups()), 120)
        await roll_up(roller, T0 + 2 * DAY)
    finally:
        for e in (*writers, roller):
            await e.dispose()
    minutes = _flat(await totals(engine, by=("tenant",)))
    assert minutes[("t0",)][0] == 160
    assert _flat(await totals(engine, width="h", by=("tenant",))) == minutes
    assert _flat(await totals(engine, width="d", by=("tenant",))) == minutes


async def _count(engine, model, **where) -> int:
    q = select(func.count()).select_from(model)
    for k, v in where.items():
        q = q.where(getattr(model, k) == v)
    async with engine.connect() as conn:
        return (await conn.execute(q)).scalar()


async def test_pruning_keeps_what_is_not_rolled_up_and_the_days(engine):
    rows = sorted([row(T0 + 60 * m) for m in range(0, 3 * 60, 30)] + [row(T0 + 20 * DAY + 60)])
    assert await apply_flush(engine, "g", 1, rows, now=T0)
    assert await apply_flush(engine, "g", 2, [row(T0 + 20 * DAY + 120)], now=T0 + 20 * DAY)
    now = T0 + 20 * DAY + 10 * 60  # the last hour (and day) are not complete: not rolled up
    await roll_up(engine, now)
    minutes_before = await _count(engine, UsageBucket, width="m")
    pruned = await prune(engine, now, minute_days=7, hour_days=90)
    # The first day's minutes (rolled, older than 7 days) went; the current hour's stay.
    assert await _count(engine, UsageBucket, width="m") == 2
    assert pruned.pruned == minutes_before - 2 + 1  # and the first flush row (older than a day)
    assert await _count(engine, UsageFlush) == 1
    assert await _count(engine, UsageBucket, width="h") == 3  # hours: 90 days
    pruned = await prune(engine, T0 + 200 * DAY, minute_days=7, hour_days=90)
    assert await _count(engine, UsageBucket, width="h") == 0  # past 90 days, rolled into days
    assert await _count(engine, UsageBucket, width="d") == 1  # days are kept
    total = _flat(await totals(engine, width="d", by=("tenant",)))
    assert total[("acme",)][0] == 6


async def test_one_gateway_rolls_up_at_a_time_on_postgresql(pg_url):
    """While another process holds the advisory lock a round does nothing; then it catches up."""
    import asyncpg

    await upgrade_async(pg_url)
    eng = make_engine(pg_url)
    try:
        async with eng.begin() as conn:
            for model in (UsageBucket, UsageFlush, UsageRollup, UsageTenantDay):
                await conn.execute(delete(model))
        assert await apply_flush(eng, "g", 1, [row(T0 + 60)])
        holder = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            await holder.execute("SELECT pg_advisory_lock($1)", ADVISORY_KEY)
            busy = await roll_up(eng, T0 + DAY + HOUR)
            assert busy.skipped and busy.hours == 0
            await holder.execute("SELECT pg_advisory_unlock($1)", ADVISORY_KEY)
        finally:
            await holder.close()
        done = await roll_up(eng, T0 + DAY + HOUR)
        assert not done.skipped and done.hours == 1 and done.days == 1
    finally:
        await eng.dispose()

"""The usage ledger's storage: gateways' flushes applied exactly once, rollups, pruning, totals.

A gateway hands its minute buckets over in flushes (``gateway.usage_ledger``). ``apply_flush``
adds one flush in one transaction: it inserts the flush's ``UsageFlush`` row (gateway, seq)
first and, when that row was already there (a retry after a commit whose outcome the gateway
never learned), changes nothing; else it adds every bucket to its row (``ON CONFLICT DO UPDATE``:
counts summed, ``peak_concurrent`` the maximum), rows in primary-key order so gateways flushing at
once lock rows in the same order and never deadlock. Its failures say whether the transaction
surely did not commit (``FlushNotApplied``: the gateway may merge the buckets into its next
flush) or might have (``FlushInDoubt``: the gateway retries the same seq with the same rows).

``roll_up`` turns the minutes of every complete hour into hour rows and the hours of every
complete day into day rows, an hour or a day per transaction, and moves the watermark
(``UsageRollup.done_until``) in the same transaction. A minute that arrives late, into an hour
already rolled up, is added by its flush to the hour row as well (and to the day row when that day
is rolled up too): a flush reads the watermarks under a share lock, which the rollup's update of
them waits for, so every minute lands in every width exactly once, however late it comes. Such a
flush also counts itself in ``UsageLateWrites`` for each width it added to, last and in the same
transaction: rows before a watermark change only with that count (what a cached page is kept by).
On PostgreSQL a day's rollup also renders each tenant's result of the day as a page of days by
tenant shows it (``registry.usage_tenant_days``), in the same transaction, and moves the ``t``
watermark with ``d``; a flush adding late minutes to such a day renders its tenants again, before
it counts itself. Days rolled up before those results existed (an upgraded ledger) are rendered
first in each round, a day per transaction, until ``t`` has caught up with ``d``.
``prune`` removes minutes and hours past their retention (only those already rolled up) and the
flush rows past ``FLUSH_KEEP_S``. Both are safe to run from several gateways at once (the
watermark rows serialize them); on PostgreSQL an advisory lock also lets only one gateway work
at a time, the others skipping the round.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import delete, func, literal, select, text, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from registry.models import UsageBucket, UsageFlush, UsageLateWrites, UsageRollup
from registry.usage_tenant_days import render_day, render_tenants

MINUTE, HOUR, DAY = 60, 3600, 86400
FLUSH_KEEP_S = 86400
"""Flush rows are kept this long: a gateway retrying a flush within it can never add it twice
(``gateway.usage_ledger`` gives up on a flush in doubt well before)."""
ROLLUP_GRACE_S = 120
"""An hour is rolled up this long after it ends (a day: once its last hour is): most minutes of a
flush interval plus a retry have arrived by then. Later minutes are still exact (the late path)."""
ADVISORY_KEY = 0x4C50_5553
"""The PostgreSQL advisory lock the rollup and pruning take (``pg_try_advisory_xact_lock``)."""
_KEY = ("width", "start", "tenant", "alias", "version", "outcome")
_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


class Bucket(NamedTuple):
    """One minute's usage of one (tenant, alias, version, outcome), as a gateway flushes it: the
    field order of the plain tuples ``apply_flush`` takes (``gateway.usage_ledger.Row``)."""

    start: int
    tenant: str
    alias: str
    version: str
    outcome: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    peak_concurrent: int


class FlushNotApplied(Exception):
    """The flush surely did not commit (it failed before its commit was sent): nothing was added."""


class FlushInDoubt(Exception):
    """The flush's commit failed or was cut short: it may or may not have been applied."""


def _dialect(conn: AsyncConnection) -> str:
    return conn.dialect.name


def _insert(conn: AsyncConnection) -> Any:
    return (postgresql.insert if _dialect(conn) == "postgresql" else sqlite.insert)(UsageBucket)


def _greatest(conn: AsyncConnection, a: Any, b: Any) -> Any:
    return func.greatest(a, b) if _dialect(conn) == "postgresql" else func.max(a, b)


_COLUMNS = (*_KEY, *_COUNTS, "peak_concurrent")
_UPSERT = ("ON CONFLICT (width, start, tenant, alias, version, outcome) DO UPDATE SET "
           + ", ".join(f"{c} = usage_buckets.{c} + excluded.{c}" for c in _COUNTS)
           + ", peak_concurrent = {greatest}(usage_buckets.peak_concurrent, excluded.peak_concurrent)")
_PG_ADD = text(
    f"INSERT INTO usage_buckets ({', '.join(_COLUMNS)}) "
    "SELECT * FROM unnest(CAST(:width AS varchar[]), CAST(:start AS bigint[]), CAST(:tenant AS varchar[]), "
    "CAST(:alias AS varchar[]), CAST(:version AS varchar[]), CAST(:outcome AS varchar[]), "
    "CAST(:requests AS bigint[]), CAST(:prompt_tokens AS bigint[]), CAST(:cached_tokens AS bigint[]), "
    "CAST(:completion_tokens AS bigint[]), CAST(:peak_concurrent AS integer[])) "
    + _UPSERT.format(greatest="GREATEST"))
"""One statement for any number of rows, in the arrays' order (the rows' key order: the row locks
are taken in it). A multi-row VALUES statement costs the gateway's loop about 0.25 ms a row to build."""
_SQLITE_ADD = text(f"INSERT INTO usage_buckets ({', '.join(_COLUMNS)}) "
                   f"VALUES ({', '.join(':' + c for c in _COLUMNS)}) " + _UPSERT.format(greatest="max"))
"""One row, executed for every row (SQLite's own loop)."""
_PG_BATCH = 50_000


async def _add_rows(conn: AsyncConnection, rows: list[tuple[Any, ...]]) -> None:
    """Add ``rows`` (already in primary-key order) to their buckets: counts summed, peak the max."""
    if not rows:
        return
    if _dialect(conn) != "postgresql":
        await conn.execute(_SQLITE_ADD, [dict(zip(_COLUMNS, r, strict=True)) for r in rows])
        return
    for i in range(0, len(rows), _PG_BATCH):
        part = rows[i:i + _PG_BATCH]
        await conn.execute(_PG_ADD, {c: [r[j] for r in part] for j, c in enumerate(_COLUMNS)})


async def _watermarks(conn: AsyncConnection, *, share: bool) -> dict[str, int] | None:
    """``{'h': done_until, 'd': done_until, 't': done_until}`` (None: the rows are not there yet;
    ``t`` 0 where it is not); ``share``: under a share lock (PostgreSQL), so a rollup moving them
    waits for this transaction, then sees its rows."""
    q = select(UsageRollup.width, UsageRollup.done_until).order_by(UsageRollup.width)
    if share and _dialect(conn) == "postgresql":
        q = q.with_for_update(read=True)
    found = {w: d for w, d in (await conn.execute(q)).all()}
    if "h" not in found or "d" not in found:
        return None
    return {"h": found["h"], "d": found["d"], "t": found.get("t", 0)}


def _late(buckets: Iterable[Sequence[Any]], marks: dict[str, int]) -> dict[tuple[str, int, str, str, str, str], list[int]]:
    """Every bucket's row in each width it belongs to now: its minute, and its hour and day when
    those were rolled up already (a late minute)."""
    out: dict[tuple[str, int, str, str, str, str], list[int]] = {}
    done_h, done_d = marks["h"], marks["d"]
    for b in buckets:
        start, tenant, alias, version, result = b[:5]
        counts = b[5:]
        keys = [("m", start)]
        if start < done_h:
            hour = start - start % HOUR
            keys.append(("h", hour))
            if hour < done_d:
                keys.append(("d", hour - hour % DAY))
        for width, at in keys:
            k = (width, at, tenant, alias, version, result)
            row = out.get(k)
            if row is None:
                out[k] = list(counts)
            else:
                for i in range(4):
                    row[i] += counts[i]
                row[4] = max(row[4], counts[4])
    return out


def _as_rows(merged: dict[tuple[str, int, str, str, str, str], list[int]]) -> list[tuple[Any, ...]]:
    return [(*k, *merged[k]) for k in sorted(merged)]


async def _render_late_days(conn: AsyncConnection, merged: Iterable[tuple[str, int, str, str, str, str]],
                            rendered_until: int) -> None:
    """Render again the results kept per tenant (``registry.usage_tenant_days``) of the day rows
    this flush added to, on the days rendered already."""
    tenants: dict[int, set[str]] = {}
    for width, at, tenant, *_ in merged:
        if width == "d" and at < rendered_until:
            tenants.setdefault(at, set()).add(tenant)
    if tenants:
        await render_tenants(conn, tenants)


async def _count_late(conn: AsyncConnection, widths: Iterable[str]) -> None:
    """Count this flush in ``UsageLateWrites`` for each rolled-up width it added rows to. Last in
    the flush and in width order: a flush holds the row's lock only until its commit, with every
    bucket row written already, so flushes never wait for each other in a cycle."""
    for width in sorted(widths):
        ins = (postgresql.insert if _dialect(conn) == "postgresql" else sqlite.insert)(UsageLateWrites)
        await conn.execute(ins.values(width=width, flushes=1).on_conflict_do_update(
            index_elements=[UsageLateWrites.width], set_={"flushes": UsageLateWrites.flushes + 1}))


async def apply_flush(engine: AsyncEngine, gateway: str, seq: int, buckets: Sequence[Sequence[Any]],
                      now: float | None = None) -> bool:
    """Add one flush of ``gateway`` in one transaction: True when applied now, False when
    (gateway, seq) was applied before (nothing changes). Raises ``FlushNotApplied`` or
    ``FlushInDoubt`` when the database failed."""
    applied_at = int(time.time() if now is None else now)
    committing = False
    try:
        async with engine.connect() as conn:
            trans = await conn.begin()
            try:
                # First a write: on SQLite it takes the write lock before anything is read.
                flush = (postgresql.insert if _dialect(conn) == "postgresql" else sqlite.insert)(UsageFlush)
                inserted = await conn.execute(flush.values(gateway=gateway, seq=seq, applied_at=applied_at)
                                              .on_conflict_do_nothing().returning(UsageFlush.seq))
                if inserted.first() is None:
                    await trans.rollback()
                    return False
                marks = await _watermarks(conn, share=True)
                if marks is None:  # before the first rollup: create them, then lock them
                    await _ensure_marks(conn)
                    marks = await _watermarks(conn, share=True)
                    assert marks is not None
                merged = _late(buckets, marks)
                await _add_rows(conn, _as_rows(merged))
                if _dialect(conn) == "postgresql":
                    await _render_late_days(conn, merged, marks["t"])
                await _count_late(conn, {k[0] for k in merged} - {"m"})
            except BaseException:
                if trans.is_active:
                    await trans.rollback()
                raise
            committing = True
            await trans.commit()
            return True
    except (FlushNotApplied, FlushInDoubt):
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        if committing:
            raise FlushInDoubt(f"{type(exc).__name__}: {exc}") from exc
        if isinstance(exc, Exception):
            raise FlushNotApplied(f"{type(exc).__name__}: {exc}") from exc
        raise  # cancelled before its commit: nothing was applied, and the caller is told so


# -- rollups and pruning ---------------------------------------------------------------------------


@dataclass(slots=True)
class Maintenance:
    """What one ``roll_up``/``prune`` round did (for the log and the tests)."""

    hours: int = 0
    days: int = 0
    pruned: int = 0
    rendered: int = 0
    """Days whose results per tenant were rendered behind the days rolled (``registry.usage_tenant_days``)."""
    skipped: bool = False
    """Another process held the advisory lock: this round did nothing."""


async def _lock(conn: AsyncConnection) -> bool:
    """This transaction may roll up and prune (PostgreSQL: the advisory lock; SQLite: always,
    its write lock already serializes writers)."""
    if _dialect(conn) != "postgresql":
        return True
    return bool((await conn.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": ADVISORY_KEY})).scalar())


async def _ensure_marks(conn: AsyncConnection) -> None:
    """The watermark rows (at 0: nothing rolled up yet), so that a flush always finds rows to
    lock and a rollup always finds rows to update; on PostgreSQL ``t`` too (results kept per
    tenant and day: none yet)."""
    pg = _dialect(conn) == "postgresql"
    widths = ("d", "h", "t") if pg else ("d", "h")
    ins = (postgresql.insert if pg else sqlite.insert)(UsageRollup)
    await conn.execute(ins.values([{"width": w, "done_until": 0} for w in widths]).on_conflict_do_nothing())


async def _mark(conn: AsyncConnection, width: str) -> int | None:
    return (await conn.execute(select(UsageRollup.done_until).where(UsageRollup.width == width))).scalar()


async def _move(conn: AsyncConnection, widths: Sequence[str], until: int) -> None:
    await conn.execute(update(UsageRollup).where(UsageRollup.width.in_(widths)).values(done_until=until))


async def _roll(engine: AsyncEngine, width: str, limit: int) -> bool | None:
    """Roll one hour (``width`` 'h', from minutes) or one day ('d', from hours) whose end is at
    most ``limit``, and move its watermark in the same transaction. False: nothing to do; None:
    another process holds the advisory lock. A day's results per tenant (``t``, PostgreSQL) are
    rendered in that transaction too, when they were caught up with the days."""
    size, source = (HOUR, "m") if width == "h" else (DAY, "h")
    async with engine.begin() as conn:
        if not await _lock(conn):
            return None
        # A write before any read: SQLite's write lock; PostgreSQL's row lock on the watermark,
        # which waits for the flushes holding it shared (their rows are then visible below).
        await conn.execute(update(UsageRollup).where(UsageRollup.width == width)
                           .values(done_until=UsageRollup.done_until))
        done = await _mark(conn, width)
        if done is None or done + size > limit:
            return False
        # Days rendered up to the days rolled: they move on together (the day rows are written below).
        moving = [width, "t"] if width == "d" and await _mark(conn, "t") == done else [width]
        nxt = (await conn.execute(select(func.min(UsageBucket.start)).where(
            UsageBucket.width == source, UsageBucket.start >= done))).scalar()
        if nxt is None or nxt - nxt % size + size > limit:  # nothing complete to roll: skip to the limit
            until = limit - limit % size
            if until > done:
                await _move(conn, moving, until)
            return False
        start = nxt - nxt % size
        b = UsageBucket.__table__.c
        group = [b.tenant, b.alias, b.version, b.outcome]
        picked = select(literal(width), literal(start), *group, func.sum(b.requests), func.sum(b.prompt_tokens),
                        func.sum(b.cached_tokens), func.sum(b.completion_tokens), func.max(b.peak_concurrent)
                        ).where(b.width == source, b.start >= start, b.start < start + size
                                ).group_by(*group).order_by(*group)
        stmt = _insert(conn).from_select([*_KEY, *_COUNTS, "peak_concurrent"], picked)
        ex = stmt.excluded
        sets: dict[str, Any] = {c: b[c] + ex[c] for c in _COUNTS}
        sets["peak_concurrent"] = _greatest(conn, b.peak_concurrent, ex.peak_concurrent)
        await conn.execute(stmt.on_conflict_do_update(index_elements=list(_KEY), set_=sets))
        if "t" in moving:
            await render_day(conn, start)
        await _move(conn, moving, start + size)
        return True


async def _render_behind(engine: AsyncEngine) -> bool | None:
    """Render the results per tenant of the next day before the day watermark that has day rows
    and is not rendered yet (an existing ledger, after the upgrade that added them), and move
    ``t`` past it: False when ``t`` has caught up (moved to the day watermark), None when another
    process holds the advisory lock. PostgreSQL only."""
    async with engine.begin() as conn:
        if not await _lock(conn):
            return None
        # Both rows locked: the flushes holding them shared are done, and their rows visible below.
        await conn.execute(update(UsageRollup).where(UsageRollup.width.in_(("d", "t")))
                           .values(done_until=UsageRollup.done_until))
        rendered, days = await _mark(conn, "t"), await _mark(conn, "d")
        if rendered is None or days is None or rendered >= days:
            return False
        nxt = (await conn.execute(select(func.min(UsageBucket.start)).where(
            UsageBucket.width == "d", UsageBucket.start >= rendered, UsageBucket.start < days))).scalar()
        if nxt is None:
            await _move(conn, ["t"], days)
            return False
        await render_day(conn, nxt)
        await _move(conn, ["t"], nxt + DAY)
        return True


async def roll_up(engine: AsyncEngine, now: float | None = None, *, grace_s: int = ROLLUP_GRACE_S,
                  max_steps: int = 48) -> Maintenance:
    """Roll complete hours into hour rows and complete days into day rows, one per transaction,
    at most ``max_steps`` of each this round (a backlog is worked off over later rounds)."""
    now = int(time.time() if now is None else now)
    done = Maintenance()
    async with engine.begin() as conn:
        await _ensure_marks(conn)
    for _ in range(max_steps):
        rolled = await _roll(engine, "h", now - grace_s)
        if not rolled:
            done.skipped = rolled is None
            if done.skipped:
                return done
            break
        done.hours += 1
    async with engine.connect() as conn:
        marks = await _watermarks(conn, share=False)
        pg = _dialect(conn) == "postgresql"
    for _ in range(max_steps):  # days whose results per tenant are behind the days rolled: first
        rendered = await _render_behind(engine) if pg else False
        if not rendered:
            done.skipped = rendered is None
            if done.skipped:
                return done
            break
        done.rendered += 1
    for _ in range(max_steps):
        rolled = None if marks is None else await _roll(engine, "d", marks["h"])
        if not rolled:
            done.skipped = rolled is None and marks is not None
            break
        done.days += 1
    return done


async def _prune_slice(engine: AsyncEngine, width: str, cutoff: int, size: int) -> int | None:
    """Delete the oldest ``size`` seconds of ``width`` rows before ``cutoff`` (and before what is
    rolled up): the rows deleted, None when nothing is left to delete."""
    async with engine.begin() as conn:
        if not await _lock(conn):
            return None
        if width == "f":
            keys = select(UsageFlush.gateway, UsageFlush.seq).where(UsageFlush.applied_at < cutoff).limit(5000)
            res = await conn.execute(delete(UsageFlush).where(
                tuple_(UsageFlush.gateway, UsageFlush.seq).in_(keys)))
            return res.rowcount or None
        marks = await _watermarks(conn, share=False)
        if marks is None:
            return None
        end = min(cutoff, marks["h" if width == "m" else "d"])
        first = (await conn.execute(select(func.min(UsageBucket.start)).where(
            UsageBucket.width == width, UsageBucket.start < end))).scalar()
        if first is None:
            return None
        res = await conn.execute(delete(UsageBucket).where(
            UsageBucket.width == width, UsageBucket.start < min(end, first - first % size + size)))
        return res.rowcount or 0


async def prune(engine: AsyncEngine, now: float | None = None, *, minute_days: int = 7, hour_days: int = 90,
                max_steps: int = 24) -> Maintenance:
    """Remove minutes older than ``minute_days`` and hours older than ``hour_days`` (only what is
    rolled up; days are kept), an hour's minutes or a day's hours per transaction, and flush rows
    older than ``FLUSH_KEEP_S``, 5000 per transaction; at most ``max_steps`` transactions of each."""
    now = int(time.time() if now is None else now)
    done = Maintenance()
    for width, cutoff, size in (("m", now - minute_days * DAY, HOUR), ("h", now - hour_days * DAY, DAY),
                                ("f", now - FLUSH_KEEP_S, 0)):
        for _ in range(max_steps):
            n = await _prune_slice(engine, width, cutoff, size)
            if n is None:
                break
            done.pruned += n
    return done


# -- reading ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    peak_concurrent: int = 0


async def totals(engine: AsyncEngine | str, *, width: str = "m", by: Sequence[str] = ("tenant", "version"),
                 start: int | None = None, end: int | None = None,
                 tenant: str | None = None) -> dict[tuple[str, ...], Totals]:
    """The ledger summed over ``width`` buckets in [start, end), grouped by the ``by`` columns
    (any of tenant, alias, version, outcome): what a test compares with what clients received.
    ``engine`` may be a database URL (an engine is made for the call)."""
    if isinstance(engine, str):
        from registry.db import make_engine

        own = make_engine(engine)
        try:
            return await totals(own, width=width, by=by, start=start, end=end, tenant=tenant)
        finally:
            await own.dispose()
    b = UsageBucket.__table__.c
    cols = [b[c] for c in by]
    q = select(*cols, func.sum(b.requests), func.sum(b.prompt_tokens), func.sum(b.cached_tokens),
               func.sum(b.completion_tokens), func.max(b.peak_concurrent)).where(b.width == width)
    if start is not None:
        q = q.where(b.start >= start)
    if end is not None:
        q = q.where(b.start < end)
    if tenant is not None:
        q = q.where(b.tenant == tenant)
    q = q.group_by(*cols)
    async with engine.connect() as conn:
        rows = (await conn.execute(q)).all()
    n = len(cols)
    return {tuple(r[:n]): Totals(*(int(v or 0) for v in r[n:])) for r in rows}


class UsageStore:
    """The ledger's database for a gateway: ``write`` (``LedgerFlusher``'s writer) and
    ``maintain`` (rollups and pruning), on an engine of its own connected on first use."""

    def __init__(self, settings: Any, engine: AsyncEngine | None = None) -> None:
        from registry.db import LazyDatabase

        self.settings = settings
        # One flush and one maintenance round at a time: two connections are plenty.
        self._db = LazyDatabase(settings, engine, pool_size=2, max_overflow=2)

    @property
    def engine(self) -> AsyncEngine:
        return self._db.engine

    async def write(self, gateway: str, seq: int, rows: Sequence[Sequence[Any]]) -> bool:
        return await apply_flush(self.engine, gateway, seq, rows)

    async def maintain(self, now: float | None = None) -> Maintenance:
        """One round of rollups, then pruning (``usage_minute_retention_days``,
        ``usage_hour_retention_days``)."""
        done = await roll_up(self.engine, now)
        pruned = await prune(self.engine, now, minute_days=self.settings.usage_minute_retention_days,
                             hour_days=self.settings.usage_hour_retention_days)
        done.pruned = pruned.pruned
        return done

    async def close(self) -> None:
        await self._db.close()

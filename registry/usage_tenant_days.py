"""Finished days' results per tenant, kept as the JSON that ``GET /admin/usage`` answers with.

A page of finished days grouped by tenant (a day of 100k tenants is 100k results) read from the
ledger sums the day rows and renders every result; ``usage_tenant_days`` holds each (day, tenant)
result rendered already (``registry.usage_query.results_select``, the same bytes), so such a page is
its rows joined in tenant order. PostgreSQL only (SQLite reads every page from the ledger).

    await render_day(conn, day)                    # the rollup, in the transaction closing the day
    await render_tenants(conn, {day: {tenant}})    # a flush that added late minutes to day rows

Rows are complete for the days before the ``t`` watermark of ``usage_rollups``, which the rollup
moves (``registry.usage``): with the day watermark when it was caught up (the day is rendered in
the transaction that rolls it up), else a day per transaction until it is (an existing ledger,
after the upgrade). A flush that adds late minutes to days before it renders those tenants' rows
again from their day rows in its own transaction, holding a lock per day taken after its bucket
rows are written: each statement sees what was committed before it began, so the last flush to
render a (day, tenant) sees every other flush's minutes (those committed) or leaves the tenant to
the flush still running, which renders it after.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import String, any_, bindparam, delete, insert, select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import Select

from registry.models import UsageBucket, UsageTenantDay
from registry.usage_query import results_select

DAY = 86400
LOCK_KEY = 0x4C50_5544
"""The first key of the per-day advisory lock (``pg_advisory_xact_lock(key, day number)``; two
32-bit keys, a space apart from the rollup's 64-bit one)."""
_UB = UsageBucket.__table__
_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def _rendered(day: int, tenants: Iterable[str] | None) -> tuple[list[str], Select[Any]]:
    """The columns and the select of ``day``'s results per tenant (only ``tenants``'s, if given)."""
    where = [_UB.c.width == "d", _UB.c.start == day]
    if tenants is not None:
        where.append(_UB.c.tenant == any_(bindparam("tenants", sorted(tenants), type_=postgresql.ARRAY(String))))
    rows = select(_UB.c.start.label("b"), _UB.c.tenant, _UB.c.outcome, *[_UB.c[c] for c in _COUNTS]) \
        .where(*where).subquery("rows")
    items = results_select(rows, ["tenant"]).subquery("items")
    return ["day", "tenant", "result"], select(items.c.b, items.c.tenant, items.c.item)


async def render_day(conn: AsyncConnection, day: int) -> int:
    """Render every tenant's result of ``day`` from its day rows (the rows rendered before are
    replaced): how many tenants it has. The table is analyzed in the same transaction (a sample
    of 30,000 rows whatever its size): a planner that has never seen the day's rows estimates a
    few hundred and sorts the day's 20 MB (100k tenants) on disk instead of reading them in key
    order, which the first read of the day would pay (about 1 s)."""
    await conn.execute(delete(UsageTenantDay).where(UsageTenantDay.day == day))
    columns, picked = _rendered(day, None)
    done = await conn.execute(insert(UsageTenantDay).from_select(columns, picked))
    await conn.execute(text("ANALYZE usage_tenant_days"))
    return int(done.rowcount or 0)


async def render_tenants(conn: AsyncConnection, tenants: Mapping[int, Iterable[str]]) -> None:
    """Render again the results of these tenants on these days (day -> tenants), each day under
    its lock, in day order (two flushes lock days in the same order)."""
    for day in sorted(tenants):
        await conn.execute(text("SELECT pg_advisory_xact_lock(:k, :d)"), {"k": LOCK_KEY, "d": day // DAY})
        columns, picked = _rendered(day, tenants[day])
        stmt = postgresql.insert(UsageTenantDay).from_select(columns, picked)
        await conn.execute(stmt.on_conflict_do_update(index_elements=["day", "tenant"],
                                                      set_={"result": stmt.excluded.result}))

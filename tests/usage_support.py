"""Shared helpers for the usage ledger's page tests: a page as ``GET /admin/usage`` reads it, and
the same page summed from the ledger's rows (the results kept per tenant and day left aside)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from registry.db import make_engine, session_factory
from registry.models import UsageRollup
from registry.usage_query import UsageQuery, finished_pages, read_usage_json


async def page(engine: Any, q: UsageQuery) -> bytes:
    """The page read by ``engine`` (its kept pages included)."""
    async with session_factory(engine)() as s:
        return await read_usage_json(s, q)


async def fresh(url: str, q: UsageQuery) -> bytes:
    """The page read by an engine with nothing kept (the first read of a finished day)."""
    engine = make_engine(url)
    try:
        body = await page(engine, q)
        assert finished_pages(engine).hits == 0
        return body
    finally:
        await engine.dispose()


async def from_the_ledger(url: str, q: UsageQuery) -> bytes:
    """The page summed from the ledger's rows: read with the ``t`` watermark at 0 (no day's
    results kept per tenant), which is then put back."""
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            rendered = (await conn.execute(select(UsageRollup.done_until).where(UsageRollup.width == "t"))).scalar()
            await conn.execute(update(UsageRollup).where(UsageRollup.width == "t").values(done_until=0))
        try:
            return await fresh(url, q)
        finally:
            if rendered is not None:
                async with engine.begin() as conn:
                    await conn.execute(update(UsageRollup).where(UsageRollup.width == "t").values(done_until=rendered))
    finally:
        await engine.dispose()

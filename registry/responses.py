"""Stored Responses in the registry database: written by the gateway replica that answered, read
by any replica, always by tenant (another tenant's id reads as missing), removed once expired.

Each row keeps what a continuation needs in one read: the items the model saw before the turn
(``context``), the turn's input items and the Response object (whose ``output`` follows them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from loraplex.settings import Settings
from registry.db import LazyDatabase
from registry.errors import unavailable_on_database_failure
from registry.models import StoredResponse, Tenant

log = logging.getLogger("loraplex.registry.responses")


@dataclass(frozen=True, slots=True)
class Stored:
    id: str
    tenant: str
    depth: int
    adapter: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]

    def conversation(self) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including this response's output."""
        return [*self.context, *self.input_items, *self.response.get("output", [])]


def retention_s(settings: Settings, tenant_retention_s: int | None) -> int:
    """The tenant's retention (or the default), never past the maximum."""
    wanted = settings.response_retention_s if tenant_retention_s is None else tenant_retention_s
    return max(0, min(wanted, settings.response_max_retention_s))


class ResponseStore:
    """The stored Responses; every method raises ``registry.errors.Unavailable`` (503
    ``store_unavailable``) when the database fails, never the driver's exception."""

    def __init__(self, settings: Settings, engine: AsyncEngine | None = None) -> None:
        self.settings = settings
        self._db = LazyDatabase(settings, engine)

    @property
    def _session(self) -> async_sessionmaker[AsyncSession]:
        """Sessions on the registry database, connected on first use (a gateway that never stores
        a response never opens it)."""
        return self._db.sessions

    @staticmethod
    def _database(tail: str) -> unavailable_on_database_failure:
        """A database failure as ``registry.errors.Unavailable`` (503 ``store_unavailable``)."""
        return unavailable_on_database_failure(tail, code="store_unavailable")

    async def close(self) -> None:
        await self._db.close()

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's unexpired response ``response_id`` (None for a missing, expired or foreign id)."""
        async with self._database("nothing was read"), self._session() as s:
            row = (await s.execute(select(StoredResponse).where(
                StoredResponse.id == response_id, StoredResponse.tenant == tenant,
                StoredResponse.expires_at > datetime.now(UTC)))).scalar_one_or_none()
        if row is None:
            return None
        return Stored(row.id, row.tenant, row.depth, row.adapter, row.response, row.input_items, row.context)

    async def put(self, *, tenant: str, response: dict[str, Any], input_items: list[dict[str, Any]],
                  context: list[dict[str, Any]], previous: Stored | None, adapter: str) -> None:
        """Keep ``response`` for the tenant's retention (none: nothing is written)."""
        now = datetime.now(UTC)
        async with self._database("the response was not stored"), self._session.begin() as s:
            own = (await s.execute(select(Tenant.response_retention_s).where(Tenant.slug == tenant))).scalar()
            keep_s = retention_s(self.settings, own)
            if keep_s <= 0:
                return
            s.add(StoredResponse(id=response["id"], tenant=tenant, created_at=now,
                                 expires_at=now + timedelta(seconds=keep_s),
                                 previous_id=previous.id if previous else None,
                                 depth=previous.depth + 1 if previous else 1, model=response["model"],
                                 adapter=adapter, response=response, input_items=input_items, context=context))

    async def delete(self, tenant: str, response_id: str) -> bool:
        async with self._database("nothing was deleted"), self._session.begin() as s:
            done = cast(CursorResult[Any], await s.execute(delete(StoredResponse).where(
                StoredResponse.id == response_id, StoredResponse.tenant == tenant)))
        return bool(done.rowcount)

    async def purge(self, batch: int = 500) -> int:
        """Delete up to ``batch`` expired rows (call again while it returns ``batch``)."""
        async with self._database("nothing was removed"), self._session.begin() as s:
            ids = select(StoredResponse.id).where(StoredResponse.expires_at <= datetime.now(UTC)).limit(batch)
            done = cast(CursorResult[Any], await s.execute(
                delete(StoredResponse).where(StoredResponse.id.in_(ids.scalar_subquery()))))
        return int(done.rowcount or 0)

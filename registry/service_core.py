"""The registry database: one transaction per write with its audit rows and a bump of the
registry version (announced after commit), and reads. The operations on top of it:
``registry.service`` (the admin API's), ``registry.canary``, ``registry.supply``, the console;
the row lookups they share: ``registry.lookups``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from loraplex.settings import Settings
from registry.changes import ChangeBus
from registry.db import make_engine, resolve_url, session_factory
from registry.errors import refused_or_unavailable_on_database_failure, unavailable_on_database_failure
from registry.models import AuditEntry, RegistryState, utcnow

COMMITTED: ContextVar[int | None] = ContextVar("loraplex_registry_committed", default=None)
"""The registry version the caller's last write committed as (the admin API answers it as
``X-Registry-Version``: a reader whose snapshot version is at least this serves the change)."""


@dataclass
class Change:
    """One audit row of a write: what was done to which row, and the row before and after."""

    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


class Tx:
    """What an operation sees inside its write transaction (``RegistryDatabase.write``)."""

    def __init__(self, session: AsyncSession, version: int) -> None:
        self.session = session
        self.version = version
        self.changes: list[Change] = []

    def audit(self, action: str, target: str, before: dict[str, Any] | None,
              after: dict[str, Any] | None) -> None:
        """Record a change: the transaction commits a registry version only when it has any."""
        self.changes.append(Change(action, target, before, after))

    async def serialize(self, key: str) -> None:
        """Hold a lock on ``key`` until this transaction ends, so writers naming the same key take
        turns (writers no longer queue on one registry-wide lock). SQLite has one writer at a time."""
        bind = self.session.bind
        if bind is not None and bind.dialect.name == "postgresql":
            await self.session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                                       {"key": key})


class RegistryDatabase:
    """The registry's engine, sessions and change bus, and its transactions. One per process;
    safe for concurrent tasks."""

    def __init__(self, settings: Settings, engine: AsyncEngine | None = None, *,
                 bus: ChangeBus | None = None, database_url: str | None = None) -> None:
        self.settings = settings
        self.database_url = resolve_url(settings, engine, database_url)
        self._own_engine = engine is None
        self.engine = engine or make_engine(self.database_url)
        self.sessions = session_factory(self.engine)
        self.bus = bus or ChangeBus(settings, self.database_url)

    @property
    def postgres(self) -> bool:
        """The registry database is PostgreSQL (else SQLite)."""
        return self.bus.postgres

    async def close(self) -> None:
        await self.bus.close()
        if self._own_engine:
            await self.engine.dispose()

    @asynccontextmanager
    async def write(self, actor: str) -> AsyncIterator[Tx]:
        """One write transaction: ``async with db.write(actor) as tx``. When the block records
        changes (``tx.audit``), the version is bumped, the audit rows written and the change
        announced in one statement (``_commit_version``), and it commits; a block that records
        none is rolled back (nothing changed: no version). A refusal by the database is the
        registry's 409 or 422, an outage its 503 ("nothing was changed").

        The block locks only the rows it changes; the one registry-wide row (the version) is
        locked by that last statement and held for the commit alone, so writers to different rows
        do not queue behind each other's work, and versions commit in order (readers rely on it).
        SQLite has one writer at a time anyway: there the bump comes first, so the transaction
        holds the write lock from its first statement (a read first could not be upgraded to a
        write while another writer waits: "database is locked").
        """
        async with refused_or_unavailable_on_database_failure("nothing was changed"):
            try:
                async with self.sessions() as session, session.begin():
                    tx = Tx(session, 0 if self.bus.postgres else await self._bump(session))
                    yield tx
                    if not tx.changes:
                        raise _Unchanged
                    version = tx.version = await self._commit_version(session, actor, tx)
            except _Unchanged:
                return
        COMMITTED.set(version)
        await self.bus.announce_committed(version)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A session to read with: ``async with db.read() as session``; an outage is the
        registry's 503 ("nothing was read"). A write that is no registry change (no version, no
        audit row: the canary judge's bookkeeping) runs here too, in a transaction of its own."""
        async with unavailable_on_database_failure("nothing was read"), self.sessions() as session:
            yield session

    async def _commit_version(self, session: AsyncSession, actor: str, tx: Tx) -> int:
        """Record ``tx.changes`` under a new registry version: on PostgreSQL the bump, the audit
        rows and the NOTIFY are one round trip; on SQLite the version was bumped at the start.
        Returns the new version."""
        actor = (actor or "unknown")[:200]
        if self.bus.postgres:
            rows = json.dumps([{"action": c.action, "target": c.target, "before": c.before, "after": c.after}
                               for c in tx.changes], default=str)
            return int((await session.execute(_COMMIT_PG, {"changes": rows, "actor": actor, "at": utcnow(),
                                                           "channel": self.bus.channel})).scalar_one())
        session.add_all([AuditEntry(registry_version=tx.version, actor=actor, action=c.action, target=c.target,
                                    before=c.before, after=c.after, at=utcnow()) for c in tx.changes])
        await session.flush()
        return tx.version

    @staticmethod
    async def _bump(session: AsyncSession) -> int:
        return int((await session.execute(
            update(RegistryState).where(RegistryState.id == 1)
            .values(version=RegistryState.version + 1, updated_at=utcnow())
            .returning(RegistryState.version))).scalar_one())


_COMMIT_PG = text("""
WITH v AS (
    UPDATE registry_state SET version = version + 1, updated_at = :at WHERE id = 1 RETURNING version
), a AS (
    INSERT INTO audit_log (registry_version, at, actor, action, target, before, after)
    SELECT v.version, :at, :actor, c.action, c.target, c.before, c.after
    FROM v, ROWS FROM (json_to_recordset(CAST(:changes AS json))
                       AS (action text, target text, before json, after json)) WITH ORDINALITY AS c
    ORDER BY c.ordinality
)
SELECT v.version, pg_notify(:channel, v.version::text) FROM v
""")
"""The version bump, the audit rows and the change announcement (delivered on commit) in one
statement: the version row stays locked for this round trip and the commit only."""


class _Unchanged(Exception):
    """A write block that recorded no change: its transaction rolls back."""

"""The registry service's plumbing: one transaction per write with its audit rows and a bump of
the registry version (announced after commit), reads, and the row lookups every operation uses."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import select, text, update
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm.exc import StaleDataError

from loraplex.adapter_store import AdapterStore
from loraplex.settings import Settings
from registry.changes import ChangeBus
from registry.db import make_engine, resolve_url, session_factory
from registry.errors import Conflict, Invalid, NotFound, RegistryError, database_unavailable
from registry.models import (
    AdapterVersion,
    AuditEntry,
    Binding,
    RegistryState,
    Tenant,
    utcnow,
)
from registry.records import UUID, binding_dict

log = logging.getLogger("loraplex.registry")
T = TypeVar("T")
COMMITTED: ContextVar[int | None] = ContextVar("loraplex_registry_committed", default=None)
"""The registry version the caller's last write committed as (the admin API answers it as
``X-Registry-Version``: a reader whose snapshot version is at least this serves the change)."""
@dataclass
class _Change:
    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


class _Tx:
    """What an operation sees inside its write transaction."""

    def __init__(self, session: AsyncSession, version: int) -> None:
        self.session = session
        self.version = version
        self.changes: list[_Change] = []

    def audit(self, action: str, target: str, before: dict[str, Any] | None,
              after: dict[str, Any] | None) -> None:
        self.changes.append(_Change(action, target, before, after))

    async def serialize(self, key: str) -> None:
        """Hold a lock on ``key`` until this transaction ends, so writers naming the same key take
        turns (writers no longer queue on one registry-wide lock). SQLite has one writer at a time."""
        if self.session.bind.dialect.name == "postgresql":
            await self.session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                                       {"key": key})



class ServiceCore:
    """All registry reads and writes. One per process; safe for concurrent tasks."""

    def __init__(self, settings: Settings, engine: AsyncEngine | None = None, *,
                 bus: ChangeBus | None = None, database_url: str | None = None) -> None:
        self.settings = settings
        self.database_url = resolve_url(settings, engine, database_url)
        self._own_engine = engine is None
        self.engine = engine or make_engine(self.database_url)
        self.sessions = session_factory(self.engine)
        self.bus = bus or ChangeBus(settings, self.database_url)
        self._adapter_store: AdapterStore | None = None

    async def close(self) -> None:
        await self.bus.close()
        if self._own_engine:
            await self.engine.dispose()

    # --- transaction plumbing ----------------------------------------------------------------

    async def _write(self, actor: str, op: Callable[[_Tx], Awaitable[T]]) -> T:
        """Run ``op`` in one write transaction, then bump the version, write its audit rows and
        announce it in one statement (``_commit_version``), and commit.

        ``op`` locks only the rows it changes; the one registry-wide row (the version) is locked
        by that last statement and held for the commit alone, so writers to different rows do not
        queue behind each other's work, and versions commit in order (readers rely on it).
        SQLite has one writer at a time anyway: there the bump comes first, so the transaction
        holds the write lock from its first statement (a read first could not be upgraded to a
        write while another writer waits: "database is locked").
        """
        try:
            async with self.sessions() as session, session.begin():
                tx = _Tx(session, 0 if self.bus.postgres else await self._bump(session))
                result = await op(tx)
                if not tx.changes:
                    raise _NoChange(result)
                version = tx.version = await self._commit_version(session, actor, tx)
        except _NoChange as nc:
            return nc.result  # type: ignore[no-any-return]
        except RegistryError:
            raise
        except StaleDataError:
            raise Conflict("the row changed concurrently; retry", code="concurrent_update") from None
        except IntegrityError as exc:  # the database's text (constraint and row values) goes to the log only
            log.warning("registry write refused by a constraint: %s", _short(exc))
            raise Conflict("the change conflicts with existing registry rows; nothing was changed") from None
        except DataError as exc:
            log.warning("registry write refused by the schema: %s", _short(exc))
            raise Invalid("a value does not fit the registry schema; nothing was changed") from None
        except (DBAPIError, PoolTimeout, OSError, ConnectionError, TimeoutError) as exc:
            raise _unavailable(exc, "nothing was changed") from None
        COMMITTED.set(version)
        await self.bus.announce_committed(version)
        return result

    async def _commit_version(self, session: AsyncSession, actor: str, tx: _Tx) -> int:
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

    async def _read(self, op: Callable[[AsyncSession], Awaitable[T]]) -> T:
        try:
            async with self.sessions() as session:
                return await op(session)
        except RegistryError:
            raise
        except (DBAPIError, PoolTimeout, OSError, ConnectionError, TimeoutError) as exc:
            raise _unavailable(exc, "nothing was read") from None

    # --- lookups -------------------------------------------------------------------------------

    @staticmethod
    async def _tenant(session: AsyncSession, slug: str, lock: bool = False) -> Tenant:
        stmt = select(Tenant).where(Tenant.slug == slug)
        row = (await session.execute(stmt.with_for_update() if lock else stmt)).scalar_one_or_none()
        if row is None:
            raise NotFound(f"tenant {slug!r} does not exist", code="tenant_not_found", param="tenant")
        return row

    @staticmethod
    async def _adapter(session: AsyncSession, ref: str, lock: bool = False) -> AdapterVersion:
        """By id (uuid) or ``name@version``."""
        if not isinstance(ref, str) or not ref:
            raise Invalid(f"adapter must be an id or name@version, got {ref!r}", param="adapter")
        if UUID.match(ref):
            stmt = select(AdapterVersion).where(AdapterVersion.id == ref)
        else:
            name, sep, ver = ref.rpartition("@")
            if not sep or not name or not ver.isdigit():
                raise Invalid(f"adapter must be an id or name@version, got {ref!r}", param="adapter")
            stmt = select(AdapterVersion).where(AdapterVersion.name == name, AdapterVersion.version == int(ver))
        row = (await session.execute(stmt.with_for_update() if lock else stmt)).scalar_one_or_none()
        if row is None:
            raise NotFound(f"adapter {ref!r} does not exist", code="adapter_not_found", param="adapter")
        return row

    @classmethod
    async def _binding(cls, session: AsyncSession, tenant: str, alias: str) -> Binding:
        """The binding, locked; an unknown tenant is told apart only when there is none (a
        binding's tenant exists: the foreign key), so a write costs no tenant lookup."""
        row = (await session.execute(
            select(Binding).where(Binding.tenant == tenant, Binding.alias == alias).with_for_update()
        )).scalar_one_or_none()
        if row is None:
            await cls._tenant(session, tenant)
            raise NotFound(f"tenant {tenant!r} has no alias {alias!r}", code="binding_not_found", param="alias")
        return row

    @staticmethod
    async def _labels(session: AsyncSession, *ids: str | None) -> dict[str, str]:
        wanted = [i for i in ids if i]
        if not wanted:
            return {}
        rows = await session.execute(
            select(AdapterVersion.id, AdapterVersion.name, AdapterVersion.version)
            .where(AdapterVersion.id.in_(wanted)))
        return {r.id: f"{r.name}@{r.version}" for r in rows}

    async def _binding_out(self, session: AsyncSession, b: Binding,
                           known: dict[str, str] | None = None) -> dict[str, Any]:
        """The binding as the API answers it; ``known`` labels (filled in here) are not looked up again."""
        labels = known if known is not None else {}
        missing = [i for i in (b.active_id, b.previous_id, b.canary_id) if i and i not in labels]
        if missing:
            labels.update(await self._labels(session, *missing))
        return binding_dict(b, labels)

    @staticmethod
    def _check_bindable(b_tenant: str, adapter: AdapterVersion, base_model: str | None) -> None:
        if adapter.status != "active":
            raise Invalid(f"adapter {adapter.label} is {adapter.status}; only active versions can be bound",
                          code="adapter_not_active", param="adapter")
        if adapter.owner_tenant is not None and adapter.owner_tenant != b_tenant:
            raise Invalid(f"adapter {adapter.label} belongs to another tenant and cannot be bound to "
                          f"{b_tenant!r}", code="adapter_owner_mismatch", param="adapter")
        if base_model is not None and adapter.base_model != base_model:
            raise Invalid(f"adapter {adapter.label} is for base model {adapter.base_model!r}; the binding "
                          f"serves {base_model!r}", code="base_model_mismatch", param="adapter")


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


class _NoChange(Exception):
    def __init__(self, result: Any) -> None:
        super().__init__("no change")
        self.result = result


def _unavailable(exc: BaseException, tail: str) -> RegistryError:
    """Database errors that are not about the request (``registry.errors.database_unavailable``)."""
    err = database_unavailable(exc, tail)
    if err is None:  # not a database failure: the caller's except clauses name only those
        raise exc
    return err


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.splitlines()[0][:300] if text else type(exc).__name__


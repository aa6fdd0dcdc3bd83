"""Registry operations: every change is one transaction with its audit row and a bump of
the registry version, announced to readers after commit.

The rules it enforces: docs/DESIGN.md, "Registry" and "Bindings, canary, rollback".
Results are JSON-able dicts (what the admin API returns).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import func, or_, select, text, update
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm.exc import StaleDataError

from loraplex.adapter_store import AdapterStore, open_store
from loraplex.modelinfo import ModelInfo, describe_model
from loraplex.settings import Settings
from loraplex.wire import PRIORITY_CLASSES
from registry.admission import AdmissionError, AdmittedAdapter, admit_uri
from registry.changes import ChangeBus
from registry.db import make_engine, resolve_url, session_factory
from registry.errors import Conflict, Invalid, NotFound, PreconditionFailed, RegistryError, Unavailable
from registry.models import (
    AdapterVersion,
    AuditEntry,
    BaseModelRow,
    Binding,
    RegistryState,
    Tenant,
    utcnow,
)

log = logging.getLogger("loraplex.registry")
T = TypeVar("T")

SLUG = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,199}$")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAX_LIMIT = 2**31 - 1
COMMITTED: ContextVar[int | None] = ContextVar("loraplex_registry_committed", default=None)
"""The registry version the caller's last write committed as (the admin API answers it as
``X-Registry-Version``: a reader whose snapshot version is at least this serves the change)."""
DIMENSIONS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "context_length")


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


# --- row -> JSON ------------------------------------------------------------------------------

def _iso(value: datetime | None) -> str | None:
    """ISO 8601 in UTC (SQLite hands timestamps back without their zone)."""
    if value is None:
        return None
    return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).isoformat()


def tenant_dict(t: Tenant) -> dict[str, Any]:
    return {"slug": t.slug, "status": t.status, "requests_per_min": t.requests_per_min,
            "tokens_per_min": t.tokens_per_min, "max_concurrent": t.max_concurrent, "priority": t.priority,
            "response_retention_s": t.response_retention_s, "row_version": t.row_version, "created_at": _iso(t.created_at), "updated_at": _iso(t.updated_at)}


def base_model_dict(b: BaseModelRow) -> dict[str, Any]:
    out = {"name": b.name, "revision": b.revision, "architecture": b.architecture}
    out.update({k: getattr(b, k) for k in DIMENSIONS})
    out["created_at"] = _iso(b.created_at)
    return out


def adapter_dict(a: AdapterVersion) -> dict[str, Any]:
    return {"id": a.id, "name": a.name, "version": a.version, "label": a.label, "base_model": a.base_model,
            "uri": a.uri, "sha256": a.sha256, "size_bytes": a.size_bytes, "rank": a.rank, "alpha": a.alpha,
            "target_modules": list(a.target_modules), "owner_tenant": a.owner_tenant, "status": a.status,
            "status_reason": a.status_reason, "verification": a.verification, "row_version": a.row_version,
            "created_at": _iso(a.created_at)}


def binding_dict(b: Binding, labels: dict[str, str] | None = None) -> dict[str, Any]:
    labels = labels or {}

    def ref(adapter_id: str | None) -> dict[str, str] | None:
        if adapter_id is None:
            return None
        return {"id": adapter_id, "label": labels.get(adapter_id, adapter_id)}

    return {"tenant": b.tenant, "alias": b.alias, "base_model": b.base_model, "active": ref(b.active_id),
            "previous": ref(b.previous_id), "canary": ref(b.canary_id), "canary_percent": b.canary_percent,
            "enabled": b.enabled, "on_disabled": b.on_disabled, "row_version": b.row_version,
            "updated_at": _iso(b.updated_at)}


def audit_dict(e: AuditEntry) -> dict[str, Any]:
    return {"id": e.id, "registry_version": e.registry_version, "at": _iso(e.at), "actor": e.actor,
            "action": e.action, "target": e.target, "before": e.before, "after": e.after}


def _audit_view(d: dict[str, Any]) -> dict[str, Any]:
    """A row's dict as recorded in the audit log (timestamps are in the entry itself)."""
    return {k: v for k, v in d.items() if k not in ("created_at", "updated_at")}


# --- validation ------------------------------------------------------------------------------

def _match(row_version: int | None, if_match: int | None, what: str) -> None:
    """A conditional write: refuse (412) unless the row is at the version the caller read."""
    if if_match is None:
        return
    if isinstance(if_match, bool) or not isinstance(if_match, int):
        raise Invalid(f"row_version must be an integer, got {if_match!r}", param="row_version")
    if row_version != if_match:
        found = "does not exist" if row_version is None else f"is at row_version {row_version}"
        raise PreconditionFailed(f"{what} changed since it was read: it {found}, not {if_match}; read it "
                                 f"again and retry", row_version)


def _slug(value: Any, param: str = "tenant") -> str:
    if not isinstance(value, str) or not SLUG.match(value):
        raise Invalid(f"{param} must be 1-64 characters of a-z, 0-9, '_' or '-', starting with a letter "
                      f"or digit; got {value!r}", param=param)
    return value


def _name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise Invalid(f"{param} must be 1-200 characters of letters, digits and . _ : + -; got {value!r}",
                      param=param)
    return value


def _limit(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
        raise Invalid(f"{param} must be a non-negative integer, got {value!r}", code="invalid_limit", param=param)
    return value


def _priority(value: Any) -> str:
    if value not in PRIORITY_CLASSES:
        raise Invalid(f"priority must be one of {', '.join(PRIORITY_CLASSES)}, got {value!r}",
                      code="invalid_priority", param="priority")
    return str(value)


def _percent(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 < value <= 100:
        raise Invalid(f"canary percent must be a number with 0 < percent <= 100, got {value!r}",
                      code="invalid_percent", param="percent")
    return float(value)


def _on_disabled(value: Any) -> str:
    if value not in ("base", "refuse"):
        raise Invalid(f"on_disabled must be 'base' or 'refuse', got {value!r}", param="on_disabled")
    return str(value)


class RegistryService:
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
        except IntegrityError as exc:
            raise Conflict(f"the change conflicts with existing registry rows: {_short(exc)}") from None
        except DataError as exc:
            raise Invalid(f"a value does not fit the registry schema: {_short(exc)}") from None
        except PoolTimeout as exc:
            raise _busy(exc, "nothing was changed") from None
        except (DBAPIError, OSError, ConnectionError, TimeoutError) as exc:
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
        except PoolTimeout as exc:
            raise _busy(exc, "nothing was read") from None
        except (DBAPIError, OSError, ConnectionError, TimeoutError) as exc:
            raise _unavailable(exc, "try again") from None

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

    # --- tenants -----------------------------------------------------------------------------------

    async def create_tenant(self, slug: str, *, requests_per_min: int = 600, tokens_per_min: int = 100_000,
                            max_concurrent: int = 16, priority: str = "normal", actor: str = "admin") -> dict:
        slug = _slug(slug, "slug")
        values = {"requests_per_min": _limit(requests_per_min, "requests_per_min"),
                  "tokens_per_min": _limit(tokens_per_min, "tokens_per_min"),
                  "max_concurrent": _limit(max_concurrent, "max_concurrent"), "priority": _priority(priority)}

        async def op(tx: _Tx) -> dict:
            if await tx.session.get(Tenant, slug) is not None:
                raise Conflict(f"tenant {slug!r} already exists", code="tenant_exists", param="slug")
            now = utcnow()
            row = Tenant(slug=slug, status="active", created_at=now, updated_at=now, **values)
            tx.session.add(row)
            await tx.session.flush()
            out = tenant_dict(row)
            tx.audit("tenant.create", f"tenant:{slug}", None, _audit_view(out))
            return out

        return await self._write(actor, op)

    async def set_tenant_status(self, slug: str, status: str, *, actor: str = "admin",
                                if_match: int | None = None) -> dict:
        if status not in ("active", "disabled"):
            raise Invalid(f"status must be 'active' or 'disabled', got {status!r}", param="status")

        async def op(tx: _Tx) -> dict:
            row = await self._tenant(tx.session, slug, lock=True)
            _match(row.row_version, if_match, f"tenant {slug!r}")
            before = tenant_dict(row)
            if row.status == status:
                return before
            row.status, row.updated_at = status, utcnow()
            await tx.session.flush()
            out = tenant_dict(row)
            tx.audit("tenant.enable" if status == "active" else "tenant.disable", f"tenant:{slug}",
                     _audit_view(before), _audit_view(out))
            return out

        return await self._write(actor, op)

    async def disable_tenant(self, slug: str, *, actor: str = "admin", if_match: int | None = None) -> dict:
        return await self.set_tenant_status(slug, "disabled", actor=actor, if_match=if_match)

    async def enable_tenant(self, slug: str, *, actor: str = "admin", if_match: int | None = None) -> dict:
        return await self.set_tenant_status(slug, "active", actor=actor, if_match=if_match)

    async def set_tenant_limits(self, slug: str, *, requests_per_min: int | None = None,
                                tokens_per_min: int | None = None, max_concurrent: int | None = None,
                                priority: str | None = None, response_retention_s: int | None = None,
                                actor: str = "admin", if_match: int | None = None) -> dict:
        changes: dict[str, Any] = {}
        for key, value in (("requests_per_min", requests_per_min), ("tokens_per_min", tokens_per_min),
                           ("max_concurrent", max_concurrent), ("response_retention_s", response_retention_s)):
            if value is not None:
                changes[key] = _limit(value, key)
        if priority is not None:
            changes["priority"] = _priority(priority)
        if not changes:
            raise Invalid("give at least one of requests_per_min, tokens_per_min, max_concurrent, priority, "
                          "response_retention_s", code="nothing_to_change")

        async def op(tx: _Tx) -> dict:
            row = await self._tenant(tx.session, slug, lock=True)
            _match(row.row_version, if_match, f"tenant {slug!r}")
            before = tenant_dict(row)
            if all(getattr(row, k) == v for k, v in changes.items()):
                return before
            for key, value in changes.items():
                setattr(row, key, value)
            row.updated_at = utcnow()
            await tx.session.flush()
            out = tenant_dict(row)
            tx.audit("tenant.limits", f"tenant:{slug}", _audit_view(before), _audit_view(out))
            return out

        return await self._write(actor, op)

    async def get_tenant(self, slug: str) -> dict:
        return tenant_dict(await self._read(lambda s: self._tenant(s, slug)))

    async def list_tenants(self, status: str | None = None) -> list[dict]:
        async def op(s: AsyncSession) -> list[dict]:
            stmt = select(Tenant).order_by(Tenant.slug)
            if status:
                stmt = stmt.where(Tenant.status == status)
            return [tenant_dict(t) for t in (await s.execute(stmt)).scalars()]

        return await self._read(op)

    # --- base models ---------------------------------------------------------------------------------

    async def register_base_model(self, info: ModelInfo | dict[str, Any], *, actor: str = "admin") -> dict:
        data = info.to_dict() if isinstance(info, ModelInfo) else dict(info)
        name = _name(data.get("name"), "name")
        revision = data.get("revision")
        if not isinstance(revision, str) or not revision or len(revision) > 128:
            raise Invalid("revision must be a non-empty string (at most 128 characters)", param="revision")
        architecture = data.get("architecture")
        if not isinstance(architecture, str) or not architecture or len(architecture) > 64:
            raise Invalid("architecture must be a non-empty string", param="architecture")
        dims: dict[str, int] = {}
        for key in DIMENSIONS:
            value = data.get(key, 2048 if key == "context_length" else None)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_LIMIT:
                raise Invalid(f"{key} must be a positive integer, got {value!r}", param=key)
            dims[key] = value
        unknown = sorted(set(data) - {"name", "revision", "architecture", *DIMENSIONS})
        if unknown:
            raise Invalid(f"unknown base model fields: {', '.join(unknown)}", param=unknown[0])

        async def op(tx: _Tx) -> dict:
            if await tx.session.get(BaseModelRow, name) is not None:
                raise Conflict(f"base model {name!r} already exists", code="base_model_exists", param="name")
            row = BaseModelRow(name=name, revision=revision, architecture=architecture, created_at=utcnow(), **dims)
            tx.session.add(row)
            await tx.session.flush()
            out = base_model_dict(row)
            tx.audit("base_model.register", f"base_model:{name}", None, _audit_view(out))
            return out

        return await self._write(actor, op)

    async def register_base_model_from_path(self, path: str, *, name: str | None = None,
                                            actor: str = "admin") -> dict:
        """Describe a local model (HF directory or GGUF) with ``ModelInfo`` and register it."""
        try:
            info = await asyncio.to_thread(describe_model, path, name)
        except (OSError, ValueError, KeyError) as exc:
            raise Invalid(f"cannot describe model at {path!r}: {exc}", code="bad_model_path", param="path") \
                from None
        return await self.register_base_model(info, actor=actor)

    async def list_base_models(self) -> list[dict]:
        async def op(s: AsyncSession) -> list[dict]:
            rows = await s.execute(select(BaseModelRow).order_by(BaseModelRow.name))
            return [base_model_dict(b) for b in rows.scalars()]

        return await self._read(op)

    async def base_model_info(self, name: str) -> ModelInfo:
        async def op(s: AsyncSession) -> ModelInfo:
            row = await s.get(BaseModelRow, name)
            if row is None:
                raise NotFound(f"base model {name!r} does not exist", code="base_model_not_found",
                               param="base_model")
            d = base_model_dict(row)
            d.pop("created_at")
            return ModelInfo(**d)

        return await self._read(op)

    # --- adapters ------------------------------------------------------------------------------------

    @property
    def adapter_store(self) -> AdapterStore:
        """The configured adapter store (``LORAPLEX_ADAPTER_STORE``), opened on first use."""
        if self._adapter_store is None:
            self._adapter_store = open_store(self.settings)
        return self._adapter_store

    async def register_adapter(self, name: str, uri: str, base_model: str, *, version: int | None = None,
                               owner: str | None = None, expected_revision: str | None = None,
                               actor: str = "admin", admitted: AdmittedAdapter | None = None,
                               in_tx: Callable[[], Awaitable[None]] | None = None) -> dict:
        """Admit the artifact (outside the transaction), then record it as ``pending``.

        ``admitted``: already admitted (an upload); ``in_tx`` runs inside the write transaction
        before it commits (an upload makes sure its stored files are still there)."""
        name = _name(name, "name")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                    or not 1 <= version <= MAX_LIMIT):
            raise Invalid(f"version must be a positive integer, got {version!r}", param="version")
        if owner is not None:
            _slug(owner, "owner")
        if expected_revision is not None and not isinstance(expected_revision, str):
            raise Invalid("expected_revision must be a string", param="expected_revision")
        if not isinstance(uri, str) or not uri:
            raise Invalid("uri must be a non-empty string", param="uri")
        base = await self.base_model_info(base_model)
        if owner is not None:
            await self._read(lambda s: self._tenant(s, owner))
        try:
            if admitted is None:
                admitted = await admit_uri(uri, base, self.settings, self.adapter_store, expected_revision)
        except AdmissionError as exc:
            log.info("adapter %s refused: %s", name, exc)
            if exc.code == "store_unavailable":
                raise Unavailable(exc.message, code=exc.code) from None
            raise Invalid(f"adapter refused: {exc.message}", code=exc.code, param="uri") from None
        except ValueError as exc:  # LORAPLEX_ADAPTER_STORE is malformed
            raise Unavailable(f"the adapter store is misconfigured: {exc}", code="store_misconfigured") from None
        assert admitted is not None

        async def op(tx: _Tx) -> dict:
            await tx.serialize(f"adapter-name:{name}")  # registrations of one name number in turn
            current = await tx.session.get(BaseModelRow, base.name)
            if current is None or current.revision != base.revision:
                raise Conflict(f"base model {base.name!r} changed during admission; retry",
                               code="base_model_changed")
            if owner is not None:
                await self._tenant(tx.session, owner)
            existing = (await tx.session.execute(
                select(AdapterVersion.owner_tenant, func.max(AdapterVersion.version))
                .where(AdapterVersion.name == name).group_by(AdapterVersion.owner_tenant))).all()
            if any(o != owner for o, _ in existing):
                raise Conflict(f"adapter name {name!r} is registered under another owner",
                               code="adapter_name_taken", param="name")
            latest = max((v for _, v in existing), default=0)
            ver = version if version is not None else latest + 1
            if version is not None and (await tx.session.execute(
                    select(AdapterVersion.id).where(AdapterVersion.name == name,
                                                    AdapterVersion.version == version))).first():
                raise Conflict(f"adapter {name}@{version} already exists", code="adapter_version_exists",
                               param="version")
            row = AdapterVersion(
                name=name, version=ver, base_model=base.name, uri=admitted.uri, sha256=admitted.sha256,
                size_bytes=admitted.size_bytes, rank=admitted.rank, alpha=admitted.alpha,
                target_modules=admitted.target_modules, owner_tenant=owner, status="pending",
                status_reason=None, verification=None, created_at=utcnow())
            tx.session.add(row)
            await tx.session.flush()
            if in_tx is not None:
                await tx.serialize(uri)  # against a concurrent clean-up of the same stored files
                await in_tx()
            out = adapter_dict(row)
            tx.audit("adapter.register", f"adapter:{row.id}", None, _audit_view(out))
            return out

        return await self._write(actor, op)

    async def _set_adapter_status(self, ref: str, status: str, action: str, actor: str, *,
                                  reason: str | None, verification: dict[str, Any] | None,
                                  allowed_from: tuple[str, ...], force: bool = True,
                                  if_match: int | None = None) -> dict:
        """Move a version to ``status``. Leaving ``active`` touches the bindings that use it:
        without ``force`` that is refused (409 ``adapter_in_use``, naming them)."""
        if verification is not None and not isinstance(verification, dict):
            raise Invalid("verification must be a JSON object", param="verification")
        if reason is not None and not isinstance(reason, str):
            raise Invalid("reason must be a string", param="reason")
        if not isinstance(force, bool):
            raise Invalid("force must be a boolean", param="force")

        async def op(tx: _Tx) -> dict:
            row = await self._adapter(tx.session, ref, lock=True)
            _match(row.row_version, if_match, f"adapter {row.label}")
            before = adapter_dict(row)
            if row.status == status and verification is None and reason is None:
                return before
            if row.status not in allowed_from and row.status != status:
                raise Conflict(f"adapter {row.label} is {row.status}; cannot {action.split('.')[-1]} it",
                               code="invalid_transition")
            users = await self._users(tx.session, row) if status != "active" else []
            if users and not force:
                named = ", ".join(f"{u['tenant']}/{u['alias']} ({u['role']})" for u in users)
                raise Conflict(f"adapter {row.label} is in use by {named}; re-point or disable those bindings "
                               f"first, or force it (disables them and aborts the canaries)",
                               code="adapter_in_use", extra={"bindings": users})
            row.status = status
            row.status_reason = reason
            if verification is not None:
                row.verification = verification
            await tx.session.flush()
            out = adapter_dict(row)
            tx.audit(action, f"adapter:{row.id}", _audit_view(before), _audit_view(out))
            if users:
                await self._detach_adapter(tx, row)
                out["detached"] = users
            return out

        return await self._write(actor, op)

    @staticmethod
    async def _users(session: AsyncSession, adapter: AdapterVersion) -> list[dict[str, str]]:
        """Bindings that route to ``adapter``: enabled ones active on it, and canaries on it."""
        rows = (await session.execute(
            select(Binding).where(or_(Binding.canary_id == adapter.id, Binding.active_id == adapter.id))
            .order_by(Binding.tenant, Binding.alias).with_for_update())).scalars().all()
        return [{"tenant": b.tenant, "alias": b.alias, "role": "canary" if b.canary_id == adapter.id else "active"}
                for b in rows if b.canary_id == adapter.id or b.enabled]

    async def _detach_adapter(self, tx: _Tx, adapter: AdapterVersion) -> None:
        """Keep every binding routable: abort canaries on it, disable bindings active on it."""
        rows = (await tx.session.execute(
            select(Binding).where(or_(Binding.canary_id == adapter.id, Binding.active_id == adapter.id))
            .order_by(Binding.id).with_for_update())).scalars().all()
        for b in rows:
            before = await self._binding_out(tx.session, b)
            action = ""
            if b.canary_id == adapter.id:
                b.canary_id, b.canary_percent, action = None, 0.0, "binding.canary_abort"
            if b.active_id == adapter.id and b.enabled:
                b.enabled, action = False, "binding.disable"
            if not action:
                continue
            b.updated_at = utcnow()
            await tx.session.flush()
            tx.audit(action, f"binding:{b.tenant}/{b.alias}", _audit_view(before),
                     _audit_view(await self._binding_out(tx.session, b)) | {"cause": f"adapter {adapter.label} "
                                                                             f"is {adapter.status}"})

    async def activate_adapter(self, ref: str, *, verification: dict[str, Any] | None = None,
                               actor: str = "admin", if_match: int | None = None) -> dict:
        """Make a version active (pending, disabled, or failed: a failed activation may be retried)."""
        return await self._set_adapter_status(ref, "active", "adapter.activate", actor, reason=None,
                                              verification=verification,
                                              allowed_from=("pending", "disabled", "failed"), if_match=if_match)

    async def disable_adapter(self, ref: str, *, reason: str | None = None, force: bool = False,
                              actor: str = "admin", if_match: int | None = None) -> dict:
        """Disable a version. Bindings that route to it (active, canary) refuse this with 409
        ``adapter_in_use`` unless ``force``: then it aborts those canaries and disables those
        bindings (each audited) and lists them under ``detached``."""
        return await self._set_adapter_status(ref, "disabled", "adapter.disable", actor, reason=reason,
                                              verification=None, allowed_from=("pending", "active", "failed"),
                                              force=force, if_match=if_match)

    async def enable_adapter(self, ref: str, *, actor: str = "admin", if_match: int | None = None) -> dict:
        """Re-enable a disabled version that had passed activation (``adapter.enable``). The
        bindings its disabling switched off stay off until enabled one by one."""
        async def op(tx: _Tx) -> dict:
            row = await self._adapter(tx.session, ref, lock=True)
            _match(row.row_version, if_match, f"adapter {row.label}")
            before = adapter_dict(row)
            if row.status == "active":
                return before
            if row.status != "disabled":
                raise Conflict(f"adapter {row.label} is {row.status}, not disabled; activate it instead",
                               code="not_disabled")
            prior = await self._status_before_disable(tx.session, row.id)
            if prior != "active":
                raise Conflict(f"adapter {row.label} was disabled while {prior or 'not active'}, before it passed "
                               f"activation; activate it instead", code="never_activated")
            row.status, row.status_reason = "active", None
            await tx.session.flush()
            out = adapter_dict(row)
            tx.audit("adapter.enable", f"adapter:{row.id}", _audit_view(before), _audit_view(out))
            return out

        return await self._write(actor, op)

    @staticmethod
    async def _status_before_disable(session: AsyncSession, adapter_id: str) -> str | None:
        """The status a disabled version had when it was disabled (from its audit rows)."""
        rows = (await session.execute(
            select(AuditEntry.before).where(AuditEntry.target == f"adapter:{adapter_id}",
                                            AuditEntry.action == "adapter.disable")
            .order_by(AuditEntry.id.desc()))).scalars()
        for before in rows:
            status = (before or {}).get("status")
            if status != "disabled":
                return status
        return None

    async def fail_adapter(self, ref: str, *, reason: str, verification: dict[str, Any] | None = None,
                           actor: str = "admin", if_match: int | None = None) -> dict:
        """Mark a version failed: the activation gate refused it (pending, failed again on a retry, or
        disabled and re-verified)."""
        return await self._set_adapter_status(ref, "failed", "adapter.fail", actor, reason=reason,
                                              verification=verification, allowed_from=("pending", "disabled"),
                                              if_match=if_match)

    async def get_adapter(self, ref: str) -> dict:
        return adapter_dict(await self._read(lambda s: self._adapter(s, ref)))

    async def list_adapters(self, *, name: str | None = None, base_model: str | None = None,
                            owner: str | None = None, status: str | None = None) -> list[dict]:
        async def op(s: AsyncSession) -> list[dict]:
            stmt = select(AdapterVersion).order_by(AdapterVersion.name, AdapterVersion.version)
            if name:
                stmt = stmt.where(AdapterVersion.name == name)
            if base_model:
                stmt = stmt.where(AdapterVersion.base_model == base_model)
            if owner:
                stmt = stmt.where(AdapterVersion.owner_tenant == owner)
            if status:
                stmt = stmt.where(AdapterVersion.status == status)
            return [adapter_dict(a) for a in (await s.execute(stmt)).scalars()]

        return await self._read(op)

    # --- bindings ------------------------------------------------------------------------------------

    async def _binding_op(self, tenant: str, alias: str, action: str, actor: str,
                          mutate: Callable[[_Tx, Binding], Awaitable[bool]], if_match: int | None = None,
                          judgement: dict[str, Any] | None = None) -> dict:
        _slug(tenant)
        _name(alias, "alias")

        async def op(tx: _Tx) -> dict:
            b = await self._binding(tx.session, tenant, alias)
            _match(b.row_version, if_match, f"binding {tenant}/{alias}")
            labels: dict[str, str] = {}
            before = await self._binding_out(tx.session, b, labels)
            if not await mutate(tx, b):
                return before
            b.updated_at = utcnow()
            await tx.session.flush()
            out = await self._binding_out(tx.session, b, labels)
            after = _audit_view(out)
            if judgement is not None:  # the canary judge's numbers that decided this change
                after["judgement"] = judgement
            tx.audit(action, f"binding:{tenant}/{alias}", _audit_view(before), after)
            return out

        return await self._write(actor, op)

    async def bind(self, tenant: str, alias: str, adapter: str, *, on_disabled: str | None = None,
                   actor: str = "admin", if_match: int | None = None) -> dict:
        """Point ``alias`` at an active adapter version (create, or re-point: current -> previous)."""
        _slug(tenant)
        _name(alias, "alias")
        if on_disabled is not None:
            _on_disabled(on_disabled)

        async def op(tx: _Tx) -> dict:
            await self._tenant(tx.session, tenant)
            new = await self._adapter(tx.session, adapter)
            b = (await tx.session.execute(select(Binding).where(Binding.tenant == tenant, Binding.alias == alias)
                                          .with_for_update())).scalar_one_or_none()
            _match(b.row_version if b is not None else None, if_match, f"binding {tenant}/{alias}")
            now = utcnow()
            if b is None:
                self._check_bindable(tenant, new, None)
                b = Binding(tenant=tenant, alias=alias, base_model=new.base_model, active_id=new.id,
                            previous_id=None, canary_id=None, canary_percent=0.0, enabled=True,
                            on_disabled=on_disabled or "refuse", created_at=now, updated_at=now)
                tx.session.add(b)
                await tx.session.flush()
                out = await self._binding_out(tx.session, b)
                tx.audit("binding.create", f"binding:{tenant}/{alias}", None, _audit_view(out))
                return out
            self._check_bindable(tenant, new, b.base_model)
            before = await self._binding_out(tx.session, b)
            if b.active_id == new.id and (on_disabled is None or on_disabled == b.on_disabled):
                return before
            if b.active_id != new.id:
                b.previous_id, b.active_id = b.active_id, new.id
                if b.canary_id == new.id:
                    b.canary_id, b.canary_percent = None, 0.0
            if on_disabled is not None:
                b.on_disabled = on_disabled
            b.updated_at = now
            await tx.session.flush()
            out = await self._binding_out(tx.session, b)
            tx.audit("binding.bind", f"binding:{tenant}/{alias}", _audit_view(before), _audit_view(out))
            return out

        return await self._write(actor, op)

    async def rollback(self, tenant: str, alias: str, *, actor: str = "admin",
                       if_match: int | None = None) -> dict:
        """Swap active and previous in one step (a second rollback rolls forward again)."""
        async def mutate(tx: _Tx, b: Binding) -> bool:
            if b.previous_id is None:
                raise Conflict(f"{tenant}/{alias} has no previous version to roll back to", code="no_previous")
            prev = await self._adapter(tx.session, b.previous_id)
            self._check_bindable(tenant, prev, b.base_model)
            b.active_id, b.previous_id = prev.id, b.active_id
            if b.canary_id == prev.id:
                b.canary_id, b.canary_percent = None, 0.0
            return True

        return await self._binding_op(tenant, alias, "binding.rollback", actor, mutate, if_match)

    async def canary_start(self, tenant: str, alias: str, adapter: str, percent: float, *,
                           actor: str = "admin", if_match: int | None = None) -> dict:
        pct = _percent(percent)

        async def mutate(tx: _Tx, b: Binding) -> bool:
            new = await self._adapter(tx.session, adapter)
            self._check_bindable(tenant, new, b.base_model)
            if new.id == b.active_id:
                raise Invalid(f"{new.label} is already the active version of {tenant}/{alias}",
                              code="canary_is_active", param="adapter")
            if b.canary_id is not None and b.canary_id != new.id:
                raise Conflict(f"{tenant}/{alias} already has a canary; promote or abort it first",
                               code="canary_in_progress")
            if b.canary_id == new.id and b.canary_percent == pct:
                return False
            b.canary_id, b.canary_percent = new.id, pct
            return True

        return await self._binding_op(tenant, alias, "binding.canary_start", actor, mutate, if_match)

    async def canary_set(self, tenant: str, alias: str, percent: float, *, actor: str = "admin",
                         if_match: int | None = None, judgement: dict[str, Any] | None = None) -> dict:
        pct = _percent(percent)

        async def mutate(tx: _Tx, b: Binding) -> bool:
            if b.canary_id is None:
                raise Conflict(f"{tenant}/{alias} has no canary", code="no_canary")
            if b.canary_percent == pct:
                return False
            b.canary_percent = pct
            return True

        return await self._binding_op(tenant, alias, "binding.canary_set", actor, mutate, if_match, judgement)

    async def canary_promote(self, tenant: str, alias: str, *, actor: str = "admin",
                             if_match: int | None = None, judgement: dict[str, Any] | None = None) -> dict:
        async def mutate(tx: _Tx, b: Binding) -> bool:
            if b.canary_id is None:
                raise Conflict(f"{tenant}/{alias} has no canary", code="no_canary")
            canary = await self._adapter(tx.session, b.canary_id)
            self._check_bindable(tenant, canary, b.base_model)
            b.previous_id, b.active_id = b.active_id, canary.id
            b.canary_id, b.canary_percent = None, 0.0
            return True

        return await self._binding_op(tenant, alias, "binding.canary_promote", actor, mutate, if_match, judgement)

    async def canary_abort(self, tenant: str, alias: str, *, actor: str = "admin",
                           if_match: int | None = None, judgement: dict[str, Any] | None = None) -> dict:
        async def mutate(tx: _Tx, b: Binding) -> bool:
            if b.canary_id is None:
                raise Conflict(f"{tenant}/{alias} has no canary", code="no_canary")
            b.canary_id, b.canary_percent = None, 0.0
            return True

        return await self._binding_op(tenant, alias, "binding.canary_abort", actor, mutate, if_match, judgement)

    async def set_binding_enabled(self, tenant: str, alias: str, enabled: bool, *,
                                  on_disabled: str | None = None, actor: str = "admin",
                                  if_match: int | None = None) -> dict:
        if not isinstance(enabled, bool):
            raise Invalid("enabled must be a boolean", param="enabled")
        if on_disabled is not None:
            _on_disabled(on_disabled)
        elif not enabled:
            on_disabled = "refuse"  # per operation: a plain disable refuses, whatever was chosen before

        async def mutate(tx: _Tx, b: Binding) -> bool:
            if enabled:
                active = await self._adapter(tx.session, b.active_id)
                if active.status != "active":
                    raise Invalid(f"cannot enable {tenant}/{alias}: its active version {active.label} is "
                                  f"{active.status}; bind or roll back first", code="adapter_not_active")
            if b.enabled == enabled and (on_disabled is None or b.on_disabled == on_disabled):
                return False
            b.enabled = enabled
            if on_disabled is not None:
                b.on_disabled = on_disabled
            return True

        return await self._binding_op(tenant, alias, "binding.enable" if enabled else "binding.disable",
                                      actor, mutate, if_match)

    async def unbind(self, tenant: str, alias: str, *, actor: str = "admin", if_match: int | None = None) -> dict:
        """Remove an alias: the tenant's requests for it get 404 from then on."""
        _slug(tenant)
        _name(alias, "alias")

        async def op(tx: _Tx) -> dict:
            b = await self._binding(tx.session, tenant, alias)
            _match(b.row_version, if_match, f"binding {tenant}/{alias}")
            before = await self._binding_out(tx.session, b)
            await tx.session.delete(b)
            await tx.session.flush()
            tx.audit("binding.delete", f"binding:{tenant}/{alias}", _audit_view(before), None)
            return {"tenant": tenant, "alias": alias, "deleted": True}

        return await self._write(actor, op)

    async def get_binding(self, tenant: str, alias: str) -> dict:
        async def op(s: AsyncSession) -> dict:
            await self._tenant(s, tenant)
            b = (await s.execute(select(Binding).where(Binding.tenant == tenant, Binding.alias == alias)))\
                .scalar_one_or_none()
            if b is None:
                raise NotFound(f"tenant {tenant!r} has no alias {alias!r}", code="binding_not_found",
                               param="alias")
            return await self._binding_out(s, b)

        return await self._read(op)

    async def list_bindings(self, tenant: str | None = None) -> list[dict]:
        async def op(s: AsyncSession) -> list[dict]:
            stmt = select(Binding).order_by(Binding.tenant, Binding.alias)
            if tenant:
                await self._tenant(s, tenant)
                stmt = stmt.where(Binding.tenant == tenant)
            rows = (await s.execute(stmt)).scalars().all()
            labels = {r.id: f"{r.name}@{r.version}" for r in (await s.execute(
                select(AdapterVersion.id, AdapterVersion.name, AdapterVersion.version)))}
            return [binding_dict(b, labels) for b in rows]

        return await self._read(op)

    # --- audit / version -----------------------------------------------------------------------------

    async def audit(self, *, actor: str | None = None, action: str | None = None, target: str | None = None,
                    since_version: int | None = None, limit: int = 100) -> list[dict]:
        """Newest first. ``target`` matches exactly or as a prefix ending in ``*``."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise Invalid("limit must be an integer from 1 to 1000", param="limit")

        async def op(s: AsyncSession) -> list[dict]:
            stmt = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
            if actor:
                stmt = stmt.where(AuditEntry.actor == actor)
            if action:
                stmt = stmt.where(AuditEntry.action == action)
            if target:
                if target.endswith("*"):
                    prefix = target[:-1].replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
                    stmt = stmt.where(AuditEntry.target.like(prefix + "%", escape="\\"))
                else:
                    stmt = stmt.where(AuditEntry.target == target)
            if since_version is not None:
                stmt = stmt.where(AuditEntry.registry_version > since_version)
            return [audit_dict(e) for e in (await s.execute(stmt)).scalars()]

        return await self._read(op)

    async def version(self) -> int:
        async def op(s: AsyncSession) -> int:
            return int((await s.execute(select(RegistryState.version).where(RegistryState.id == 1))).scalar_one())

        return await self._read(op)


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


def _busy(exc: BaseException, tail: str) -> RegistryError:
    """Every pooled database connection is in use (``sqlalchemy.exc.TimeoutError``): retry soon."""
    log.warning("registry connection pool exhausted: %s", _short(exc))
    return Unavailable(f"the registry is busy (all database connections in use); {tail}; retry shortly",
                       code="registry_busy", retry_after=1)


def _unavailable(exc: BaseException, tail: str) -> RegistryError:
    """Database errors that are not about the request: schema missing, or the database down."""
    text = _short(exc).lower()
    if isinstance(exc, ProgrammingError | OperationalError) and (
            "no such table" in text or ("does not exist" in text and "relation" in text)):
        log.error("registry schema missing: %s", _short(exc))
        return Unavailable(f"the registry schema is missing or outdated (run `loraplex migrate`); {tail}",
                           code="registry_schema_missing")
    if isinstance(exc, DBAPIError) and not isinstance(exc, OperationalError | InterfaceError) \
            and not exc.connection_invalidated:
        log.error("registry database error: %s", _short(exc))
        return Unavailable(f"the registry database failed the operation; {tail}", code="registry_error")
    log.warning("registry database unavailable: %s", _short(exc))
    return Unavailable(f"the registry database is unavailable; {tail}")


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.splitlines()[0][:300] if text else type(exc).__name__


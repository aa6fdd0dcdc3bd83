"""Registry operations: every change is one transaction with its audit row and a bump of
the registry version, announced to readers after commit.

The rules it enforces: docs/DESIGN.md, "Registry" and "Bindings, canary, rollback".
Results are typed records (``registry.records``: ``TenantRecord``, ``AdapterRecord``, ...; the admin
API answers their ``to_json()``). Here: tenants,
base models, adapter versions, the audit log, and the bindings' operations (``Bindings``, in
``registry.service_bindings``); the transactions are ``RegistryDatabase``'s
(``registry.service_core``, the ``db`` of a service), the row lookups ``registry.lookups``'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from loraplex.adapter_store import AdapterStore, open_store
from loraplex.modelinfo import ModelInfo, describe_model
from loraplex.settings import Settings
from registry import validators
from registry.admission import AdmissionError, AdmittedAdapter, admit_uri
from registry.changes import ChangeBus
from registry.errors import Conflict, Invalid, NotFound, Unavailable
from registry.lookups import adapter_row, binding_record, tenant_row
from registry.models import (
    AdapterVersion,
    AuditEntry,
    BaseModelRow,
    Binding,
    RegistryState,
    Tenant,
    utcnow,
)
from registry.records import (
    DIMENSIONS,
    MAX_LIMIT,
    AdapterRecord,
    AuditRecord,
    BaseModelRecord,
    BindingRecord,
    BindingUse,
    DeletedBinding,
    TenantRecord,
)
from registry.service_bindings import Bindings
from registry.service_core import RegistryDatabase, Tx

log = logging.getLogger("loraplex.registry")


class RegistryService:
    """All registry operations (the admin API's, the CLI's, the canary judge's). One per process;
    safe for concurrent tasks.

    ``db`` is its ``RegistryDatabase``: the transactions (``db.read()``, ``db.write(actor)``) that
    the modules built on the registry (canary policies, the supply chain, the console, the limits
    report) run their own reads and writes in. ``bindings`` holds the bindings' operations,
    offered here too under the same names."""

    def __init__(self, settings: Settings, engine: AsyncEngine | None = None, *,
                 bus: ChangeBus | None = None, database_url: str | None = None) -> None:
        self.db = RegistryDatabase(settings, engine, bus=bus, database_url=database_url)
        self.bindings = Bindings(self.db)
        self.settings = settings
        self.database_url = self.db.database_url
        self.engine = self.db.engine
        self.sessions = self.db.sessions
        self.bus = self.db.bus
        self._adapter_store: AdapterStore | None = None

    async def close(self) -> None:
        await self.db.close()

    # --- tenants -----------------------------------------------------------------------------------

    async def create_tenant(self, slug: str, *, requests_per_min: int = 600, tokens_per_min: int = 100_000,
                            max_concurrent: int = 16, priority: str = "normal", cache_scope: str = "",
                            actor: str = "admin") -> TenantRecord:
        slug = validators.slug(slug, "slug")
        values = {"requests_per_min": validators.limit(requests_per_min, "requests_per_min"),
                  "tokens_per_min": validators.limit(tokens_per_min, "tokens_per_min"),
                  "max_concurrent": validators.limit(max_concurrent, "max_concurrent"), "priority": validators.priority(priority),
                  "cache_scope": validators.cache_scope(cache_scope)}

        async with self.db.write(actor) as tx:
            if await tx.session.get(Tenant, slug) is not None:
                raise Conflict(f"tenant {slug!r} already exists", code="tenant_exists", param="slug")
            now = utcnow()
            row = Tenant(slug=slug, status="active", created_at=now, updated_at=now, **values)
            tx.session.add(row)
            await tx.session.flush()
            out = TenantRecord.of(row)
            tx.audit("tenant.create", f"tenant:{slug}", None, out.audit_json())
            return out

    async def set_tenant_status(self, slug: str, status: str, *, actor: str = "admin",
                                if_match: int | None = None) -> TenantRecord:
        if status not in ("active", "disabled"):
            raise Invalid(f"status must be 'active' or 'disabled', got {status!r}", param="status")

        async with self.db.write(actor) as tx:
            row = await tenant_row(tx.session, slug, lock=True)
            validators.match(row.row_version, if_match, f"tenant {slug!r}")
            before = TenantRecord.of(row)
            if row.status == status:
                return before
            row.status, row.updated_at = status, utcnow()
            await tx.session.flush()
            out = TenantRecord.of(row)
            tx.audit("tenant.enable" if status == "active" else "tenant.disable", f"tenant:{slug}",
                     before.audit_json(), out.audit_json())
            return out

    async def disable_tenant(self, slug: str, *, actor: str = "admin", if_match: int | None = None) -> TenantRecord:
        return await self.set_tenant_status(slug, "disabled", actor=actor, if_match=if_match)

    async def enable_tenant(self, slug: str, *, actor: str = "admin", if_match: int | None = None) -> TenantRecord:
        return await self.set_tenant_status(slug, "active", actor=actor, if_match=if_match)

    async def set_tenant_limits(self, slug: str, *, requests_per_min: int | None = None,
                                tokens_per_min: int | None = None, max_concurrent: int | None = None,
                                priority: str | None = None, response_retention_s: int | None = None,
                                actor: str = "admin", if_match: int | None = None) -> TenantRecord:
        changes: dict[str, Any] = {}
        for key, value in (("requests_per_min", requests_per_min), ("tokens_per_min", tokens_per_min),
                           ("max_concurrent", max_concurrent), ("response_retention_s", response_retention_s)):
            if value is not None:
                changes[key] = validators.limit(value, key)
        if priority is not None:
            changes["priority"] = validators.priority(priority)
        if not changes:
            raise Invalid("give at least one of requests_per_min, tokens_per_min, max_concurrent, priority, "
                          "response_retention_s", code="nothing_to_change")

        async with self.db.write(actor) as tx:
            row = await tenant_row(tx.session, slug, lock=True)
            validators.match(row.row_version, if_match, f"tenant {slug!r}")
            before = TenantRecord.of(row)
            if all(getattr(row, k) == v for k, v in changes.items()):
                return before
            for key, value in changes.items():
                setattr(row, key, value)
            row.updated_at = utcnow()
            await tx.session.flush()
            out = TenantRecord.of(row)
            tx.audit("tenant.limits", f"tenant:{slug}", before.audit_json(), out.audit_json())
            return out

    async def set_tenant_cache_scope(self, slug: str, cache_scope: str, *, actor: str = "admin",
                                     if_match: int | None = None) -> TenantRecord:
        """Put a tenant in a shared prefix-cache scope (a name), or back in its own (``""``).

        Tenants in one scope reuse each other's cached KV blocks, and so can time whether another
        of them sent a prompt: share only among tenants that trust each other (one company's)."""
        scope = validators.cache_scope(cache_scope)

        async with self.db.write(actor) as tx:
            row = await tenant_row(tx.session, slug, lock=True)
            validators.match(row.row_version, if_match, f"tenant {slug!r}")
            before = TenantRecord.of(row)
            if (row.cache_scope or "") == scope:
                return before
            row.cache_scope, row.updated_at = scope, utcnow()
            await tx.session.flush()
            out = TenantRecord.of(row)
            tx.audit("tenant.cache_scope", f"tenant:{slug}", before.audit_json(), out.audit_json())
            return out

    async def get_tenant(self, slug: str) -> TenantRecord:
        async with self.db.read() as s:
            return TenantRecord.of(await tenant_row(s, slug))

    async def list_tenants(self, status: str | None = None) -> list[TenantRecord]:
        async with self.db.read() as s:
            stmt = select(Tenant).order_by(Tenant.slug)
            if status:
                stmt = stmt.where(Tenant.status == status)
            return [TenantRecord.of(t) for t in (await s.execute(stmt)).scalars()]

    # --- base models ---------------------------------------------------------------------------------

    async def register_base_model(self, info: ModelInfo | dict[str, Any], *,
                                  actor: str = "admin") -> BaseModelRecord:
        data = info.to_dict() if isinstance(info, ModelInfo) else dict(info)
        name = validators.name(data.get("name"), "name")
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

        async with self.db.write(actor) as tx:
            if await tx.session.get(BaseModelRow, name) is not None:
                raise Conflict(f"base model {name!r} already exists", code="base_model_exists", param="name")
            row = BaseModelRow(name=name, revision=revision, architecture=architecture, created_at=utcnow(), **dims)
            tx.session.add(row)
            await tx.session.flush()
            out = BaseModelRecord.of(row)
            tx.audit("base_model.register", f"base_model:{name}", None, out.audit_json())
            return out

    async def register_base_model_from_path(self, path: str, *, name: str | None = None,
                                            actor: str = "admin") -> BaseModelRecord:
        """Describe a local model (HF directory or GGUF) with ``ModelInfo`` and register it."""
        try:
            info = await asyncio.to_thread(describe_model, path, name)
        except (OSError, ValueError, KeyError) as exc:
            raise Invalid(f"cannot describe model at {path!r}: {exc}", code="bad_model_path", param="path") \
                from None
        return await self.register_base_model(info, actor=actor)

    async def list_base_models(self) -> list[BaseModelRecord]:
        async with self.db.read() as s:
            rows = await s.execute(select(BaseModelRow).order_by(BaseModelRow.name))
            return [BaseModelRecord.of(b) for b in rows.scalars()]

    async def base_model_info(self, name: str) -> ModelInfo:
        async with self.db.read() as s:
            row = await s.get(BaseModelRow, name)
            if row is None:
                raise NotFound(f"base model {name!r} does not exist", code="base_model_not_found",
                               param="base_model")
            return BaseModelRecord.of(row).info

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
                               in_tx: Callable[[], Awaitable[None]] | None = None) -> AdapterRecord:
        """Admit the artifact (outside the transaction), then record it as ``pending``.

        ``admitted``: already admitted (an upload); ``in_tx`` runs inside the write transaction
        before it commits (an upload makes sure its stored files are still there)."""
        name = validators.name(name, "name")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                    or not 1 <= version <= MAX_LIMIT):
            raise Invalid(f"version must be a positive integer, got {version!r}", param="version")
        if owner is not None:
            validators.slug(owner, "owner")
        if expected_revision is not None and not isinstance(expected_revision, str):
            raise Invalid("expected_revision must be a string", param="expected_revision")
        if not isinstance(uri, str) or not uri:
            raise Invalid("uri must be a non-empty string", param="uri")
        base = await self.base_model_info(base_model)
        if owner is not None:
            async with self.db.read() as s:
                await tenant_row(s, owner)
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

        async with self.db.write(actor) as tx:
            await tx.serialize(f"adapter-name:{name}")  # registrations of one name number in turn
            current = await tx.session.get(BaseModelRow, base.name)
            if current is None or current.revision != base.revision:
                raise Conflict(f"base model {base.name!r} changed during admission; retry",
                               code="base_model_changed")
            if owner is not None:
                await tenant_row(tx.session, owner)
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
            out = AdapterRecord.of(row)
            tx.audit("adapter.register", f"adapter:{row.id}", None, out.audit_json())
            return out

    async def _set_adapter_status(self, ref: str, status: str, action: str, actor: str, *,
                                  reason: str | None, verification: dict[str, Any] | None,
                                  allowed_from: tuple[str, ...], force: bool = True,
                                  if_match: int | None = None) -> AdapterRecord:
        """Move a version to ``status``. Leaving ``active`` touches the bindings that use it:
        without ``force`` that is refused (409 ``adapter_in_use``, naming them)."""
        if verification is not None and not isinstance(verification, dict):
            raise Invalid("verification must be a JSON object", param="verification")
        if reason is not None and not isinstance(reason, str):
            raise Invalid("reason must be a string", param="reason")
        if not isinstance(force, bool):
            raise Invalid("force must be a boolean", param="force")

        async with self.db.write(actor) as tx:
            row = await adapter_row(tx.session, ref, lock=True)
            validators.match(row.row_version, if_match, f"adapter {row.label}")
            before = AdapterRecord.of(row)
            if row.status == status and verification is None and reason is None:
                return before
            if row.status not in allowed_from and row.status != status:
                raise Conflict(f"adapter {row.label} is {row.status}; cannot {action.split('.')[-1]} it",
                               code="invalid_transition")
            users = await self._users(tx.session, row) if status != "active" else []
            if users and not force:
                named = ", ".join(f"{u.tenant}/{u.alias} ({u.role})" for u in users)
                raise Conflict(f"adapter {row.label} is in use by {named}; re-point or disable those bindings "
                               f"first, or force it (disables them and aborts the canaries)",
                               code="adapter_in_use", extra={"bindings": [u.to_json() for u in users]})
            row.status = status
            row.status_reason = reason
            if verification is not None:
                row.verification = verification
            await tx.session.flush()
            out = AdapterRecord.of(row)
            tx.audit(action, f"adapter:{row.id}", before.audit_json(), out.audit_json())
            if users:
                await self._detach_adapter(tx, row)
                out = dataclasses.replace(out, detached=tuple(users))
            return out

    @staticmethod
    async def _users(session: AsyncSession, adapter: AdapterVersion) -> list[BindingUse]:
        """Bindings that route to ``adapter``: enabled ones active on it, and canaries on it."""
        rows = (await session.execute(
            select(Binding).where(or_(Binding.canary_id == adapter.id, Binding.active_id == adapter.id))
            .order_by(Binding.tenant, Binding.alias).with_for_update())).scalars().all()
        return [BindingUse(b.tenant, b.alias, "canary" if b.canary_id == adapter.id else "active")
                for b in rows if b.canary_id == adapter.id or b.enabled]

    async def _detach_adapter(self, tx: Tx, adapter: AdapterVersion) -> None:
        """Keep every binding routable: abort canaries on it, disable bindings active on it."""
        rows = (await tx.session.execute(
            select(Binding).where(or_(Binding.canary_id == adapter.id, Binding.active_id == adapter.id))
            .order_by(Binding.id).with_for_update())).scalars().all()
        for b in rows:
            before = await binding_record(tx.session, b)
            action = ""
            if b.canary_id == adapter.id:
                b.canary_id, b.canary_percent, action = None, 0.0, "binding.canary_abort"
            if b.active_id == adapter.id and b.enabled:
                b.enabled, action = False, "binding.disable"
            if not action:
                continue
            b.updated_at = utcnow()
            await tx.session.flush()
            after = await binding_record(tx.session, b)
            tx.audit(action, f"binding:{b.tenant}/{b.alias}", before.audit_json(),
                     after.audit_json() | {"cause": f"adapter {adapter.label} is {adapter.status}"})

    async def activate_adapter(self, ref: str, *, verification: dict[str, Any] | None = None,
                               actor: str = "admin", if_match: int | None = None) -> AdapterRecord:
        """Make a version active (pending, disabled, or failed: a failed activation may be retried)."""
        return await self._set_adapter_status(ref, "active", "adapter.activate", actor, reason=None,
                                              verification=verification,
                                              allowed_from=("pending", "disabled", "failed"), if_match=if_match)

    async def disable_adapter(self, ref: str, *, reason: str | None = None, force: bool = False,
                              actor: str = "admin", if_match: int | None = None) -> AdapterRecord:
        """Disable a version. Bindings that route to it (active, canary) refuse this with 409
        ``adapter_in_use`` unless ``force``: then it aborts those canaries and disables those
        bindings (each audited) and lists them under ``detached``."""
        return await self._set_adapter_status(ref, "disabled", "adapter.disable", actor, reason=reason,
                                              verification=None, allowed_from=("pending", "active", "failed"),
                                              force=force, if_match=if_match)

    async def enable_adapter(self, ref: str, *, actor: str = "admin", if_match: int | None = None) -> AdapterRecord:
        """Re-enable a disabled version that had passed activation (``adapter.enable``). The
        bindings its disabling switched off stay off until enabled one by one."""
        async with self.db.write(actor) as tx:
            row = await adapter_row(tx.session, ref, lock=True)
            validators.match(row.row_version, if_match, f"adapter {row.label}")
            before = AdapterRecord.of(row)
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
            out = AdapterRecord.of(row)
            tx.audit("adapter.enable", f"adapter:{row.id}", before.audit_json(), out.audit_json())
            return out

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
                           actor: str = "admin", if_match: int | None = None) -> AdapterRecord:
        """Mark a version failed: the activation gate refused it (pending, failed again on a retry, or
        disabled and re-verified)."""
        return await self._set_adapter_status(ref, "failed", "adapter.fail", actor, reason=reason,
                                              verification=verification, allowed_from=("pending", "disabled"),
                                              if_match=if_match)

    async def get_adapter(self, ref: str) -> AdapterRecord:
        async with self.db.read() as s:
            return AdapterRecord.of(await adapter_row(s, ref))

    async def list_adapters(self, *, name: str | None = None, base_model: str | None = None,
                            owner: str | None = None, status: str | None = None) -> list[AdapterRecord]:
        async with self.db.read() as s:
            stmt = select(AdapterVersion).order_by(AdapterVersion.name, AdapterVersion.version)
            if name:
                stmt = stmt.where(AdapterVersion.name == name)
            if base_model:
                stmt = stmt.where(AdapterVersion.base_model == base_model)
            if owner:
                stmt = stmt.where(AdapterVersion.owner_tenant == owner)
            if status:
                stmt = stmt.where(AdapterVersion.status == status)
            return [AdapterRecord.of(a) for a in (await s.execute(stmt)).scalars()]

    # --- audit / version -----------------------------------------------------------------------------

    async def audit(self, *, actor: str | None = None, action: str | None = None, target: str | None = None,
                    since_version: int | None = None, limit: int = 100) -> list[AuditRecord]:
        """Newest first. ``target`` matches exactly or as a prefix ending in ``*``."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise Invalid("limit must be an integer from 1 to 1000", param="limit")

        async with self.db.read() as s:
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
            return [AuditRecord.of(e) for e in (await s.execute(stmt)).scalars()]

    async def version(self) -> int:
        async with self.db.read() as s:
            return int((await s.execute(select(RegistryState.version).where(RegistryState.id == 1))).scalar_one())

    # --- bindings (``Bindings``) ---------------------------------------------------------------------

    async def bind(self, tenant: str, alias: str, adapter: str, *, on_disabled: str | None = None,
                   actor: str = "admin", if_match: int | None = None) -> BindingRecord:
        """``Bindings.bind``: point ``alias`` at an active adapter version."""
        return await self.bindings.bind(tenant, alias, adapter, on_disabled=on_disabled, actor=actor,
                                        if_match=if_match)

    async def rollback(self, tenant: str, alias: str, *, actor: str = "admin",
                       if_match: int | None = None) -> BindingRecord:
        """``Bindings.rollback``: swap active and previous."""
        return await self.bindings.rollback(tenant, alias, actor=actor, if_match=if_match)

    async def canary_start(self, tenant: str, alias: str, adapter: str, percent: float, *,
                           actor: str = "admin", if_match: int | None = None) -> BindingRecord:
        """``Bindings.canary_start``."""
        return await self.bindings.canary_start(tenant, alias, adapter, percent, actor=actor, if_match=if_match)

    async def canary_set(self, tenant: str, alias: str, percent: float, *, actor: str = "admin",
                         if_match: int | None = None, judgement: dict[str, Any] | None = None) -> BindingRecord:
        """``Bindings.canary_set``."""
        return await self.bindings.canary_set(tenant, alias, percent, actor=actor, if_match=if_match,
                                              judgement=judgement)

    async def canary_promote(self, tenant: str, alias: str, *, actor: str = "admin",
                             if_match: int | None = None, judgement: dict[str, Any] | None = None) -> BindingRecord:
        """``Bindings.canary_promote``."""
        return await self.bindings.canary_promote(tenant, alias, actor=actor, if_match=if_match, judgement=judgement)

    async def canary_abort(self, tenant: str, alias: str, *, actor: str = "admin",
                           if_match: int | None = None, judgement: dict[str, Any] | None = None) -> BindingRecord:
        """``Bindings.canary_abort``."""
        return await self.bindings.canary_abort(tenant, alias, actor=actor, if_match=if_match, judgement=judgement)

    async def set_binding_enabled(self, tenant: str, alias: str, enabled: bool, *,
                                  on_disabled: str | None = None, actor: str = "admin",
                                  if_match: int | None = None) -> BindingRecord:
        """``Bindings.set_binding_enabled``."""
        return await self.bindings.set_binding_enabled(tenant, alias, enabled, on_disabled=on_disabled, actor=actor,
                                                       if_match=if_match)

    async def unbind(self, tenant: str, alias: str, *, actor: str = "admin", if_match: int | None = None) -> DeletedBinding:
        """``Bindings.unbind``: remove an alias."""
        return await self.bindings.unbind(tenant, alias, actor=actor, if_match=if_match)

    async def get_binding(self, tenant: str, alias: str) -> BindingRecord:
        return await self.bindings.get_binding(tenant, alias)

    async def list_bindings(self, tenant: str | None = None) -> list[BindingRecord]:
        return await self.bindings.list_bindings(tenant)

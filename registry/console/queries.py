"""The console's reads: one page at a time, by key (never OFFSET), searched by prefix.

Every list is ordered by a unique key and a page starts after the last key of the one before
(``after``), so page 2,000 of 100k tenants costs what page 1 does. Counts are one indexed
``count(*)`` each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select

from registry.canary import CanaryPolicyRecord
from registry.lookups import binding_row, tenant_row, version_labels
from registry.models import AdapterVersion, AuditEntry, BaseModelRow, Binding, CanaryPolicy, Tenant
from registry.records import AdapterRecord, AuditRecord, BindingRecord, TenantRecord
from registry.service import RegistryService

PAGE = 50


@dataclass
class Page:
    rows: list[dict[str, Any]]
    total: int | None
    """Rows matching the filters (None where counting is not offered: the audit log)."""
    after: str | None
    """Key to pass as ``after`` for the next page (None on the last)."""


def _prefix(column: Any, text: str) -> Any:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return column.like(escaped + "%", escape="\\")


async def tenants(service: RegistryService, *, q: str = "", status: str = "", after: str = "",
                  limit: int = PAGE) -> Page:
    async with service.db.read() as s:
        where = []
        if q:
            where.append(_prefix(Tenant.slug, q))
        if status:
            where.append(Tenant.status == status)
        total = (await s.execute(select(func.count()).select_from(Tenant).where(*where))).scalar_one()
        stmt = select(Tenant).where(*where)
        if after:
            stmt = stmt.where(Tenant.slug > after)
        rows = (await s.execute(stmt.order_by(Tenant.slug).limit(limit + 1))).scalars().all()
        more = len(rows) > limit
        rows = rows[:limit]
        return Page([TenantRecord.of(t).to_json() for t in rows], total, rows[-1].slug if more else None)


async def tenant(service: RegistryService, slug: str) -> dict[str, Any]:
    """The tenant, its bindings (with labels) and the canary policies on them."""

    async with service.db.read() as s:
        t = await tenant_row(s, slug)
        rows = (await s.execute(select(Binding).where(Binding.tenant == slug).order_by(Binding.alias))).scalars().all()
        pols = (await s.execute(select(CanaryPolicy).where(CanaryPolicy.tenant == slug))).scalars().all()
        ids = {i for b in rows for i in (b.active_id, b.previous_id, b.canary_id) if i}
        ids |= {p.canary_id for p in pols if p.canary_id}
        names = await version_labels(s, ids)
        policies = {p.alias: CanaryPolicyRecord.of(p, names).to_json() for p in pols}
        return {"tenant": TenantRecord.of(t).to_json(),
                "bindings": [BindingRecord.of(b, names).to_json() for b in rows], "policies": policies}


BINDABLE = 200
"""Active versions offered in a tenant's bind and canary forms (the newest first, by name)."""


async def bindable(service: RegistryService, slug: str) -> list[str]:
    """``name@version`` of the active versions the tenant may bind: its own and the shared ones."""

    async with service.db.read() as s:
        rows = await s.execute(select(AdapterVersion.name, AdapterVersion.version)
                               .where(AdapterVersion.status == "active",
                                      or_(AdapterVersion.owner_tenant == slug, AdapterVersion.owner_tenant.is_(None)))
                               .order_by(AdapterVersion.name, AdapterVersion.version.desc()).limit(BINDABLE))
        return [f"{n}@{v}" for n, v in rows]


async def policy(service: RegistryService, slug: str, alias: str) -> dict[str, Any] | None:
    """The binding's canary policy (None where it has none)."""

    async with service.db.read() as s:
        p = (await s.execute(select(CanaryPolicy).where(CanaryPolicy.tenant == slug, CanaryPolicy.alias == alias))
             ).scalar_one_or_none()
        return None if p is None else CanaryPolicyRecord.of(p).to_json()


async def binding_or_none(service: RegistryService, slug: str, alias: str) -> dict[str, Any] | None:
    """The binding, or None where the tenant has no such alias yet (404 for an unknown tenant)."""

    async with service.db.read() as s:
        await tenant_row(s, slug)
        b = (await s.execute(select(Binding).where(Binding.tenant == slug, Binding.alias == alias))).scalar_one_or_none()
        if b is None:
            return None
        return BindingRecord.of(b, await version_labels(s, (b.active_id, b.previous_id, b.canary_id))).to_json()


async def binding(service: RegistryService, slug: str, alias: str) -> dict[str, Any]:
    async with service.db.read() as s:
        b = await binding_row(s, slug, alias)
        return BindingRecord.of(b, await version_labels(s, (b.active_id, b.previous_id, b.canary_id))).to_json()


async def adapters(service: RegistryService, *, q: str = "", status: str = "", after: str = "",
                   limit: int = PAGE) -> Page:
    """Versions by name then version; ``after`` is ``name@version`` of the last row shown."""

    async with service.db.read() as s:
        where = []
        if q:
            where.append(_prefix(AdapterVersion.name, q))
        if status:
            where.append(AdapterVersion.status == status)
        total = (await s.execute(select(func.count()).select_from(AdapterVersion).where(*where))).scalar_one()
        stmt = (select(AdapterVersion, BaseModelRow.revision).join(BaseModelRow,
                                                                  BaseModelRow.name == AdapterVersion.base_model)
                .where(*where))
        if after and "@" in after:
            name, _, ver = after.rpartition("@")
            v = int(ver) if ver.isdigit() else 0
            stmt = stmt.where(or_(AdapterVersion.name > name, and_(AdapterVersion.name == name,
                                                                    AdapterVersion.version > v)))
        got = (await s.execute(stmt.order_by(AdapterVersion.name, AdapterVersion.version).limit(limit + 1))).all()
        more = len(got) > limit
        got = got[:limit]
        rows = [{**AdapterRecord.of(a).to_json(), "base_revision": rev} for a, rev in got]
        return Page(rows, total, rows[-1]["label"] if more else None)


async def audit(service: RegistryService, *, actor: str = "", action: str = "", target: str = "",
                before: int | None = None, limit: int = PAGE) -> Page:
    """Newest first; ``target`` matches exactly or, ending in ``*``, as a prefix."""

    async with service.db.read() as s:
        stmt = select(AuditEntry)
        if actor:
            stmt = stmt.where(AuditEntry.actor == actor)
        if action:
            stmt = stmt.where(AuditEntry.action == action)
        if target:
            stmt = stmt.where(_prefix(AuditEntry.target, target[:-1]) if target.endswith("*")
                              else AuditEntry.target == target)
        if before is not None:
            stmt = stmt.where(AuditEntry.id < before)
        rows = (await s.execute(stmt.order_by(AuditEntry.id.desc()).limit(limit + 1))).scalars().all()
        more = len(rows) > limit
        rows = rows[:limit]
        ids = {e.target.removeprefix("adapter:") for e in rows if e.target.startswith("adapter:")}
        names = await version_labels(s, ids)
        out = []
        for e in rows:
            d = AuditRecord.of(e).to_json()
            if e.target.startswith("adapter:"):
                ref = e.target.removeprefix("adapter:")
                d["target_label"] = f"adapter:{names.get(ref, ref)}"
            else:
                d["target_label"] = e.target
            out.append(d)
        return Page(out, None, str(rows[-1].id) if more else None)


async def labels(service: RegistryService, ids: set[str]) -> dict[str, str]:
    """``name@version`` of these adapter versions (``lookups.version_labels``)."""
    async with service.db.read() as s:
        return await version_labels(s, ids)

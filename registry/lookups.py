"""The row lookups every registry operation uses, inside its read or write
(``RegistryDatabase.read``/``write``): a missing row is the registry's 404 naming it."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from registry.errors import Invalid, NotFound
from registry.models import AdapterVersion, Binding, Tenant
from registry.records import UUID, BindingRecord


async def tenant_row(session: AsyncSession, slug: str, *, lock: bool = False) -> Tenant:
    """The tenant (``lock``: for update); 404 ``tenant_not_found``."""
    stmt = select(Tenant).where(Tenant.slug == slug)
    row = (await session.execute(stmt.with_for_update() if lock else stmt)).scalar_one_or_none()
    if row is None:
        raise NotFound(f"tenant {slug!r} does not exist", code="tenant_not_found", param="tenant")
    return row


async def adapter_row(session: AsyncSession, ref: str, *, lock: bool = False) -> AdapterVersion:
    """The adapter version by id (uuid) or ``name@version`` (``lock``: for update); 422 for
    another reference, 404 ``adapter_not_found``."""
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


async def binding_row(session: AsyncSession, tenant: str, alias: str) -> Binding:
    """The binding, locked for update; 404 ``tenant_not_found`` or ``binding_not_found``. An
    unknown tenant is told apart only when there is none (a binding's tenant exists: the foreign
    key), so a write costs no tenant lookup."""
    row = (await session.execute(
        select(Binding).where(Binding.tenant == tenant, Binding.alias == alias).with_for_update()
    )).scalar_one_or_none()
    if row is None:
        await tenant_row(session, tenant)
        raise NotFound(f"tenant {tenant!r} has no alias {alias!r}", code="binding_not_found", param="alias")
    return row


async def version_labels(session: AsyncSession, ids: Iterable[str | None]) -> dict[str, str]:
    """``name@version`` of the adapter versions with these ids (None and unknown ids are left out)."""
    wanted = {i for i in ids if i}
    if not wanted:
        return {}
    rows = await session.execute(select(AdapterVersion.id, AdapterVersion.name, AdapterVersion.version)
                                 .where(AdapterVersion.id.in_(wanted)))
    return {i: f"{n}@{v}" for i, n, v in rows}


async def binding_record(session: AsyncSession, b: Binding, known: dict[str, str] | None = None) -> BindingRecord:
    """The binding's record, its versions labelled; ``known`` labels (filled in here) are not
    looked up again."""
    labels = known if known is not None else {}
    missing = [i for i in (b.active_id, b.previous_id, b.canary_id) if i and i not in labels]
    if missing:
        labels.update(await version_labels(session, missing))
    return BindingRecord.of(b, labels)

"""Reading a ``RegistrySnapshot`` from the database: a full load, or a delta on a held snapshot.

Both run inside one REPEATABLE READ transaction (a consistent picture at one version) and
read only the columns the snapshot holds (no JSON columns: decoding them was most of the cost).

* ``load_full``: tenants, bindings and the adapter versions a binding routes to (active or
  canary), streamed in partitions from a server-side cursor; the loop gets a turn between
  partitions, so request handling never waits for a whole registry to be built.
* ``load_delta``: the audit log since the held version names what changed; only those tenants
  (and the tenants whose bindings route to a changed adapter version) are read again. Every
  other ``TenantView`` is shared with the held snapshot. Returns None when the audit log
  cannot account for every version in between (a gap): the caller then loads in full.

Neither has a fixed time limit: a load fails only when the database sends nothing for
``stall_s`` seconds, so a large registry is never cut off by design.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, and_, bindparam, or_, select, union
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.orm import aliased

from registry.models import AdapterVersion, AuditEntry, BaseModelRow, Binding, RegistryState, Tenant
from registry.snapshot import (
    AdapterVersionView,
    BaseModelView,
    BindingView,
    RegistrySnapshot,
    TenantMap,
    TenantView,
)

PARTITION = 500
"""Rows per partition of the full load (the loop gets a turn after each)."""
DELTA_MAX_TARGETS = 2000
"""More changed rows than this since the held version: a full load is cheaper than a delta."""
IN_CHUNK = 1000
"""Keys per ``IN (...)`` list (SQLite allows 32766 bound parameters, asyncpg 32767)."""

_TENANT_COLS = (Tenant.slug, Tenant.status, Tenant.requests_per_min, Tenant.tokens_per_min,
                Tenant.max_concurrent, Tenant.priority, Tenant.cache_scope)
_BINDING_COLS = (Binding.tenant, Binding.alias, Binding.active_id, Binding.canary_id, Binding.canary_percent,
                 Binding.enabled, Binding.on_disabled, Binding.base_model)
_VERSION_COLS = (AdapterVersion.id, AdapterVersion.name, AdapterVersion.version, AdapterVersion.base_model,
                 AdapterVersion.uri, AdapterVersion.sha256, AdapterVersion.rank, AdapterVersion.alpha,
                 AdapterVersion.status, AdapterVersion.created_at)
_EMPTY: dict[str, BindingView] = {}
"""Shared by every tenant without bindings (snapshot views are never mutated)."""

_intern = sys.intern


class LoadStalled(TimeoutError):
    """The database sent nothing for ``stall_s`` seconds during a snapshot load."""


async def _rows(conn: AsyncConnection, stmt: Select, stall_s: float) -> AsyncIterator[Sequence[Any]]:
    """Partitions of ``stmt``'s rows from a server-side cursor; each must arrive within ``stall_s``."""
    try:
        async with asyncio.timeout(stall_s):
            result = await conn.stream(stmt.execution_options(yield_per=PARTITION))
        parts = result.partitions(PARTITION).__aiter__()
        while True:
            async with asyncio.timeout(stall_s):
                try:
                    part = await parts.__anext__()
                except StopAsyncIteration:
                    return
            yield part
    except TimeoutError:
        raise LoadStalled(f"the registry database sent no rows for {stall_s:g} s") from None


async def _all(conn: AsyncConnection, stmt: Select, stall_s: float,
               params: dict[str, Any] | None = None) -> list[Any]:
    try:
        async with asyncio.timeout(stall_s):
            return list(await conn.execute(stmt, params))
    except TimeoutError:
        raise LoadStalled(f"the registry database did not answer for {stall_s:g} s") from None


def _version_view(r: Any) -> AdapterVersionView:
    return AdapterVersionView(id=r[0], name=_intern(r[1]), version=r[2], base_model=_intern(r[3]), uri=r[4],
                              sha256=r[5], rank=r[6], alpha=float(r[7]), status=_intern(r[8]),
                              created=_unix(r[9]))


def _unix(at: datetime | None) -> int:
    """A registry timestamp as unix seconds (SQLite hands back UTC without its zone)."""
    if at is None:
        return 0
    return int((at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp())


def _binding_view(r: Any, versions: dict[str, AdapterVersionView]) -> BindingView:
    canary = versions.get(r[3]) if r[3] else None
    return BindingView(alias=_intern(r[1]), active=versions.get(r[2]), canary=canary,
                       canary_percent=float(r[4]) if canary else 0.0, enabled=bool(r[5]),
                       on_disabled=_intern(r[6]), base_model=_intern(r[7]))  # type: ignore[arg-type]


def _tenant_view(r: Any, bindings: dict[str, BindingView] | None) -> TenantView:
    return TenantView(slug=r[0], status=_intern(r[1]), requests_per_min=r[2], tokens_per_min=r[3],
                      max_concurrent=r[4], priority=_intern(r[5]), bindings=bindings or _EMPTY,
                      cache_scope=_intern(r[6]) if r[6] else "")


async def _version(conn: AsyncConnection, stall_s: float) -> int:
    rows = await _all(conn, select(RegistryState.version).where(RegistryState.id == 1), stall_s)
    return int(rows[0][0])


async def _base_models(conn: AsyncConnection, stall_s: float) -> dict[str, BaseModelView]:
    rows = await _all(conn, select(BaseModelRow.name, BaseModelRow.revision, BaseModelRow.architecture,
                                   BaseModelRow.created_at), stall_s)
    return {r[0]: BaseModelView(name=r[0], revision=r[1], architecture=r[2], created=_unix(r[3])) for r in rows}


async def load_full(conn: AsyncConnection, stall_s: float = 15.0) -> RegistrySnapshot:
    """The whole registry at one version (run inside a REPEATABLE READ transaction)."""
    version = await _version(conn, stall_s)
    routed = union(select(Binding.active_id.label("id")),
                   select(Binding.canary_id.label("id")).where(Binding.canary_id.is_not(None))).subquery()
    versions: dict[str, AdapterVersionView] = {}
    async for part in _rows(conn, select(*_VERSION_COLS).where(AdapterVersion.id.in_(select(routed.c.id))),
                            stall_s):
        for r in part:
            versions[r[0]] = _version_view(r)
        await asyncio.sleep(0)
    bindings: dict[str, dict[str, BindingView]] = {}
    async for part in _rows(conn, select(*_BINDING_COLS), stall_s):
        for r in part:
            by_alias = bindings.get(r[0])
            if by_alias is None:
                by_alias = bindings[r[0]] = {}
            by_alias[_intern(r[1])] = _binding_view(r, versions)
        await asyncio.sleep(0)
    tenants: dict[str, TenantView] = {}
    async for part in _rows(conn, select(*_TENANT_COLS), stall_s):
        for r in part:
            tenants[r[0]] = _tenant_view(r, bindings.get(r[0]))
        await asyncio.sleep(0)
    return RegistrySnapshot(version=version, tenants=TenantMap(tenants),
                            base_models=await _base_models(conn, stall_s))


def _chunks(keys: Iterable[str]) -> Iterable[list[str]]:
    batch = sorted(keys)
    for i in range(0, len(batch), IN_CHUNK):
        yield batch[i:i + IN_CHUNK]


async def load_delta(conn: AsyncConnection, held: RegistrySnapshot,
                     stall_s: float = 15.0) -> RegistrySnapshot | None:
    """``held`` brought up to the current version, or None when only a full load can (a gap).

    A change to one tenant costs two queries: the version with the audit rows since ``held``,
    and the tenant with its bindings and their versions."""
    rows = await _all(conn, _CHANGES, stall_s, {"held": held.version})
    version = int(rows[0][0])
    if version == held.version:
        return held
    if version < held.version:
        return None  # the registry went back in time (restored or recreated): start over
    changes = [(r[1], r[2]) for r in rows if r[1] is not None]
    if len(rows) > DELTA_MAX_TARGETS or {r[0] for r in changes} != set(range(held.version + 1, version + 1)):
        return None
    tenants: set[str] = set()
    adapters: set[str] = set()
    base_models = False
    for _, target in changes:
        kind, _, key = target.partition(":")
        if kind == "tenant":
            tenants.add(key)
        elif kind == "binding":
            tenants.add(key.partition("/")[0])
        elif kind == "adapter":
            adapters.add(key)
        elif kind == "base_model":
            base_models = True
        else:
            return None  # a change this reader does not know how to apply
    for ids in _chunks(adapters):  # a changed version shows in every binding routing to it
        rows = await _all(conn, select(Binding.tenant).distinct()
                          .where(or_(Binding.active_id.in_(ids), Binding.canary_id.in_(ids))), stall_s)
        tenants.update(r[0] for r in rows)
    changed: dict[str, TenantView | None] = {}
    for slugs in _chunks(tenants):
        await _reread(conn, slugs, changed, stall_s)
    held_tenants = held.tenants if isinstance(held.tenants, TenantMap) else TenantMap(held.tenants)
    return RegistrySnapshot(version=version, tenants=held_tenants.replace(changed),
                            base_models=await _base_models(conn, stall_s) if base_models else held.base_models)


_ACTIVE = aliased(AdapterVersion)
_CANARY = aliased(AdapterVersion)
_REREAD_COLS = (*_TENANT_COLS, *_BINDING_COLS, *(getattr(_ACTIVE, c.key) for c in _VERSION_COLS),
                *(getattr(_CANARY, c.key) for c in _VERSION_COLS))
_T, _B, _V = len(_TENANT_COLS), len(_BINDING_COLS), len(_VERSION_COLS)
# Built once: composing a statement of this many columns costs more CPU than running it.
_REREAD = (select(*_REREAD_COLS).select_from(Tenant)
           .outerjoin(Binding, Binding.tenant == Tenant.slug)
           .outerjoin(_ACTIVE, _ACTIVE.id == Binding.active_id)
           .outerjoin(_CANARY, _CANARY.id == Binding.canary_id)
           .where(Tenant.slug.in_(bindparam("slugs", expanding=True))))
_CHANGES = (select(RegistryState.version, AuditEntry.registry_version, AuditEntry.target)
            .select_from(RegistryState)
            .outerjoin(AuditEntry, and_(AuditEntry.registry_version > bindparam("held"),
                                        AuditEntry.registry_version <= RegistryState.version))
            .where(RegistryState.id == 1).limit(DELTA_MAX_TARGETS + 1))


async def _reread(conn: AsyncConnection, slugs: list[str], out: dict[str, TenantView | None],
                  stall_s: float) -> None:
    """Tenants ``slugs`` as they are now, None where gone (one query: tenant x binding x active x canary)."""
    rows = await _all(conn, _REREAD, stall_s, {"slugs": slugs})
    versions: dict[str, AdapterVersionView] = {}
    tenants: dict[str, Any] = {}
    bindings: dict[str, dict[str, BindingView]] = {}
    for r in rows:
        tenants[r[0]] = r
        b = r[_T:_T + _B]
        if b[1] is None:  # a tenant without bindings
            continue
        for v in (r[_T + _B:_T + _B + _V], r[_T + _B + _V:]):
            if v[0] is not None and v[0] not in versions:
                versions[v[0]] = _version_view(v)
        bindings.setdefault(r[0], {})[_intern(b[1])] = _binding_view(b, versions)
    for slug in slugs:
        row = tenants.get(slug)
        out[slug] = None if row is None else _tenant_view(row, bindings.get(slug))

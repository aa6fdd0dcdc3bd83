"""The registry's rows as typed records (what ``RegistryService`` answers, each with the JSON the admin
API answers for it: ``to_json``), and the patterns its values match (the checks that apply them:
``registry.validators``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from loraplex.modelinfo import ModelInfo
from registry.models import (
    AdapterVersion,
    AuditEntry,
    BaseModelRow,
    Binding,
    Tenant,
)

SLUG = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,199}$")
CACHE_SCOPE_NAME = r"[a-z0-9][a-z0-9_.-]{0,62}"
CACHE_SCOPE = re.compile(f"^{CACHE_SCOPE_NAME}$")
"""A shared prefix-cache scope's name (``loraplex.prefix.shared_scope``); empty is the tenant's own."""
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAX_LIMIT = 2**31 - 1
DIMENSIONS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "context_length")


# --- rows as records, and their JSON -----------------------------------------------------------
# What ``RegistryService`` answers: each record is built from its row (``of``) and gives the
# admin API's JSON (``to_json``); ``audit_json`` is that JSON as an audit row records it (the
# timestamps are in the audit entry itself).

class JsonRecord(Protocol):
    """A record the admin API answers: its JSON."""

    def to_json(self) -> dict[str, Any]: ...


def _utc(value: datetime | None) -> datetime | None:
    """The timestamp with its zone: UTC (SQLite hands timestamps back without theirs)."""
    if value is None:
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _untimed(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in ("created_at", "updated_at")}


@dataclass(frozen=True, slots=True)
class TenantRecord:
    slug: str
    status: str
    requests_per_min: int
    tokens_per_min: int
    max_concurrent: int
    priority: str
    response_retention_s: int | None
    cache_scope: str
    row_version: int
    created_at: datetime | None
    updated_at: datetime | None

    @classmethod
    def of(cls, t: Tenant) -> TenantRecord:
        return cls(slug=t.slug, status=t.status, requests_per_min=t.requests_per_min,
                   tokens_per_min=t.tokens_per_min, max_concurrent=t.max_concurrent, priority=t.priority,
                   response_retention_s=t.response_retention_s, cache_scope=t.cache_scope or "",
                   row_version=t.row_version, created_at=_utc(t.created_at), updated_at=_utc(t.updated_at))

    def to_json(self) -> dict[str, Any]:
        return {"slug": self.slug, "status": self.status, "requests_per_min": self.requests_per_min,
                "tokens_per_min": self.tokens_per_min, "max_concurrent": self.max_concurrent,
                "priority": self.priority, "response_retention_s": self.response_retention_s,
                "cache_scope": self.cache_scope, "row_version": self.row_version,
                "created_at": _iso(self.created_at), "updated_at": _iso(self.updated_at)}

    def audit_json(self) -> dict[str, Any]:
        return _untimed(self.to_json())


@dataclass(frozen=True, slots=True)
class BaseModelRecord:
    info: ModelInfo
    """Its shape, name and content revision (``loraplex.modelinfo``)."""
    created_at: datetime | None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def revision(self) -> str:
        return self.info.revision

    @classmethod
    def of(cls, b: BaseModelRow) -> BaseModelRecord:
        return cls(ModelInfo(architecture=b.architecture, **{k: getattr(b, k) for k in DIMENSIONS}, name=b.name,
                             revision=b.revision), _utc(b.created_at))

    def to_json(self) -> dict[str, Any]:
        i = self.info
        return {"name": i.name, "revision": i.revision, "architecture": i.architecture,
                **{k: getattr(i, k) for k in DIMENSIONS}, "created_at": _iso(self.created_at)}

    def audit_json(self) -> dict[str, Any]:
        return _untimed(self.to_json())


@dataclass(frozen=True, slots=True)
class BindingUse:
    """A binding that routes to an adapter version: as its ``active`` or its ``canary``."""

    tenant: str
    alias: str
    role: str

    def to_json(self) -> dict[str, str]:
        return {"tenant": self.tenant, "alias": self.alias, "role": self.role}


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    id: str
    name: str
    version: int
    label: str
    base_model: str
    uri: str
    sha256: str
    size_bytes: int
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    owner_tenant: str | None
    status: str
    status_reason: str | None
    verification: dict[str, Any] | None
    row_version: int
    created_at: datetime | None
    detached: tuple[BindingUse, ...] = ()
    """The bindings a forced disable changed (answered as ``detached`` where there are any)."""

    @classmethod
    def of(cls, a: AdapterVersion) -> AdapterRecord:
        return cls(id=a.id, name=a.name, version=a.version, label=a.label, base_model=a.base_model, uri=a.uri,
                   sha256=a.sha256, size_bytes=a.size_bytes, rank=a.rank, alpha=a.alpha,
                   target_modules=tuple(a.target_modules), owner_tenant=a.owner_tenant, status=a.status,
                   status_reason=a.status_reason, verification=a.verification, row_version=a.row_version,
                   created_at=_utc(a.created_at))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "name": self.name, "version": self.version, "label": self.label,
            "base_model": self.base_model, "uri": self.uri, "sha256": self.sha256, "size_bytes": self.size_bytes,
            "rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules),
            "owner_tenant": self.owner_tenant, "status": self.status, "status_reason": self.status_reason,
            "verification": self.verification, "row_version": self.row_version,
            "created_at": _iso(self.created_at)}
        if self.detached:
            out["detached"] = [u.to_json() for u in self.detached]
        return out

    def audit_json(self) -> dict[str, Any]:
        return _untimed(self.to_json())


@dataclass(frozen=True, slots=True)
class VersionRef:
    """An adapter version a binding names: its id and ``name@version``."""

    id: str
    label: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "label": self.label}


@dataclass(frozen=True, slots=True)
class BindingRecord:
    tenant: str
    alias: str
    base_model: str
    active: VersionRef
    previous: VersionRef | None
    canary: VersionRef | None
    canary_percent: float
    enabled: bool
    on_disabled: str
    row_version: int
    updated_at: datetime | None

    @classmethod
    def of(cls, b: Binding, labels: dict[str, str] | None = None) -> BindingRecord:
        """``labels``: ``name@version`` by version id (a version not in it is labelled by its id)."""
        known = labels or {}

        def ref(adapter_id: str | None) -> VersionRef | None:
            return None if adapter_id is None else VersionRef(adapter_id, known.get(adapter_id, adapter_id))

        return cls(tenant=b.tenant, alias=b.alias, base_model=b.base_model,
                   active=VersionRef(b.active_id, known.get(b.active_id, b.active_id)),
                   previous=ref(b.previous_id), canary=ref(b.canary_id), canary_percent=b.canary_percent,
                   enabled=b.enabled, on_disabled=b.on_disabled, row_version=b.row_version,
                   updated_at=_utc(b.updated_at))

    def to_json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "alias": self.alias, "base_model": self.base_model,
                "active": self.active.to_json(),
                "previous": self.previous.to_json() if self.previous is not None else None,
                "canary": self.canary.to_json() if self.canary is not None else None,
                "canary_percent": self.canary_percent, "enabled": self.enabled, "on_disabled": self.on_disabled,
                "row_version": self.row_version, "updated_at": _iso(self.updated_at)}

    def audit_json(self) -> dict[str, Any]:
        return _untimed(self.to_json())


@dataclass(frozen=True, slots=True)
class DeletedBinding:
    """What an unbind answers: the alias that is gone."""

    tenant: str
    alias: str

    def to_json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "alias": self.alias, "deleted": True}


@dataclass(frozen=True, slots=True)
class AuditRecord:
    id: int
    registry_version: int
    at: datetime | None
    actor: str
    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None

    @classmethod
    def of(cls, e: AuditEntry) -> AuditRecord:
        return cls(id=e.id, registry_version=e.registry_version, at=_utc(e.at), actor=e.actor, action=e.action,
                   target=e.target, before=e.before, after=e.after)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "registry_version": self.registry_version, "at": _iso(self.at),
                "actor": self.actor, "action": self.action, "target": self.target, "before": self.before,
                "after": self.after}

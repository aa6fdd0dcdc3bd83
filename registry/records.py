"""The registry's rows as the JSON the admin API answers, and the patterns its values match (the
checks that apply them: ``registry.validators``)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

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


# --- row -> JSON ------------------------------------------------------------------------------

def _iso(value: datetime | None) -> str | None:
    """ISO 8601 in UTC (SQLite hands timestamps back without their zone)."""
    if value is None:
        return None
    return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).isoformat()


def tenant_dict(t: Tenant) -> dict[str, Any]:
    return {"slug": t.slug, "status": t.status, "requests_per_min": t.requests_per_min,
            "tokens_per_min": t.tokens_per_min, "max_concurrent": t.max_concurrent, "priority": t.priority,
            "response_retention_s": t.response_retention_s, "cache_scope": t.cache_scope or "",
            "row_version": t.row_version, "created_at": _iso(t.created_at), "updated_at": _iso(t.updated_at)}


def base_model_dict(b: BaseModelRow) -> dict[str, Any]:
    out: dict[str, Any] = {"name": b.name, "revision": b.revision, "architecture": b.architecture}
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


def audit_view(d: dict[str, Any]) -> dict[str, Any]:
    """A row's dict as recorded in the audit log (timestamps are in the entry itself)."""
    return {k: v for k, v in d.items() if k not in ("created_at", "updated_at")}

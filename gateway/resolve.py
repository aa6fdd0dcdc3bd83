"""Resolution: (tenant, requested model name) -> the adapter version that answers.

Own aliases and base model names only (anything else is the same 404), the canary split by a
stable hash of (tenant, end user or request id), per-tenant tables cached per snapshot:
docs/DESIGN.md, "Resolve and canary".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError
from loraplex.wire import AdapterRef
from registry.snapshot import AdapterVersionView, BindingView, RegistrySnapshot, TenantView

BASE_LABEL = "base"


@dataclass(frozen=True, slots=True)
class Resolution:
    alias: str
    base_model: str
    adapter: AdapterRef | None
    """None: the base model answers."""
    label: str
    """``name@version`` of the adapter, or ``base``."""
    fallback: bool = False
    """True when a disabled binding fell back to the base model."""
    canary: bool = False
    wire: dict[str, Any] | None = None
    """``adapter.to_dict()``, computed once per snapshot (the request path reuses it)."""
    judged: bool = False
    """The binding has a canary: requests of both arms leave samples for the canary judge."""


@dataclass(frozen=True, slots=True)
class _Entry:
    alias: str
    base_model: str
    active: Resolution | None
    canary: Resolution | None
    canary_bp: int
    """Canary share in basis points (1/100 of a percent)."""
    refuse: bool = False


def _ref(v: AdapterVersionView, revisions: dict[str, str]) -> AdapterRef:
    """The worker's view of a version: base model rows are immutable, so the version's base
    revision is its base model's."""
    return AdapterRef(id=v.id, name=v.label, uri=v.uri, sha256=v.sha256 or None, rank=v.rank,
                      base_revision=revisions.get(v.base_model, ""))


def canary_bucket(tenant: str, key: str) -> int:
    """Stable bucket in [0, 10000) for (tenant, end user or request id)."""
    digest = hashlib.blake2b(f"{tenant}\x00{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 10_000


def _entry(binding: BindingView, default_base: str, revisions: dict[str, str]) -> _Entry:
    base = binding.base_model or (binding.active.base_model if binding.active else "") or default_base
    alias = binding.alias
    if not binding.enabled or binding.active is None:
        if binding.on_disabled == "base":
            res = Resolution(alias, base, None, BASE_LABEL, fallback=True)
            return _Entry(alias, base, res, None, 0)
        return _Entry(alias, base, None, None, 0, refuse=True)
    ref = _ref(binding.active, revisions)
    judged = binding.canary is not None and binding.canary_percent > 0
    active = Resolution(alias, base, ref, binding.active.label, wire=ref.to_dict(), judged=judged)
    canary = None
    bp = 0
    if judged:
        assert binding.canary is not None
        cref = _ref(binding.canary, revisions)
        canary = Resolution(alias, base, cref, binding.canary.label, canary=True, wire=cref.to_dict(), judged=True)
        bp = max(0, min(10_000, round(binding.canary_percent * 100)))
    return _Entry(alias, base, active, canary, bp)


class Resolver:
    def __init__(self) -> None:
        self._snapshot: RegistrySnapshot | None = None
        self._tables: dict[str, dict[str, _Entry]] = {}

    def _table(self, snapshot: RegistrySnapshot, tenant: TenantView) -> dict[str, _Entry]:
        if snapshot is not self._snapshot:
            self._snapshot = snapshot
            self._tables = {}
        table = self._tables.get(tenant.slug)
        if table is None:
            default_base = next(iter(snapshot.base_models), "")
            revisions = {name: b.revision for name, b in snapshot.base_models.items()}
            table = {}
            for name in snapshot.base_models:
                table[name] = _Entry(name, name, Resolution(name, name, None, BASE_LABEL), None, 0)
            for alias, binding in tenant.bindings.items():
                table[alias] = _entry(binding, default_base, revisions)
            self._tables[tenant.slug] = table
        return table

    def models(self, snapshot: RegistrySnapshot, tenant: TenantView) -> list[str]:
        """Names this tenant may call: its aliases, then the base models."""
        return list(tenant.bindings) + [b for b in snapshot.base_models if b not in tenant.bindings]

    def resolve(self, snapshot: RegistrySnapshot, tenant: TenantView, model: str, sticky_key: str) -> Resolution:
        entry = self._table(snapshot, tenant).get(model)
        if entry is None:
            raise GatewayError(404, f"The model '{model}' does not exist or you do not have access to it.",
                               code="model_not_found", param="model")
        if entry.refuse:
            raise GatewayError(503, f"The model '{model}' is temporarily disabled.", code="model_disabled",
                               param="model")
        if entry.canary is not None and canary_bucket(tenant.slug, sticky_key) < entry.canary_bp:
            return entry.canary
        assert entry.active is not None
        return entry.active

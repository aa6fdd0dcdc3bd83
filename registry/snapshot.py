"""Reader-side view of the registry: what the gateway resolves every request against.

A ``RegistrySnapshot`` is an immutable, fully materialised picture of the registry at one
``version`` (tenant -> aliases -> adapter versions -> limits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class AdapterVersionView:
    id: str
    """Stable version id: the routing key and the engine's cache key."""
    name: str
    version: int
    base_model: str
    uri: str
    sha256: str
    rank: int
    alpha: float
    status: str

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True, slots=True)
class BindingView:
    alias: str
    active: AdapterVersionView | None
    canary: AdapterVersionView | None = None
    canary_percent: float = 0.0
    enabled: bool = True
    on_disabled: Literal["base", "refuse"] = "refuse"
    """What a disabled binding does: answer with the base model, or refuse with 503."""
    base_model: str = ""


@dataclass(frozen=True, slots=True)
class TenantView:
    slug: str
    status: str
    requests_per_min: int
    tokens_per_min: int
    max_concurrent: int
    priority: str
    bindings: dict[str, BindingView] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.status == "active"


@dataclass(frozen=True, slots=True)
class BaseModelView:
    name: str
    revision: str
    architecture: str


@dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    version: int
    tenants: dict[str, TenantView] = field(default_factory=dict)
    base_models: dict[str, BaseModelView] = field(default_factory=dict)

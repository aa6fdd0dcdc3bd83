"""Registry schema (SQLAlchemy 2 typed ORM): base models, adapter versions, tenants,
bindings, the append-only audit log and the one-row registry version.

Schema changes go through Alembic (``migrations/``); a test proves the two agree.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ADAPTER_STATUSES = ("pending", "active", "disabled", "failed")
TENANT_STATUSES = ("active", "disabled")
ON_DISABLED = ("base", "refuse")

BigId = BigInteger().with_variant(Integer(), "sqlite")
"""64-bit ids on PostgreSQL; INTEGER on SQLite so the column is the rowid (autoincrement)."""


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[str]: JSON}


class RegistryState(Base):
    """Exactly one row (id 1): the registry-wide, monotonically increasing version."""

    __tablename__ = "registry_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)


class BaseModelRow(Base):
    __tablename__ = "base_models"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    revision: Mapped[str] = mapped_column(String(128), nullable=False)
    architecture: Mapped[str] = mapped_column(String(64), nullable=False)
    hidden_size: Mapped[int] = mapped_column(Integer, nullable=False)
    intermediate_size: Mapped[int] = mapped_column(Integer, nullable=False)
    num_layers: Mapped[int] = mapped_column(Integer, nullable=False)
    num_heads: Mapped[int] = mapped_column(Integer, nullable=False)
    num_kv_heads: Mapped[int] = mapped_column(Integer, nullable=False)
    head_dim: Mapped[int] = mapped_column(Integer, nullable=False)
    vocab_size: Mapped[int] = mapped_column(Integer, nullable=False)
    context_length: Mapped[int] = mapped_column(Integer, nullable=False, default=2048)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'disabled')", name="status"),
        CheckConstraint("priority IN ('high', 'normal', 'low')", name="priority"),
        CheckConstraint("requests_per_min >= 0 AND tokens_per_min >= 0 AND max_concurrent >= 0",
                        name="limits"),
    )

    slug: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="active")
    requests_per_min: Mapped[int] = mapped_column(Integer, nullable=False, default=600)
    tokens_per_min: Mapped[int] = mapped_column(Integer, nullable=False, default=100_000)
    max_concurrent: Mapped[int] = mapped_column(Integer, nullable=False, default=16)
    priority: Mapped[str] = mapped_column(String(16), nullable=False, default="normal")
    response_retention_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """How long stored Responses are kept (None: ``Settings.response_retention_s``; capped by
    ``Settings.response_max_retention_s``)."""
    cache_scope: Mapped[str] = mapped_column(String(64), nullable=False, default="", server_default=text("''"))
    """The shared prefix-cache scope an operator put this tenant in; empty: its own. A shared KV
    cache answers faster for prompts another member sent (a timing side channel), so tenants share
    only when an operator says so (``registry.records.CACHE_SCOPE``; ``loraplex.prefix``)."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    row_version: Mapped[int] = mapped_column(Integer, nullable=False, default=1, server_default=text("1"))
    """Bumped on every change of this tenant (its ``ETag``; ``If-Match`` checks it)."""

    __mapper_args__ = {"version_id_col": row_version}


class AdapterVersion(Base):
    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("name", "version", name="uq_adapter_versions_name_version"),
        CheckConstraint("status IN ('pending', 'active', 'disabled', 'failed')", name="status"),
        CheckConstraint("version >= 1", name="version"),
        CheckConstraint("rank >= 1", name="rank"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200), nullable=False)
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    base_model: Mapped[str] = mapped_column(ForeignKey("base_models.name"), nullable=False, index=True)
    uri: Mapped[str] = mapped_column(Text, nullable=False)
    sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    """The version digest over every file it is served from (``loraplex.digest``)."""
    size_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    rank: Mapped[int] = mapped_column(Integer, nullable=False)
    alpha: Mapped[float] = mapped_column(Float, nullable=False)
    target_modules: Mapped[list[str]] = mapped_column(JSON, nullable=False)
    owner_tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.slug"), nullable=True, index=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="pending")
    status_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    verification: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    row_version: Mapped[int] = mapped_column(Integer, nullable=False, default=1, server_default=text("1"))
    """Bumped on every change of this version's row (its ``ETag``; ``If-Match`` checks it)."""

    __mapper_args__ = {"version_id_col": row_version}

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


class Binding(Base):
    """A tenant's alias (the ``model`` its backend sends) -> adapter versions."""

    __tablename__ = "bindings"
    __table_args__ = (
        UniqueConstraint("tenant", "alias", name="uq_bindings_tenant_alias"),
        CheckConstraint("canary_percent >= 0 AND canary_percent <= 100", name="canary_percent"),
        CheckConstraint("on_disabled IN ('base', 'refuse')", name="on_disabled"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.slug"), nullable=False)
    alias: Mapped[str] = mapped_column(String(200), nullable=False)
    base_model: Mapped[str] = mapped_column(ForeignKey("base_models.name"), nullable=False)
    active_id: Mapped[str] = mapped_column(ForeignKey("adapter_versions.id"), nullable=False, index=True)
    previous_id: Mapped[str | None] = mapped_column(ForeignKey("adapter_versions.id"), nullable=True)
    canary_id: Mapped[str | None] = mapped_column(ForeignKey("adapter_versions.id"), nullable=True, index=True)
    canary_percent: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    enabled: Mapped[bool] = mapped_column(Boolean, nullable=False, default=True)
    on_disabled: Mapped[str] = mapped_column(String(16), nullable=False, default="refuse")
    row_version: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    """Bumped on every change of this binding (optimistic check besides the writer lock)."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)

    __mapper_args__ = {"version_id_col": row_version}


class AuditEntry(Base):
    """Append-only: one row per change, written in the change's own transaction."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_target", "target"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    registry_version: Mapped[int] = mapped_column(BigInteger, nullable=False, index=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    actor: Mapped[str] = mapped_column(String(200), nullable=False)
    action: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    target: Mapped[str] = mapped_column(String(400), nullable=False)
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class CanaryPolicy(Base):
    """How a binding's canaries are judged (``registry.canary``), and where the current one stands.

    The configuration (steps, interval, minimum sample, checks and the tests they use) is the
    operator's; the state (``status``, ``step``, ``failures``, ``last``) is the judge's. The
    version being judged is ``canary_id``: a new canary on the binding starts over at step 0.
    """

    __tablename__ = "canary_policies"
    __table_args__ = (UniqueConstraint("tenant", "alias", name="uq_canary_policies_tenant_alias"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.slug"), nullable=False)
    alias: Mapped[str] = mapped_column(String(200), nullable=False)
    steps: Mapped[list[float]] = mapped_column(JSON, nullable=False)
    interval_s: Mapped[float] = mapped_column(Float, nullable=False)
    min_requests: Mapped[int] = mapped_column(Integer, nullable=False)
    max_failures: Mapped[int] = mapped_column(Integer, nullable=False)
    checks: Mapped[dict[str, float]] = mapped_column(JSON, nullable=False)
    proportion_test: Mapped[str] = mapped_column(String(32), nullable=False)
    sample_test: Mapped[str] = mapped_column(String(32), nullable=False)
    alpha: Mapped[float] = mapped_column(Float, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="waiting")
    canary_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    step: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    step_started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    failures: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    last: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    row_version: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)


class StoredResponse(Base):
    """A Response kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` (``store``),
    scoped to its tenant and removed once ``expires_at`` passes (``registry.responses``)."""

    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_expires_at", "expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), nullable=False)
    """The tenant's slug (tenants are disabled, never deleted; no foreign key on the hot write)."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    previous_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    depth: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    """Responses in its chain, itself included."""
    model: Mapped[str] = mapped_column(String(200), nullable=False)
    adapter: Mapped[str] = mapped_column(String(300), nullable=False)
    """The version that answered (``name@version``, or ``base``)."""
    response: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    input_items: Mapped[list[Any]] = mapped_column(JSON, nullable=False)
    context: Mapped[list[Any]] = mapped_column(JSON, nullable=False)
    """The items before this turn's input, oldest first (a continuation replays them)."""


USAGE_WIDTHS = ("m", "h", "d")
"""A usage bucket's width: a minute, an hour, a day (UTC, aligned to the epoch)."""


class UsageBucket(Base):
    """Usage of one (tenant, alias, adapter version, outcome) over one bucket (``registry.usage``).

    ``alias`` is the model name the client called (a tenant alias or a base model's name);
    ``version`` the adapter version id that answered, ``""`` for the base model; ``outcome``
    ``ok``, ``cancelled``, ``4xx:<code>``, ``429:<reason>`` or ``5xx:<code>``. Token counts are
    what the limiter settled; ``peak_concurrent`` the most requests the tenant had in flight
    when one of these was admitted (a maximum: rollups take the max, not the sum)."""

    __tablename__ = "usage_buckets"
    __table_args__ = (CheckConstraint("width IN ('m', 'h', 'd')", name="width"),
                      Index("ix_usage_buckets_tenant", "width", "tenant", "start"))

    width: Mapped[str] = mapped_column(String(1), primary_key=True)
    start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    """The bucket's first second (unix time)."""
    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    alias: Mapped[str] = mapped_column(String(200), primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    outcome: Mapped[str] = mapped_column(String(64), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    peak_concurrent: Mapped[int] = mapped_column(Integer, nullable=False)


class UsageFlush(Base):
    """A gateway's flush already applied: its buckets were added in the same transaction that
    inserted this row, so a retried flush (commit outcome unknown) finds it and adds nothing."""

    __tablename__ = "usage_flushes"
    __table_args__ = (Index("ix_usage_flushes_applied_at", "applied_at"),)

    gateway: Mapped[str] = mapped_column(String(128), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    applied_at: Mapped[int] = mapped_column(BigInteger, nullable=False)


class UsageRollup(Base):
    """How far minute buckets have been rolled up into hours (``h``) and hours into days (``d``):
    every bucket before ``done_until`` (unix seconds) of that width is complete. ``t`` (PostgreSQL
    only): every day before it has its ``UsageTenantDay`` rows."""

    __tablename__ = "usage_rollups"

    width: Mapped[str] = mapped_column(String(1), primary_key=True)
    done_until: Mapped[int] = mapped_column(BigInteger, nullable=False)


class UsageLateWrites(Base):
    """How many flushes have added late minutes to rows of a rolled-up width (``h``, ``d``):
    counted in the flush's own transaction, so the rows before that width's watermark are the
    same for as long as the count is (``registry.usage_query`` keeps finished days' pages by it).
    A width no late minute reached yet has no row (a count of 0)."""

    __tablename__ = "usage_late_writes"

    width: Mapped[str] = mapped_column(String(1), primary_key=True)
    flushes: Mapped[int] = mapped_column(BigInteger, nullable=False)


class UsageTenantDay(Base):
    """One tenant's usage of a finished day as ``GET /admin/usage`` answers it: the JSON text of
    its result in a page of days grouped by tenant (``registry.usage_tenant_days``). PostgreSQL
    renders a day's rows in the transaction that rolls the day up, and a tenant's again in the
    flush that adds a late minute to its day; they are complete for the days before the ``t``
    watermark of ``UsageRollup``. SQLite keeps none (it reads every page from the ledger)."""

    __tablename__ = "usage_tenant_days"

    day: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    """The day's first second (unix time, a UTC midnight)."""
    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    result: Mapped[str] = mapped_column(Text, nullable=False)

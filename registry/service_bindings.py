"""Bindings: an alias's active version, its previous one (rollback) and its canary. The
operations ``RegistryService`` offers for them (the admin API's), on its ``RegistryDatabase``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import select

from registry import validators
from registry.errors import Conflict, Invalid, NotFound
from registry.lookups import adapter_row, binding_record, binding_row, tenant_row
from registry.models import (
    AdapterVersion,
    Binding,
    utcnow,
)
from registry.records import BindingRecord, DeletedBinding
from registry.service_core import RegistryDatabase, Tx


def check_bindable(b_tenant: str, adapter: AdapterVersion, base_model: str | None) -> None:
    """Refuse (422) to route ``b_tenant``'s binding (serving ``base_model``; None: a new one) to
    ``adapter``: not active, another tenant's, or for another base model."""
    if adapter.status != "active":
        raise Invalid(f"adapter {adapter.label} is {adapter.status}; only active versions can be bound",
                      code="adapter_not_active", param="adapter")
    if adapter.owner_tenant is not None and adapter.owner_tenant != b_tenant:
        raise Invalid(f"adapter {adapter.label} belongs to another tenant and cannot be bound to "
                      f"{b_tenant!r}", code="adapter_owner_mismatch", param="adapter")
    if base_model is not None and adapter.base_model != base_model:
        raise Invalid(f"adapter {adapter.label} is for base model {adapter.base_model!r}; the binding "
                      f"serves {base_model!r}", code="base_model_mismatch", param="adapter")


class Bindings:
    """Binding reads and writes; results are ``records.BindingRecord`` (the admin API answers their
    ``to_json()``)."""

    def __init__(self, db: RegistryDatabase) -> None:
        self.db = db

    async def _binding_op(self, tenant: str, alias: str, action: str, actor: str,
                          mutate: Callable[[Tx, Binding], Awaitable[bool]], if_match: int | None = None,
                          judgement: dict[str, Any] | None = None) -> BindingRecord:
        validators.slug(tenant)
        validators.name(alias, "alias")

        async with self.db.write(actor) as tx:
            b = await binding_row(tx.session, tenant, alias)
            validators.match(b.row_version, if_match, f"binding {tenant}/{alias}")
            labels: dict[str, str] = {}
            before = await binding_record(tx.session, b, labels)
            if not await mutate(tx, b):
                return before
            b.updated_at = utcnow()
            await tx.session.flush()
            out = await binding_record(tx.session, b, labels)
            after = out.audit_json()
            if judgement is not None:  # the canary judge's numbers that decided this change
                after["judgement"] = judgement
            tx.audit(action, f"binding:{tenant}/{alias}", before.audit_json(), after)
            return out

    async def bind(self, tenant: str, alias: str, adapter: str, *, on_disabled: str | None = None,
                   actor: str = "admin", if_match: int | None = None) -> BindingRecord:
        """Point ``alias`` at an active adapter version (create, or re-point: current -> previous)."""
        validators.slug(tenant)
        validators.name(alias, "alias")
        if on_disabled is not None:
            validators.on_disabled(on_disabled)

        async with self.db.write(actor) as tx:
            await tenant_row(tx.session, tenant)
            new = await adapter_row(tx.session, adapter)
            b = (await tx.session.execute(select(Binding).where(Binding.tenant == tenant, Binding.alias == alias)
                                          .with_for_update())).scalar_one_or_none()
            validators.match(b.row_version if b is not None else None, if_match, f"binding {tenant}/{alias}")
            now = utcnow()
            if b is None:
                check_bindable(tenant, new, None)
                b = Binding(tenant=tenant, alias=alias, base_model=new.base_model, active_id=new.id,
                            previous_id=None, canary_id=None, canary_percent=0.0, enabled=True,
                            on_disabled=on_disabled or "refuse", created_at=now, updated_at=now)
                tx.session.add(b)
                await tx.session.flush()
                out = await binding_record(tx.session, b)
                tx.audit("binding.create", f"binding:{tenant}/{alias}", None, out.audit_json())
                return out
            check_bindable(tenant, new, b.base_model)
            before = await binding_record(tx.session, b)
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
            out = await binding_record(tx.session, b)
            tx.audit("binding.bind", f"binding:{tenant}/{alias}", before.audit_json(), out.audit_json())
            return out

    async def rollback(self, tenant: str, alias: str, *, actor: str = "admin",
                       if_match: int | None = None) -> BindingRecord:
        """Swap active and previous in one step (a second rollback rolls forward again)."""
        async def mutate(tx: Tx, b: Binding) -> bool:
            if b.previous_id is None:
                raise Conflict(f"{tenant}/{alias} has no previous version to roll back to", code="no_previous")
            prev = await adapter_row(tx.session, b.previous_id)
            check_bindable(tenant, prev, b.base_model)
            b.active_id, b.previous_id = prev.id, b.active_id
            if b.canary_id == prev.id:
                b.canary_id, b.canary_percent = None, 0.0
            return True

        return await self._binding_op(tenant, alias, "binding.rollback", actor, mutate, if_match)

    async def canary_start(self, tenant: str, alias: str, adapter: str, percent: float, *,
                           actor: str = "admin", if_match: int | None = None) -> BindingRecord:
        pct = validators.percent(percent)

        async def mutate(tx: Tx, b: Binding) -> bool:
            new = await adapter_row(tx.session, adapter)
            check_bindable(tenant, new, b.base_model)
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
                         if_match: int | None = None, judgement: dict[str, Any] | None = None) -> BindingRecord:
        pct = validators.percent(percent)

        async def mutate(tx: Tx, b: Binding) -> bool:
            if b.canary_id is None:
                raise Conflict(f"{tenant}/{alias} has no canary", code="no_canary")
            if b.canary_percent == pct:
                return False
            b.canary_percent = pct
            return True

        return await self._binding_op(tenant, alias, "binding.canary_set", actor, mutate, if_match, judgement)

    async def canary_promote(self, tenant: str, alias: str, *, actor: str = "admin",
                             if_match: int | None = None, judgement: dict[str, Any] | None = None) -> BindingRecord:
        async def mutate(tx: Tx, b: Binding) -> bool:
            if b.canary_id is None:
                raise Conflict(f"{tenant}/{alias} has no canary", code="no_canary")
            canary = await adapter_row(tx.session, b.canary_id)
            check_bindable(tenant, canary, b.base_model)
            b.previous_id, b.active_id = b.active_id, canary.id
            b.canary_id, b.canary_percent = None, 0.0
            return True

        return await self._binding_op(tenant, alias, "binding.canary_promote", actor, mutate, if_match, judgement)

    async def canary_abort(self, tenant: str, alias: str, *, actor: str = "admin",
                           if_match: int | None = None, judgement: dict[str, Any] | None = None) -> BindingRecord:
        async def mutate(tx: Tx, b: Binding) -> bool:
            if b.canary_id is None:
                raise Conflict(f"{tenant}/{alias} has no canary", code="no_canary")
            b.canary_id, b.canary_percent = None, 0.0
            return True

        return await self._binding_op(tenant, alias, "binding.canary_abort", actor, mutate, if_match, judgement)

    async def set_binding_enabled(self, tenant: str, alias: str, enabled: bool, *,
                                  on_disabled: str | None = None, actor: str = "admin",
                                  if_match: int | None = None) -> BindingRecord:
        if not isinstance(enabled, bool):
            raise Invalid("enabled must be a boolean", param="enabled")
        if on_disabled is not None:
            validators.on_disabled(on_disabled)
        elif not enabled:
            on_disabled = "refuse"  # per operation: a plain disable refuses, whatever was chosen before

        async def mutate(tx: Tx, b: Binding) -> bool:
            if enabled:
                active = await adapter_row(tx.session, b.active_id)
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

    async def unbind(self, tenant: str, alias: str, *, actor: str = "admin",
                     if_match: int | None = None) -> DeletedBinding:
        """Remove an alias: the tenant's requests for it get 404 from then on."""
        validators.slug(tenant)
        validators.name(alias, "alias")

        async with self.db.write(actor) as tx:
            b = await binding_row(tx.session, tenant, alias)
            validators.match(b.row_version, if_match, f"binding {tenant}/{alias}")
            before = await binding_record(tx.session, b)
            await tx.session.delete(b)
            await tx.session.flush()
            tx.audit("binding.delete", f"binding:{tenant}/{alias}", before.audit_json(), None)
            return DeletedBinding(tenant, alias)

    async def get_binding(self, tenant: str, alias: str) -> BindingRecord:
        async with self.db.read() as s:
            await tenant_row(s, tenant)
            b = (await s.execute(select(Binding).where(Binding.tenant == tenant, Binding.alias == alias)))\
                .scalar_one_or_none()
            if b is None:
                raise NotFound(f"tenant {tenant!r} has no alias {alias!r}", code="binding_not_found",
                               param="alias")
            return await binding_record(s, b)

    async def list_bindings(self, tenant: str | None = None) -> list[BindingRecord]:
        async with self.db.read() as s:
            stmt = select(Binding).order_by(Binding.tenant, Binding.alias)
            if tenant:
                await tenant_row(s, tenant)
                stmt = stmt.where(Binding.tenant == tenant)
            rows = (await s.execute(stmt)).scalars().all()
            ids = {i for b in rows for i in (b.active_id, b.previous_id, b.canary_id) if i}
            names = select(AdapterVersion.id, AdapterVersion.name, AdapterVersion.version)
            if len(ids) <= 1000:  # one tenant's: only its versions (beyond that, one scan beats a huge IN)
                names = names.where(AdapterVersion.id.in_(ids))
            labels = {r.id: f"{r.name}@{r.version}" for r in (await s.execute(names))} if ids else {}
            return [BindingRecord.of(b, labels) for b in rows]


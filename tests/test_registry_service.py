"""Registry service operations on PostgreSQL and SQLite: each one writes its audit row and
bumps the registry version; rules (ownership, base model, status) are enforced; a failure
mid-operation leaves registry and audit log unchanged; concurrent races lose no update."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from sqlalchemy import func, select

from registry.errors import Conflict, Invalid, NotFound
from registry.models import AdapterVersion, AuditEntry, Binding, Tenant
from registry.records import AdapterRecord, DeletedBinding
from registry.service import RegistryService
from tests.registry_support import OTHER, TINY, fresh_registry, make_settings, write_adapter


@pytest.fixture
async def svc(db_url, tmp_path):
    await fresh_registry(db_url)
    service = RegistryService(make_settings(tmp_path, db_url))
    yield service
    await service.close()


async def _adapter(svc: RegistryService, name: str, *, owner: str | None = None, info=TINY, seed: int = 0,
                   activate: bool = True) -> AdapterRecord:
    d = write_adapter(Path(svc.settings.resolved_adapter_root()) / f"{name}-{seed}-{owner}", info, seed=seed)
    a = await svc.register_adapter(name, str(d), info.name, owner=owner)
    if activate:
        a = await svc.activate_adapter(a.id, verification={"probe": "ok"})
    return a


async def _counts(svc: RegistryService) -> tuple[int, int, int, int, int]:
    async with svc.sessions() as s:
        return (await svc.version(),
                (await s.execute(select(func.count()).select_from(AuditEntry))).scalar_one(),
                (await s.execute(select(func.count()).select_from(Tenant))).scalar_one(),
                (await s.execute(select(func.count()).select_from(AdapterVersion))).scalar_one(),
                (await s.execute(select(func.count()).select_from(Binding))).scalar_one())


async def test_tenant_lifecycle_and_audit(svc):
    t = await svc.create_tenant("acme", requests_per_min=10, tokens_per_min=1000, max_concurrent=2,
                                priority="high", actor="alice")
    assert t.status == "active" and t.priority == "high"
    assert await svc.version() == 1
    with pytest.raises(Conflict) as exc:
        await svc.create_tenant("acme")
    assert exc.value.code == "tenant_exists"
    assert (await svc.disable_tenant("acme", actor="bob")).status == "disabled"
    assert (await svc.enable_tenant("acme")).status == "active"
    t = await svc.set_tenant_limits("acme", tokens_per_min=5, priority="low")
    assert (t.requests_per_min, t.tokens_per_min, t.priority) == (10, 5, "low")
    with pytest.raises(Invalid) as exc:
        await svc.set_tenant_limits("acme", requests_per_min=-1)
    assert exc.value.code == "invalid_limit"
    with pytest.raises(Invalid):
        await svc.set_tenant_limits("acme", priority="urgent")
    with pytest.raises(NotFound):
        await svc.disable_tenant("nobody")
    with pytest.raises(Invalid):
        await svc.create_tenant("Bad Slug!")
    assert await svc.version() == 4
    # a no-op change neither bumps the version nor writes audit
    await svc.enable_tenant("acme")
    assert await svc.version() == 4
    audit = await svc.audit(target="tenant:acme")
    assert [e.action for e in audit] == ["tenant.limits", "tenant.enable", "tenant.disable", "tenant.create"]
    assert [e.registry_version for e in audit] == [4, 3, 2, 1]
    assert audit[-1].actor == "alice" and audit[-1].before is None
    assert audit[0].before["tokens_per_min"] == 1000 and audit[0].after["tokens_per_min"] == 5
    assert [e.action for e in await svc.audit(actor="bob")] == ["tenant.disable"]
    assert len(await svc.audit(limit=2)) == 2
    assert [t.slug for t in await svc.list_tenants()] == ["acme"]


async def test_base_model_and_adapter_registration(svc):
    await svc.register_base_model(TINY)
    with pytest.raises(Conflict):
        await svc.register_base_model(TINY)
    assert [m.name for m in await svc.list_base_models()] == ["tiny"]
    await svc.create_tenant("acme")
    a1 = await _adapter(svc, "support", owner="acme", activate=False)
    assert a1.status == "pending" and a1.version == 1 and a1.rank == 4 and a1.alpha == 8.0
    assert a1.target_modules == ("q_proj", "v_proj") and len(a1.sha256) == 64
    assert a1.uri.startswith("file:///")
    a2 = await _adapter(svc, "support", owner="acme", seed=1)
    assert a2.version == 2 and a2.status == "active" and a2.verification == {"probe": "ok"}
    assert (await svc.get_adapter("support@2")).id == a2.id
    with pytest.raises(NotFound):
        await svc.get_adapter("support@9")
    # explicit duplicate version -> 409, registry unchanged
    before = await _counts(svc)
    d = write_adapter(Path(svc.settings.resolved_adapter_root()) / "dup", TINY)
    with pytest.raises(Conflict) as exc:
        await svc.register_adapter("support", str(d), "tiny", version=2, owner="acme")
    assert exc.value.code == "adapter_version_exists"
    # the same name under another owner is refused
    with pytest.raises(Conflict):
        await svc.register_adapter("support", str(d), "tiny", owner=None)
    assert await _counts(svc) == before
    # disable / re-activate
    assert (await svc.disable_adapter(a2.id, reason="bad evals")).status_reason == "bad evals"
    assert (await svc.activate_adapter(a2.id)).status == "active"
    failed = await svc.fail_adapter(a1.id, reason="probe failed", verification={"probe": "error"})
    assert failed.status == "failed"
    assert {a.status for a in await svc.list_adapters(name="support")} == {"failed", "active"}
    actions = [e.action for e in await svc.audit()]
    assert actions[:4] == ["adapter.fail", "adapter.activate", "adapter.disable", "adapter.activate"]
    # a failed activation may be retried (the gateway's gate runs again before this call)
    assert (await svc.activate_adapter(a1.id, verification={"probe": "ok"})).status == "active"


async def test_bind_rollback_canary_flow(svc):
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme")
    v1 = await _adapter(svc, "support", owner="acme", seed=1)
    v2 = await _adapter(svc, "support", owner="acme", seed=2)
    v3 = await _adapter(svc, "support", owner="acme", seed=3)
    b = await svc.bind("acme", "support", v1.id, on_disabled="base")
    assert b.active.id == v1.id and b.previous is None and b.on_disabled == "base"
    b = await svc.bind("acme", "support", "support@2")
    assert (b.active.label, b.previous.label) == ("support@2", "support@1")
    b = await svc.rollback("acme", "support")
    assert (b.active.id, b.previous.id) == (v1.id, v2.id)
    b = await svc.rollback("acme", "support")  # rolls forward again
    assert b.active.id == v2.id
    b = await svc.canary_start("acme", "support", v3.id, 10)
    assert b.canary.id == v3.id and b.canary_percent == 10
    for bad in (0, -5, 100.5, "ten", float("nan"), True):
        with pytest.raises(Invalid) as exc:
            await svc.canary_set("acme", "support", bad)
        assert exc.value.code == "invalid_percent"
    assert (await svc.canary_set("acme", "support", 50)).canary_percent == 50
    with pytest.raises(Conflict):
        await svc.canary_start("acme", "support", v1.id, 5)
    b = await svc.canary_promote("acme", "support")
    assert (b.active.id, b.previous.id, b.canary) == (v3.id, v2.id, None)
    with pytest.raises(Conflict) as exc:
        await svc.canary_promote("acme", "support")
    assert exc.value.code == "no_canary"
    await svc.canary_start("acme", "support", v1.id, 5)
    b = await svc.canary_abort("acme", "support")
    assert b.canary is None and b.canary_percent == 0
    b = await svc.set_binding_enabled("acme", "support", False, on_disabled="refuse")
    assert (b.enabled, b.on_disabled) == (False, "refuse")
    assert (await svc.set_binding_enabled("acme", "support", True)).enabled is True
    await svc.bind("acme", "spare", v1.id)
    assert await svc.unbind("acme", "spare") == DeletedBinding("acme", "spare")
    with pytest.raises(NotFound):
        await svc.get_binding("acme", "spare")
    with pytest.raises(NotFound):
        await svc.unbind("acme", "spare")
    deleted = (await svc.audit(target="binding:acme/spare"))[0]
    assert deleted.action == "binding.delete" and deleted.after is None
    assert deleted.before["active"]["id"] == v1.id
    with pytest.raises(NotFound):
        await svc.rollback("acme", "nope")
    with pytest.raises(NotFound):
        await svc.bind("ghost", "support", v1.id)
    actions = [e.action for e in await svc.audit(target="binding:acme/support")]
    assert actions == ["binding.enable", "binding.disable", "binding.canary_abort", "binding.canary_start",
                       "binding.canary_promote", "binding.canary_set", "binding.canary_start",
                       "binding.rollback", "binding.rollback", "binding.bind", "binding.create"]
    assert len(await svc.audit(target="binding:acme/*")) == len(actions) + 2  # + spare create/delete


async def test_binding_rules(svc):
    await svc.register_base_model(TINY)
    await svc.register_base_model(OTHER)
    await svc.create_tenant("acme")
    await svc.create_tenant("globex")
    mine = await _adapter(svc, "acme-bot", owner="acme")
    theirs = await _adapter(svc, "globex-bot", owner="globex")
    shared = await _adapter(svc, "shared", owner=None)
    other_base = await _adapter(svc, "wide", owner="acme", info=OTHER)
    pending = await _adapter(svc, "acme-bot", owner="acme", seed=5, activate=False)
    await svc.bind("acme", "bot", mine.id)
    before = await _counts(svc)
    with pytest.raises(Invalid) as exc:
        await svc.bind("acme", "bot", theirs.id)
    assert exc.value.code == "adapter_owner_mismatch"
    with pytest.raises(Invalid) as exc:
        await svc.bind("acme", "stolen", theirs.id)
    assert exc.value.code == "adapter_owner_mismatch"
    with pytest.raises(Invalid) as exc:
        await svc.canary_start("acme", "bot", theirs.id, 50)
    assert exc.value.code == "adapter_owner_mismatch"
    with pytest.raises(Invalid) as exc:
        await svc.bind("acme", "bot", other_base.id)
    assert exc.value.code == "base_model_mismatch"
    with pytest.raises(Invalid) as exc:
        await svc.canary_start("acme", "bot", other_base.id, 5)
    assert exc.value.code == "base_model_mismatch"
    with pytest.raises(Invalid) as exc:
        await svc.bind("acme", "bot", pending.id)
    assert exc.value.code == "adapter_not_active"
    with pytest.raises(Invalid) as exc:
        await svc.canary_start("acme", "bot", pending.id, 5)
    assert exc.value.code == "adapter_not_active"
    assert await _counts(svc) == before
    # shared adapters bind anywhere
    await svc.bind("globex", "shared", shared.id)
    await svc.bind("acme", "shared", shared.id)
    # disabling an adapter aborts canaries on it and disables bindings active on it
    await svc.canary_start("acme", "bot", (await _adapter(svc, "acme-bot", owner="acme", seed=7)).id, 20)
    canary_id = (await svc.get_binding("acme", "bot")).canary.id
    await svc.disable_adapter(canary_id, reason="regression", force=True)
    assert (await svc.get_binding("acme", "bot")).canary is None
    await svc.disable_adapter(shared.id, force=True)
    assert [b.enabled for b in await svc.list_bindings() if b.alias == "shared"] == [False, False]
    with pytest.raises(Invalid):
        await svc.set_binding_enabled("acme", "shared", True)


async def test_disabling_a_version_in_use_is_refused_unless_forced(svc):
    await svc.register_base_model(TINY)
    for slug in ("acme", "globex"):
        await svc.create_tenant(slug)
    shared = await _adapter(svc, "shared", seed=1)
    other = await _adapter(svc, "shared", seed=2)
    await svc.bind("acme", "bot", shared.id, on_disabled="base")
    await svc.bind("globex", "bot", other.id)
    await svc.canary_start("globex", "bot", shared.id, 10)
    before = await _counts(svc)
    with pytest.raises(Conflict) as exc:
        await svc.disable_adapter(shared.id, reason="regression")
    assert exc.value.code == "adapter_in_use" and exc.value.status == 409
    assert "acme/bot (active)" in exc.value.message and "globex/bot (canary)" in exc.value.message
    assert exc.value.body()["bindings"] == [{"tenant": "acme", "alias": "bot", "role": "active"},
                                            {"tenant": "globex", "alias": "bot", "role": "canary"}]
    assert await _counts(svc) == before and (await svc.get_adapter(shared.id)).status == "active"
    # forced: the bindings change with it, in the answer and in the audit log
    out = await svc.disable_adapter(shared.id, reason="regression", force=True)
    assert out.status == "disabled" and [d.tenant for d in out.detached] == ["acme", "globex"]
    acme, globex = await svc.get_binding("acme", "bot"), await svc.get_binding("globex", "bot")
    assert (acme.enabled, acme.on_disabled) == (False, "base") and globex.canary is None
    entries = await svc.audit(limit=3)
    assert {(e.action, e.target) for e in entries} == {
        ("adapter.disable", f"adapter:{shared.id}"), ("binding.disable", "binding:acme/bot"),
        ("binding.canary_abort", "binding:globex/bot")}
    assert all(e.after["cause"] == "adapter shared@1 is disabled" for e in entries
               if e.action.startswith("binding."))
    # once no enabled binding routes to a version, it is disabled without force
    await svc.set_binding_enabled("globex", "bot", False)
    assert not (out := await svc.disable_adapter(other.id)).detached and out.status == "disabled"


async def test_enable_restores_a_disabled_version_but_not_its_bindings(svc):
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme")
    v1 = await _adapter(svc, "support", owner="acme", seed=1)
    await svc.bind("acme", "support", v1.id)
    await svc.disable_adapter(v1.id, reason="regression", force=True)
    await svc.disable_adapter(v1.id, reason="still bad")  # disabled again: enable still knows it was active
    out = await svc.enable_adapter("support@1", actor="bob")
    assert (out.status, out.status_reason) == ("active", None)
    entry = (await svc.audit(limit=1))[0]
    assert (entry.action, entry.actor, entry.before["status"]) == ("adapter.enable", "bob", "disabled")
    assert (await svc.get_binding("acme", "support")).enabled is False  # bindings: one by one
    assert (await svc.set_binding_enabled("acme", "support", True)).enabled is True
    assert (await svc.enable_adapter(v1.id)).status == "active"  # already active: no change
    # never passed activation: enable refuses (activate runs the gate instead)
    pending = await _adapter(svc, "support", owner="acme", seed=2, activate=False)
    await svc.disable_adapter(pending.id)
    with pytest.raises(Conflict) as exc:
        await svc.enable_adapter(pending.id)
    assert exc.value.code == "never_activated"
    failed = await _adapter(svc, "support", owner="acme", seed=3, activate=False)
    await svc.fail_adapter(failed.id, reason="probe failed")
    with pytest.raises(Conflict) as exc:
        await svc.enable_adapter(failed.id)
    assert exc.value.code == "not_disabled"


async def test_plain_binding_disable_refuses_whatever_was_chosen_before(svc):
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme")
    v1 = await _adapter(svc, "support", owner="acme", seed=1)
    await svc.bind("acme", "support", v1.id)
    b = await svc.set_binding_enabled("acme", "support", False, on_disabled="base")
    assert (b.enabled, b.on_disabled) == (False, "base")
    await svc.set_binding_enabled("acme", "support", True)
    b = await svc.set_binding_enabled("acme", "support", False)
    assert (b.enabled, b.on_disabled) == (False, "refuse")
    assert (await svc.audit(limit=1))[0].after["on_disabled"] == "refuse"


async def test_failure_mid_operation_changes_nothing(svc, monkeypatch):
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme")
    v1 = await _adapter(svc, "support", owner="acme", seed=1)
    v2 = await _adapter(svc, "support", owner="acme", seed=2)
    await svc.bind("acme", "support", v1.id)
    before = await _counts(svc)
    binding = await svc.get_binding("acme", "support")

    async def broken_audit(*_a, **_k):
        raise RuntimeError("audit store exploded")

    monkeypatch.setattr(svc.db, "_commit_version", broken_audit)
    for call in (lambda: svc.bind("acme", "support", v2.id), lambda: svc.create_tenant("initech"),
                 lambda: svc.disable_adapter(v1.id, force=True),
                 lambda: svc.set_tenant_limits("acme", max_concurrent=1),
                 lambda: svc.canary_start("acme", "support", v2.id, 30)):
        with pytest.raises(RuntimeError):
            await call()
    assert await _counts(svc) == before
    assert await svc.get_binding("acme", "support") == binding
    assert (await svc.get_adapter(v1.id)).status == "active"
    monkeypatch.undo()
    assert (await svc.bind("acme", "support", v2.id)).active.id == v2.id


async def test_concurrent_binding_races_lose_no_update(svc):
    """Many concurrent tasks on one binding: every operation is applied exactly once, in some
    serial order, so the final state and the audit trail agree."""
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme")
    versions = [await _adapter(svc, "support", owner="acme", seed=i) for i in range(6)]
    await svc.bind("acme", "support", versions[0].id)
    start_version = await svc.version()
    n = 40 if "postgresql" in svc.database_url else 16

    async def worker(i: int) -> str:
        v = versions[1 + i % 5].id
        match i % 4:
            case 0:
                await svc.bind("acme", "support", v)
                return "bind"
            case 1:
                try:
                    await svc.rollback("acme", "support")
                    return "rollback"
                except Conflict:
                    return "refused"
            case 2:
                try:
                    await svc.canary_start("acme", "support", v, 1 + i % 99)
                    return "canary"
                except (Conflict, Invalid):
                    return "refused"
            case _:
                try:
                    await svc.canary_abort("acme", "support")
                    return "abort"
                except Conflict:
                    return "refused"

    results = await asyncio.gather(*(worker(i) for i in range(n)))
    applied = [r for r in results if r != "refused"]
    audit = await svc.audit(target="binding:acme/support", since_version=start_version, limit=1000)
    # every applied operation has exactly one audit row at a distinct registry version
    assert len({e.registry_version for e in audit}) == len(audit)
    binding_versions = sorted(e.registry_version for e in audit)
    assert len(audit) <= len(applied)  # a bind to the current active version is a no-op
    # replaying the audit trail's after-states: each one's before is the previous one's after
    chain = sorted(audit, key=lambda e: e.registry_version)
    for prev, cur in itertools.pairwise(chain):
        assert cur.before == prev.after, "an update was lost or overwritten"
    final = await svc.get_binding("acme", "support")
    assert final.row_version == chain[-1].after["row_version"]
    after = final.audit_json()
    assert after["active"] == chain[-1].after["active"] and after["canary"] == chain[-1].after["canary"]
    assert await svc.version() >= binding_versions[-1]


async def test_every_change_is_audited_at_its_own_version(svc):
    """Every registry version from 1 to the current one has its audit row(s), and every kind
    of operation appears in the log with before/after states."""
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme")
    await svc.set_tenant_limits("acme", requests_per_min=5)
    await svc.disable_tenant("acme")
    await svc.enable_tenant("acme")
    v1 = await _adapter(svc, "support", owner="acme", seed=1)
    v2 = await _adapter(svc, "support", owner="acme", seed=2)
    v3 = await _adapter(svc, "support", owner="acme", seed=3, activate=False)
    await svc.fail_adapter(v3.id, reason="probe failed")
    await svc.bind("acme", "support", v1.id)
    await svc.bind("acme", "support", v2.id)
    await svc.rollback("acme", "support")
    await svc.canary_start("acme", "support", v2.id, 5)
    await svc.canary_set("acme", "support", 50)
    await svc.canary_promote("acme", "support")
    await svc.canary_start("acme", "support", v1.id, 5)
    await svc.canary_abort("acme", "support")
    await svc.set_binding_enabled("acme", "support", False)
    await svc.set_binding_enabled("acme", "support", True)
    await svc.disable_adapter(v1.id)
    entries = await svc.audit(limit=1000)
    assert {e.registry_version for e in entries} == set(range(1, await svc.version() + 1))
    assert {e.action for e in entries} == {
        "base_model.register", "tenant.create", "tenant.limits", "tenant.disable", "tenant.enable",
        "adapter.register", "adapter.activate", "adapter.fail", "adapter.disable", "binding.create",
        "binding.bind", "binding.rollback", "binding.canary_start", "binding.canary_set",
        "binding.canary_promote", "binding.canary_abort", "binding.disable", "binding.enable"}
    for e in entries:
        assert e.after is not None and e.actor == "admin" and e.at
        assert (e.before is None) == e.action.endswith(("create", "register"))
    reg = next(e for e in entries if e.action == "adapter.register" and e.after["id"] == v1.id)
    assert reg.target == f"adapter:{v1.id}" and reg.after["sha256"] == v1.sha256

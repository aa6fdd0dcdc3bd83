"""The registry's public surface for the modules built on it (canary policies, the supply chain,
the console, the limits report): ``RegistryDatabase``'s read and write transactions, the row
lookups, the validators, and the one mapping of database errors onto the registry's."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from sqlalchemy.orm.exc import StaleDataError

from registry import validators
from registry.errors import (
    Conflict,
    Invalid,
    NotFound,
    PreconditionFailed,
    Unavailable,
    refused_or_unavailable_on_database_failure,
    unavailable_on_database_failure,
)
from registry.lookups import adapter_row, binding_record, binding_row, tenant_row, version_labels
from registry.models import AuditEntry, Tenant, utcnow
from registry.service import RegistryService
from registry.service_core import COMMITTED
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter


@pytest.fixture
async def svc(db_url, tmp_path):
    await fresh_registry(db_url)
    service = RegistryService(make_settings(tmp_path, db_url))
    yield service
    await service.close()


async def _audit_rows(svc: RegistryService) -> list[tuple[int, str, str]]:
    async with svc.db.read() as s:
        rows = await s.execute(select(AuditEntry.registry_version, AuditEntry.actor, AuditEntry.action)
                               .order_by(AuditEntry.id))
        return [tuple(r) for r in rows]


async def test_a_write_that_records_changes_commits_one_version_with_its_audit_rows(svc):
    async with svc.db.write("ops") as tx:
        tx.session.add(Tenant(slug="acme", status="active", requests_per_min=1, tokens_per_min=1, max_concurrent=1,
                              priority="normal", cache_scope="", created_at=utcnow(), updated_at=utcnow()))
        await tx.session.flush()
        tx.audit("tenant.create", "tenant:acme", None, {"slug": "acme"})
        tx.audit("tenant.note", "tenant:acme", None, None)
    assert await svc.version() == 1 and COMMITTED.get() == 1
    assert await _audit_rows(svc) == [(1, "ops", "tenant.create"), (1, "ops", "tenant.note")]
    assert (await svc.get_tenant("acme")).slug == "acme"


async def test_a_write_that_records_no_change_is_rolled_back_and_bumps_nothing(svc):
    await svc.create_tenant("acme")
    async with svc.db.write("ops") as tx:
        row = await tenant_row(tx.session, "acme", lock=True)
        row.max_concurrent = 99  # flushed but never audited: not a registry change
        await tx.session.flush()
    assert await svc.version() == 1
    assert (await svc.get_tenant("acme")).max_concurrent == 16
    assert [a for _, _, a in await _audit_rows(svc)] == ["tenant.create"]


async def test_a_failing_write_block_changes_nothing(svc):
    with pytest.raises(RuntimeError):
        async with svc.db.write("ops") as tx:
            tx.session.add(Tenant(slug="acme", status="active", requests_per_min=1, tokens_per_min=1,
                                  max_concurrent=1, priority="normal", cache_scope="", created_at=utcnow(),
                                  updated_at=utcnow()))
            await tx.session.flush()
            tx.audit("tenant.create", "tenant:acme", None, None)
            raise RuntimeError("a bug in the block")
    assert await svc.version() == 0 and await svc.list_tenants() == []


async def test_a_constraint_is_a_conflict_and_nothing_changes(svc):
    await svc.create_tenant("acme")
    with pytest.raises(Conflict) as exc:
        async with svc.db.write("ops") as tx:
            tx.session.add(Tenant(slug="acme", status="active", requests_per_min=1, tokens_per_min=1,
                                  max_concurrent=1, priority="normal", cache_scope="", created_at=utcnow(),
                                  updated_at=utcnow()))
            await tx.session.flush()
            tx.audit("tenant.create", "tenant:acme", None, None)
    assert exc.value.status == 409 and "nothing was changed" in exc.value.message
    assert "acme" not in exc.value.message  # the row's values go to the log only
    assert await svc.version() == 1


async def test_lookups_tell_a_missing_tenant_from_a_missing_binding(svc):
    await svc.create_tenant("acme")
    await svc.register_base_model(TINY)
    d = write_adapter(Path(svc.settings.resolved_adapter_root()) / "bot", TINY, seed=1)
    a = await svc.activate_adapter((await svc.register_adapter("bot", str(d), TINY.name, owner="acme")).id)
    await svc.bind("acme", "support", a.id)
    async with svc.db.read() as s:
        assert (await tenant_row(s, "acme")).slug == "acme"
        assert (await adapter_row(s, "bot@1")).id == a.id == (await adapter_row(s, a.id)).id
        b = await binding_row(s, "acme", "support")
        assert await version_labels(s, [b.active_id, None, "no-such-id"]) == {a.id: "bot@1"}
        assert await binding_record(s, b) == await svc.get_binding("acme", "support")
        with pytest.raises(NotFound) as exc:
            await binding_row(s, "initech", "support")
        assert exc.value.code == "tenant_not_found"
        with pytest.raises(NotFound) as exc:
            await binding_row(s, "acme", "sales")
        assert exc.value.code == "binding_not_found"
        with pytest.raises(Invalid):
            await adapter_row(s, "bot")
        with pytest.raises(NotFound) as exc:
            await adapter_row(s, "bot@2")
        assert exc.value.code == "adapter_not_found"


async def test_an_unreachable_database_is_a_503_for_reads_and_writes(tmp_path):
    url = "postgresql+asyncpg://nobody@127.0.0.1:1/none"
    svc = RegistryService(make_settings(tmp_path, url))
    try:
        with pytest.raises(Unavailable) as exc:
            async with svc.db.read() as s:
                await s.execute(text("SELECT 1"))
        assert exc.value.status == 503 and exc.value.message.endswith("nothing was read")
        assert "127.0.0.1" not in exc.value.message
        with pytest.raises(Unavailable) as exc:
            async with svc.db.write("ops") as tx:
                tx.audit("tenant.note", "tenant:acme", None, None)
        assert exc.value.message.endswith("nothing was changed")
    finally:
        await svc.close()


def _dbapi(kind: type[Exception]) -> Exception:
    return kind("INSERT ...", {}, Exception("row (acme) violates a constraint"))


@pytest.mark.parametrize(("exc", "expected", "code"), [
    (StaleDataError("row changed"), Conflict, "concurrent_update"),
    (_dbapi(IntegrityError), Conflict, "conflict"),
    (_dbapi(DataError), Invalid, "invalid_value"),
    (_dbapi(OperationalError), Unavailable, "registry_unavailable"),
])
def test_a_write_maps_the_database_refusals_and_failures(exc, expected, code):
    with pytest.raises(expected) as got:
        with refused_or_unavailable_on_database_failure("nothing was changed"):
            raise exc
    assert got.value.code == code and "acme" not in got.value.message


def test_a_read_maps_failures_only_and_the_registrys_errors_and_bugs_pass():
    with pytest.raises(Unavailable) as exc:  # a read is refused nothing: the database failed it
        with unavailable_on_database_failure("nothing was read"):
            raise _dbapi(IntegrityError)
    assert exc.value.code == "registry_error"
    for mapper in (unavailable_on_database_failure(), refused_or_unavailable_on_database_failure()):
        with pytest.raises(NotFound), mapper:
            raise NotFound("no such tenant")
        with pytest.raises(KeyError), mapper:
            raise KeyError("a bug")


def test_validators_return_the_stored_value_or_refuse_naming_the_parameter():
    assert validators.slug("acme-1") == "acme-1"
    assert validators.name("bot.v2:x+y", "alias") == "bot.v2:x+y"
    assert validators.percent(5) == 5.0 and isinstance(validators.percent(5), float)
    assert validators.limit(0, "max_concurrent") == 0
    assert validators.cache_scope("") == "" and validators.cache_scope("corp.eu") == "corp.eu"
    assert validators.priority("high") == "high" and validators.on_disabled("base") == "base"
    validators.match(3, None, "tenant 'acme'")
    validators.match(3, 3, "tenant 'acme'")
    for call, param in ((lambda: validators.slug("Acme"), "tenant"), (lambda: validators.slug("a b", "owner"), "owner"),
                        (lambda: validators.name("-x", "alias"), "alias"), (lambda: validators.percent(0), "percent"),
                        (lambda: validators.percent(True), "percent"),
                        (lambda: validators.limit(-1, "tokens_per_min"), "tokens_per_min"),
                        (lambda: validators.cache_scope("corp\n"), "cache_scope"),
                        (lambda: validators.priority("urgent"), "priority"),
                        (lambda: validators.on_disabled("drop"), "on_disabled"),
                        (lambda: validators.match(3, True, "x"), "row_version")):
        with pytest.raises(Invalid) as exc:
            call()
        assert exc.value.param == param
    with pytest.raises(PreconditionFailed) as stale:
        validators.match(4, 3, "tenant 'acme'")
    assert stale.value.row_version == 4 and stale.value.status == 412

"""A tenant's prefix-cache scope on PostgreSQL and SQLite: set and cleared through the service
and the admin API (audited with before and after, refused by name when malformed), carried by
the registry snapshot to the gateways (full load, delta, and the snapshot file) as the scope
their requests' KV blocks are cached under."""

from __future__ import annotations

import httpx
import pytest
from jsonschema import Draft202012Validator
from starlette.applications import Starlette
from starlette.routing import Mount

from gateway.snapshot_file import snapshot_from_dict
from loraplex.prefix import shared_scope, tenant_scope
from loraplex.tokens import mint_admin
from registry.admin_api import admin_app
from registry.cache import SnapshotCache
from registry.errors import Invalid, NotFound, PreconditionFailed
from registry.service import RegistryService
from tests.registry_support import fresh_registry, make_settings

BAD = ["Acme", "-acme", ".acme", "acme co", "acme/eu", "a" * 64, "ümlaut", "acme\n", 7, None, ["acme"]]


@pytest.fixture
async def svc(db_url, tmp_path):
    await fresh_registry(db_url)
    service = RegistryService(make_settings(tmp_path, db_url))
    yield service
    await service.close()


@pytest.fixture
async def api(svc):
    app = Starlette(routes=[Mount("/admin", app=admin_app(svc, svc.settings))])
    headers = {"authorization": f"Bearer {mint_admin(svc.settings, subject='ops-alice')}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as client:
        yield client


async def test_set_and_clear_through_the_service_audited(svc):
    t = await svc.create_tenant("acme-eu")
    assert t.cache_scope == ""
    t = await svc.set_tenant_cache_scope("acme-eu", "acme", actor="alice")
    assert t.cache_scope == "acme" and t.row_version == 2
    assert await svc.version() == 2
    await svc.set_tenant_cache_scope("acme-eu", "acme")  # no change: no version, no audit row
    assert await svc.version() == 2
    t = await svc.set_tenant_cache_scope("acme-eu", "", actor="bob")
    assert t.cache_scope == ""
    audit = await svc.audit(target="tenant:acme-eu")
    assert [(e.action, e.actor) for e in audit] == [
        ("tenant.cache_scope", "bob"), ("tenant.cache_scope", "alice"), ("tenant.create", "admin")]
    assert (audit[1].before["cache_scope"], audit[1].after["cache_scope"]) == ("", "acme")
    assert (audit[0].before["cache_scope"], audit[0].after["cache_scope"]) == ("acme", "")
    assert audit[1].before["requests_per_min"] == audit[1].after["requests_per_min"] == 600
    # the longest name the pattern allows, dots and underscores included
    longest = "0" + "a._-" * 15 + "zz"
    assert len(longest) == 63
    assert (await svc.set_tenant_cache_scope("acme-eu", longest)).cache_scope == longest
    created = await svc.create_tenant("acme-us", cache_scope="acme")
    assert created.cache_scope == "acme"
    assert [(t.slug, t.cache_scope) for t in await svc.list_tenants()] == [
        ("acme-eu", longest), ("acme-us", "acme")]


@pytest.mark.parametrize("value", BAD)
async def test_a_malformed_scope_is_refused_naming_the_field(svc, value):
    await svc.create_tenant("acme")
    version = await svc.version()
    with pytest.raises(Invalid) as exc:
        await svc.set_tenant_cache_scope("acme", value)
    assert exc.value.param == "cache_scope" and exc.value.code == "invalid_cache_scope"
    with pytest.raises(Invalid) as exc:
        await svc.create_tenant("other", cache_scope=value)
    assert exc.value.param == "cache_scope"
    assert await svc.version() == version and (await svc.get_tenant("acme")).cache_scope == ""


async def test_conditional_and_unknown_tenant(svc):
    await svc.create_tenant("acme")
    with pytest.raises(PreconditionFailed):
        await svc.set_tenant_cache_scope("acme", "co", if_match=7)
    assert (await svc.set_tenant_cache_scope("acme", "co", if_match=1)).cache_scope == "co"
    with pytest.raises(NotFound):
        await svc.set_tenant_cache_scope("nobody", "co")


async def test_admin_api_sets_clears_refuses_and_documents_it(api):
    assert (await api.post("/tenants", json={"slug": "acme", "cache_scope": "Bad"})).status_code == 422
    r = await api.post("/tenants", json={"slug": "acme"})
    assert r.status_code == 201 and r.json()["cache_scope"] == ""
    r = await api.put("/tenants/acme/cache-scope", json={"cache_scope": "Acme Co"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("cache_scope", "invalid_cache_scope") and "cache_scope" in err["message"]
    r = await api.put("/tenants/acme/cache-scope", json={})
    assert r.status_code == 422 and r.json()["error"]["param"] == "cache_scope"
    r = await api.put("/tenants/acme/cache-scope", json={"cache_scope": 5})
    assert r.status_code == 422 and r.json()["error"]["param"] == "cache_scope"
    r = await api.put("/tenants/acme/cache-scope", json={"cache_scope": "acme-group"}, headers={"if-match": '"9"'})
    assert r.status_code == 412
    r = await api.put("/tenants/acme/cache-scope", json={"cache_scope": "acme-group"}, headers={"if-match": '"1"'})
    assert r.status_code == 200 and r.json()["cache_scope"] == "acme-group" and r.headers["etag"] == '"2"'
    assert int(r.headers["x-registry-version"]) == 2
    assert (await api.get("/tenants/acme")).json()["cache_scope"] == "acme-group"
    assert [t["cache_scope"] for t in (await api.get("/tenants")).json()["data"]] == ["acme-group"]
    r = await api.put("/tenants/acme/cache-scope", json={"cache_scope": ""})
    assert r.status_code == 200 and r.json()["cache_scope"] == ""
    entries = (await api.get("/audit", params={"target": "tenant:acme", "action": "tenant.cache_scope"})).json()
    assert [(e["actor"], e["before"]["cache_scope"], e["after"]["cache_scope"]) for e in entries["data"]] == [
        ("ops-alice", "acme-group", ""), ("ops-alice", "", "acme-group")]

    doc = (await api.get("/openapi.json")).json()
    op = doc["paths"]["/tenants/{slug}/cache-scope"]["put"]
    assert op["operationId"] == "setTenantCacheScope"
    body = op["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["cache_scope"]
    tenant = doc["components"]["schemas"]["Tenant"]
    assert "cache_scope" in tenant["properties"]
    check = Draft202012Validator(tenant)
    for good in ("", "acme", "acme.eu_2-x"):
        check.validate({"cache_scope": good})
    for bad in BAD:  # the document's pattern is the service's rule (but "$" before a newline: Python's re)
        assert "\n" in str(bad) or not check.is_valid({"cache_scope": bad}), bad
    check.validate((await api.get("/tenants/acme")).json())


async def test_the_snapshot_carries_the_scope_by_delta_and_full_load(svc):
    await svc.create_tenant("acme-eu")
    await svc.create_tenant("acme-us")
    await svc.create_tenant("globex")
    cache = SnapshotCache(svc.settings)
    await cache.start()
    try:
        snap = cache.current
        assert [snap.tenants[s].prefix_scope for s in ("acme-eu", "acme-us", "globex")] == [
            tenant_scope("acme-eu"), tenant_scope("acme-us"), tenant_scope("globex")]
        deltas = cache.loads["delta"]
        await svc.set_tenant_cache_scope("acme-eu", "acme")
        await svc.set_tenant_cache_scope("acme-us", "acme")
        assert await cache.wait_for(await svc.version(), timeout=5)
        assert cache.loads["delta"] > deltas  # reached the reader as a change, like a limits change
        snap = cache.current
        assert snap.tenants["acme-eu"].cache_scope == "acme"
        assert snap.tenants["acme-eu"].prefix_scope == snap.tenants["acme-us"].prefix_scope == shared_scope("acme")
        assert snap.tenants["globex"].prefix_scope == tenant_scope("globex")
        await svc.set_tenant_cache_scope("acme-us", "")
        assert await cache.wait_for(await svc.version(), timeout=5)
        assert cache.current.tenants["acme-us"].prefix_scope == tenant_scope("acme-us")
    finally:
        await cache.stop()
    fresh = SnapshotCache(svc.settings)
    await fresh.start()
    try:
        assert fresh.loads["full"] == 1
        tenants = fresh.current.tenants
        assert [(s, tenants[s].cache_scope) for s in ("acme-eu", "acme-us", "globex")] == [
            ("acme-eu", "acme"), ("acme-us", ""), ("globex", "")]
    finally:
        await fresh.stop()


def test_the_snapshot_file_carries_the_scope():
    snap = snapshot_from_dict({"tenants": {"a": {"cache_scope": "co"}, "b": {"cache_scope": "co"}, "c": {},
                                           "d": {"cache_scope": None}}})
    assert snap.tenants["a"].prefix_scope == snap.tenants["b"].prefix_scope == shared_scope("co")
    assert snap.tenants["c"].prefix_scope == tenant_scope("c") and snap.tenants["d"].cache_scope == ""


async def test_tenants_from_before_the_column_keep_their_own_scope(db_url):
    """0006 on a registry with tenants: every existing one is in its own scope; down and up again."""
    from sqlalchemy import text

    from registry.db import make_engine
    from registry.migrate import downgrade_async, upgrade_async

    await fresh_registry(db_url)
    engine = make_engine(db_url, statement_timeout_s=None)
    try:
        await downgrade_async(engine, "0005_responses")
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO tenants (slug, status, requests_per_min, tokens_per_min, "
                                    "max_concurrent, priority, created_at, updated_at) VALUES ('old', 'active', "
                                    "1, 1, 1, 'normal', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        await upgrade_async(engine)
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT cache_scope FROM tenants"))).scalar_one() == ""
        await downgrade_async(engine, "0005_responses")
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM tenants"))).scalar_one() == 1
        await upgrade_async(engine)
    finally:
        await engine.dispose()

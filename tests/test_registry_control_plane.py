"""The control plane at scale, on real PostgreSQL: deltas equal a full reload after random change
sequences, a gap in the audit log means a full load, a stalled refresh keeps the held snapshot,
a reader is never ready without a complete snapshot, conditional writes lose no update, and an
exhausted connection pool answers 503 with Retry-After."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

import asyncpg
import httpx
import pytest
from sqlalchemy import text

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.tokens import mint, mint_admin
from registry.admin_api import admin_app
from registry.cache import NotLoaded, SnapshotCache
from registry.db import make_engine
from registry.errors import PreconditionFailed
from registry.migrate import upgrade_async
from registry.service import RegistryService
from registry.snapshot import TenantMap, TenantView
from registry.snapshot_load import load_full
from tests.conftest import PG_ADMIN_URL
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter
from tests.stub_worker import mock_worker_transport
from tests.test_admin_api import mounted
from tests.worker_double import worker_client

TENANTS = ("t0", "t1", "t2", "t3", "t4")


async def _seed(svc: RegistryService) -> list[str]:
    """Tenants t0..t4, four shared active adapter versions; returns their ids."""
    await svc.register_base_model(TINY)
    for slug in TENANTS[:3]:
        await svc.create_tenant(slug)
    root = Path(svc.settings.resolved_adapter_root())
    ids = []
    for seed in range(4):
        write_adapter(root / f"a{seed}", TINY, seed=seed)
        a = await svc.register_adapter("shared", f"a{seed}", "tiny")
        ids.append((await svc.activate_adapter(a.id)).id)
    return ids


async def _full(svc: RegistryService):
    async with svc.engine.connect() as conn, conn.begin():
        return await load_full(conn)


def test_tenant_map_replace_shares_untouched_shards():
    def tenant(slug: str, rpm: int = 1) -> TenantView:
        return TenantView(slug=slug, status="active", requests_per_min=rpm, tokens_per_min=1, max_concurrent=1,
                          priority="normal")

    old = TenantMap({f"t{i}": tenant(f"t{i}") for i in range(2000)})
    new = old.replace({"t5": None, "t6": tenant("t6", 9), "fresh": tenant("fresh")})
    assert len(old) == 2000 and "t5" in old and old["t6"].requests_per_min == 1  # old is unchanged
    assert len(new) == 2000 and "t5" not in new and new["t6"].requests_per_min == 9 and new.get("fresh")
    assert new.get("nobody") is None and "nobody" not in new
    assert new == {k: v for k, v in new.items()} and new != old and TenantMap() == {}
    shared = sum(a is b for a, b in zip(old._shards, new._shards, strict=True))
    assert shared >= TenantMap.SHARDS - 3  # only the shards of the three changed slugs were copied
    assert sorted(new) == sorted({*old} - {"t5"} | {"fresh"})


async def _random_op(svc: RegistryService, rng: random.Random, ids: list[str]) -> bool:
    """One random registry operation; False when the registry refused it (part of the mix)."""
    tenant, alias, adapter = rng.choice(TENANTS), rng.choice(("a", "b")), rng.choice(ids)
    ops = [  # (weight, operation): binds, canaries and adapter changes are where deltas go wrong
        (1, lambda: svc.create_tenant(tenant)),
        (1, lambda: svc.set_tenant_limits(tenant, requests_per_min=rng.randrange(1000),
                                          priority=rng.choice(("high", "normal", "low")))),
        (1, lambda: svc.disable_tenant(tenant)),
        (1, lambda: svc.enable_tenant(tenant)),
        (4, lambda: svc.bind(tenant, alias, adapter, on_disabled=rng.choice(("base", "refuse")))),
        (1, lambda: svc.rollback(tenant, alias)),
        (2, lambda: svc.canary_start(tenant, alias, adapter, rng.choice((5, 25, 50)))),
        (1, lambda: svc.canary_set(tenant, alias, rng.choice((10, 60)))),
        (1, lambda: svc.canary_promote(tenant, alias)),
        (1, lambda: svc.canary_abort(tenant, alias)),
        (1, lambda: svc.set_binding_enabled(tenant, alias, rng.random() < 0.5)),
        (1, lambda: svc.unbind(tenant, alias)),
        (2, lambda: svc.disable_adapter(adapter, force=True)),  # touches bindings of every tenant on it
        (2, lambda: svc.disable_adapter(adapter)),  # only the version: bindings still show it (disabled)
        (3, lambda: svc.enable_adapter(adapter)),
    ]
    op = rng.choices([o for _, o in ops], weights=[w for w, _ in ops])[0]
    try:
        await op()
        return True
    except Exception as exc:
        assert getattr(exc, "status", 500) < 500, exc
        return False


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_deltas_equal_a_full_reload_after_random_changes(pg_url, tmp_path, seed):
    """60 random operations; after every few, the delta-maintained snapshot equals a fresh full
    load, and every refresh after the first was a delta."""
    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url, registry_refresh_s=300.0)
    svc = RegistryService(settings)
    cache = SnapshotCache(settings)
    try:
        ids = await _seed(svc)
        for slug in TENANTS[:3]:
            await svc.bind(slug, "a", ids[0])
        await cache.start()
        rng = random.Random(seed)
        applied = 0
        for step in range(60):
            applied += await _random_op(svc, rng, ids)
            if step % 3 == 2:
                snap = await cache.refresh()
                full = await _full(svc)
                assert snap.version == full.version
                assert snap == full, f"seed {seed}, step {step}: the delta snapshot differs from a full load"
        assert cache.loads["full"] == 1 and cache.loads["delta"] >= 20
        assert applied >= 25, applied  # the mix changed the registry, not only got refused
    finally:
        await cache.stop()
        await svc.close()


async def test_a_gap_in_the_audit_log_means_a_full_load(pg_url, tmp_path):
    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url, registry_refresh_s=300.0)
    svc = RegistryService(settings)
    cache = SnapshotCache(settings)
    try:
        ids = await _seed(svc)
        await cache.start()
        cache._want = lambda version: None  # refresh only when told: the gap must be there first
        held = cache.current.version
        await svc.bind("t0", "a", ids[0])
        await svc.set_tenant_limits("t1", tokens_per_min=7)
        async with svc.engine.begin() as conn:  # the entries of version held+1 are gone (pruned)
            await conn.execute(text("DELETE FROM audit_log WHERE registry_version = :v"), {"v": held + 1})
        fulls = cache.loads["full"]
        snap = await cache.refresh()
        assert cache.loads["full"] == fulls + 1
        assert snap == await _full(svc)
        assert snap.tenants["t0"].bindings["a"].active.id == ids[0] and snap.tenants["t1"].tokens_per_min == 7
        await svc.set_tenant_limits("t1", tokens_per_min=8)  # and deltas resume after it
        await cache.refresh()
        assert cache.loads["full"] == fulls + 1 and cache.current.tenants["t1"].tokens_per_min == 8
    finally:
        await cache.stop()
        await svc.close()


async def test_a_stalled_refresh_keeps_the_held_snapshot(pg_url, tmp_path):
    """The database stops answering (a lock): the refresh fails after registry_stall_s, the held
    snapshot stays and keeps serving, the failure is counted, readiness degrades past the
    staleness limit, and the next refresh after the stall recovers."""
    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url, registry_refresh_s=300.0, registry_stall_s=0.5,
                             registry_max_staleness_s=0.3)
    svc = RegistryService(settings)
    cache = SnapshotCache(settings)
    blocker = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await _seed(svc)
        await cache.start()
        held = cache.current
        assert cache.readiness_problem() is None
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("LOCK TABLE registry_state IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(TimeoutError):
            await cache.refresh()
        await asyncio.sleep(0.35)
        assert cache.current is held and cache.failures >= 1 and "LoadStalled" in (cache.last_error or "")
        assert "old" in (cache.readiness_problem() or "")
        await tx.rollback()
        await svc.set_tenant_limits("t0", tokens_per_min=5)
        snap = await cache.refresh()
        assert snap.tenants["t0"].tokens_per_min == 5 and cache.healthy and cache.readiness_problem() is None
    finally:
        await blocker.close()
        await cache.stop()
        await svc.close()


async def test_never_ready_without_a_complete_snapshot(tmp_path):
    """The registry database does not exist yet: the gateway answers 503 on requests, /v1/models
    and /readyz (never an empty registry); once it is there, the reader loads and is ready."""
    name = f"loraplex_t_{uuid.uuid4().hex[:12]}"
    url = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1) + "/" + name
    settings = make_settings(tmp_path, url, worker_urls=("http://worker",), registry_refresh_s=300.0)
    app = create_app(settings, limiter=LocalLimiter(), residency=MemoryResidency(),
                     http_client=worker_client(mock_worker_transport([])), mount_admin=False)
    user = {"authorization": f"Bearer {mint(settings, 'u', tenant='t0')}"}
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    admin = await asyncpg.connect(PG_ADMIN_URL)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            cache = app.gateway.snapshots
            assert not cache.ready
            with pytest.raises(NotLoaded):
                _ = cache.current
            r = await c.get("/readyz")
            assert r.status_code == 503 and "snapshot is not loaded" in r.json()["problems"][0]
            assert name not in r.text and "5432" not in r.text  # nothing of where the database is
            for r in (await c.get("/v1/models", headers=user),
                      await c.post("/v1/chat/completions", json=body, headers=user)):
                assert r.status_code == 503 and r.json()["error"]["code"] == "registry_unavailable", r.text
            assert b"loraplex_registry_snapshot_ready 0.0" in app.gateway.metrics.render()
            await admin.execute(f'CREATE DATABASE "{name}"')
            await upgrade_async(url)
            svc = RegistryService(settings)
            try:
                await svc.register_base_model(TINY)
                await svc.create_tenant("t0")
            finally:
                await svc.close()
            for _ in range(600):  # the refresher retries with backoff (at most 5 s apart)
                if cache.ready and "t0" in cache.current.tenants:
                    break
                await asyncio.sleep(0.05)
            assert cache.ready and "t0" in cache.current.tenants
            r = await c.get("/readyz")
            assert r.status_code == 200 and r.json()["registry_version"] == cache.current.version
            assert (await c.get("/v1/models", headers=user)).status_code == 200
            assert cache.failures >= 1
            text_ = app.gateway.metrics.render().decode()
            assert "loraplex_registry_snapshot_ready 1.0" in text_
            assert f"loraplex_registry_snapshot_version {float(cache.current.version)}" in text_
            assert "loraplex_registry_refresh_failures_total" in text_
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_concurrent_conditional_writers_lose_no_increment(db_url, tmp_path):
    """20 clients read-modify-write one counter (tenant limit, binding canary percent) with a
    precondition, retrying on 412: every increment lands exactly once."""
    await fresh_registry(db_url)
    svc = RegistryService(make_settings(tmp_path, db_url))
    try:
        ids = await _seed(svc)
        await svc.bind("t0", "a", ids[0])
        await svc.canary_start("t0", "a", ids[1], 1)
        start = (await svc.get_tenant("t0")).requests_per_min
        conflicts = 0

        async def client(rounds: int) -> None:
            nonlocal conflicts
            for _ in range(rounds):
                while True:
                    t = await svc.get_tenant("t0")
                    try:
                        await svc.set_tenant_limits("t0", requests_per_min=t.requests_per_min + 1,
                                                    if_match=t.row_version)
                        break
                    except PreconditionFailed as exc:
                        assert exc.row_version is not None and exc.row_version > t.row_version
                        conflicts += 1

        async def canary_client() -> None:
            nonlocal conflicts
            while True:
                b = await svc.get_binding("t0", "a")
                try:
                    await svc.canary_set("t0", "a", b.canary_percent + 1, if_match=b.row_version)
                    return
                except PreconditionFailed:
                    conflicts += 1

        await asyncio.gather(*(client(3) for _ in range(20)), *(canary_client() for _ in range(20)))
        assert (await svc.get_tenant("t0")).requests_per_min == start + 60
        assert (await svc.get_binding("t0", "a")).canary_percent == 21
        assert conflicts > 0  # the clients did collide: the preconditions did the work
    finally:
        await svc.close()


async def test_concurrent_registrations_of_one_name_each_get_the_next_version(db_url, tmp_path):
    """Writers no longer queue on one registry-wide lock: registrations of one adapter name still
    take turns, so each gets the next version number instead of a conflict."""
    await fresh_registry(db_url)
    svc = RegistryService(make_settings(tmp_path, db_url))
    try:
        await svc.register_base_model(TINY)
        root = Path(svc.settings.resolved_adapter_root())
        for seed in range(8):
            write_adapter(root / f"r{seed}", TINY, seed=seed)
        done = await asyncio.gather(*(svc.register_adapter("busy", f"r{seed}", "tiny") for seed in range(8)))
        assert sorted(a.version for a in done) == list(range(1, 9))
    finally:
        await svc.close()


async def test_admin_api_if_match_etag_and_412(db_url, tmp_path):
    await fresh_registry(db_url)
    settings = make_settings(tmp_path, db_url)
    svc = RegistryService(settings)
    ids = await _seed(svc)
    await svc.bind("t0", "a", ids[0])
    app = mounted(admin_app(svc, settings))
    headers = {"authorization": f"Bearer {mint_admin(settings)}"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                     headers=headers) as c:
            r = await c.get("/tenants/t0/bindings/a")
            etag, rv = r.headers["etag"], r.json()["row_version"]
            assert etag == f'"{rv}"'
            r = await c.post("/tenants/t0/bindings/a/disable", headers={"if-match": etag}, json={})
            assert r.status_code == 200 and r.headers["etag"] == f'"{rv + 1}"'
            for call in (lambda: c.post("/tenants/t0/bindings/a/enable", headers={"if-match": etag}, json={}),
                         lambda: c.post("/tenants/t0/bindings/a/enable", json={"row_version": rv}),
                         lambda: c.post("/tenants/t0/bindings/a/rollback", headers={"if-match": etag}),
                         lambda: c.delete("/tenants/t0/bindings/a", headers={"if-match": etag}),
                         lambda: c.put("/tenants/t0/bindings/a", json={"adapter": ids[1], "row_version": rv})):
                r = await call()
                assert r.status_code == 412, r.text
                assert r.json()["error"]["code"] == "precondition_failed" and r.json()["row_version"] == rv + 1
                assert r.headers["etag"] == f'"{rv + 1}"'
            assert (await svc.get_binding("t0", "a")).enabled is False  # nothing changed
            # If-Match compares strongly (RFC 9110): a weak tag of the current version matches nothing.
            r = await c.post("/tenants/t0/bindings/a/enable", headers={"if-match": f'W/"{rv + 1}"'}, json={})
            assert r.status_code == 412 and r.json()["error"]["code"] == "precondition_failed", r.text
            assert "strongly" in r.json()["error"]["message"]
            assert (await svc.get_binding("t0", "a")).enabled is False
            t = (await c.get("/tenants/t1")).json()
            r = await c.patch("/tenants/t1/limits", json={"max_concurrent": 3, "row_version": t["row_version"]})
            assert r.status_code == 200 and r.json()["row_version"] == t["row_version"] + 1
            r = await c.post("/tenants/t1/disable", headers={"if-match": f'"{t["row_version"]}"'})
            assert r.status_code == 412
            a = (await c.get(f"/adapters/{ids[3]}")).json()
            r = await c.post(f"/adapters/{ids[3]}/disable", json={"row_version": a["row_version"] + 5})
            assert r.status_code == 412
            r = await c.post(f"/adapters/{ids[3]}/disable", headers={"if-match": "*"}, json={})
            assert r.status_code == 200 and r.json()["status"] == "disabled"
            r = await c.put("/tenants/t2/bindings/new", json={"adapter": ids[0], "row_version": 1})
            assert r.status_code == 412  # a precondition on a binding that does not exist
            for bad in ("abc", '"1", "2"'):
                r = await c.post("/tenants/t0/bindings/a/enable", headers={"if-match": bad}, json={})
                assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_if_match"
            r = await c.post("/tenants/t0/bindings/a/enable", headers={"if-match": f'"{rv + 1}"'},
                             json={"row_version": rv})
            assert r.status_code == 422
    finally:
        await svc.close()


async def test_pool_exhaustion_is_503_with_retry_after(pg_url, tmp_path):
    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url)
    engine = make_engine(pg_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    svc = RegistryService(settings, engine)
    app = mounted(admin_app(svc, settings))
    headers = {"authorization": f"Bearer {mint_admin(settings)}"}
    try:
        await svc.create_tenant("acme")
        async with engine.connect() as held, httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://t/admin", headers=headers) as c:
            await held.execute(text("SELECT 1"))
            for r in (await c.get("/tenants/acme"),
                      await c.patch("/tenants/acme/limits", json={"max_concurrent": 2})):
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "registry_busy" and r.headers["retry-after"] == "1"
        r = await svc.set_tenant_limits("acme", max_concurrent=2)
        assert r.max_concurrent == 2
    finally:
        await svc.close()
        await engine.dispose()


async def test_admin_api_in_a_process_of_its_own(pg_url, tmp_path):
    """``loraplex admin-api``'s app: the same /admin routes with their headers, readiness on the
    database; a gateway told not to mount the admin API answers 404 there."""
    from gateway.admin_server import admin_server_app

    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url, gateway_mount_admin=False)
    app = admin_server_app(settings)
    headers = {"authorization": f"Bearer {mint_admin(settings)}"}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://admin", headers=headers) as c:
        r = await c.post("/admin/tenants", json={"slug": "acme"})
        assert r.status_code == 201 and r.headers["etag"] == '"1"'
        version = int(r.headers["x-registry-version"])
        r = await c.get("/readyz")
        assert r.status_code == 200 and r.json()["registry_version"] == version
        r = await c.post("/admin/tenants/acme/disable", headers={"if-match": '"7"'})
        assert r.status_code == 412 and r.headers["etag"] == '"1"'
    gw = create_app(settings, limiter=LocalLimiter(), residency=MemoryResidency(),
                    http_client=worker_client(mock_worker_transport([])), mount_admin=settings.gateway_mount_admin)
    async with gw.router.lifespan_context(gw), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gw), base_url="http://gw", headers=headers) as c:
        assert (await c.get("/admin/tenants")).status_code == 404
        assert (await c.get("/readyz")).status_code == 200

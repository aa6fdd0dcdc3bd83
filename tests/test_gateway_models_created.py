"""``/v1/models``' ``created``: when the alias's active version (or the base model) was registered, read
from the registry (PostgreSQL and SQLite) by the whole snapshot load and by a tenant's re-read."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.tokens import mint
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter
from tests.stub_worker import mock_worker_transport
from tests.worker_double import worker_client


def _unix(at: datetime | None) -> int:
    assert at is not None
    return int(at.timestamp())


async def test_created_is_the_registration_time(db_url, tmp_path):
    await fresh_registry(db_url)
    settings = make_settings(tmp_path, db_url, worker_urls=("http://worker",), registry_refresh_s=300.0)
    svc = RegistryService(settings)
    started = int(time.time())
    try:
        base = await svc.register_base_model(TINY)
        await svc.create_tenant("acme")
        root = Path(settings.resolved_adapter_root())
        versions = []
        for seed in (1, 2):
            write_adapter(root / f"v{seed}", TINY, seed=seed)
            a = await svc.register_adapter("support", f"v{seed}", "tiny", owner="acme")
            versions.append(await svc.activate_adapter(a.id))
        await svc.bind("acme", "support", versions[0].id)
        app = create_app(settings, limiter=LocalLimiter(), residency=MemoryResidency(),
                         http_client=worker_client(mock_worker_transport([])), mount_admin=False)
        user = {"authorization": f"Bearer {mint(settings, 'u', tenant='acme')}"}
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            models = {m["id"]: m["created"] for m in (await c.get("/v1/models", headers=user)).json()["data"]}
            assert models == {"support": _unix(versions[0].created_at), "tiny": _unix(base.created_at)}
            assert started - 1 <= models["support"] <= time.time()
            # A change: the tenant is read again on its own, the new alias's version with its time.
            await svc.bind("acme", "sales", versions[1].id)
            await app.gateway.snapshots.wait_for(await svc.version(), timeout=10)
            r = await c.get("/v1/models/sales", headers=user)
            assert r.json()["created"] == _unix(versions[1].created_at) > 0, r.text
    finally:
        await svc.close()

"""The gateway on the real registry (PostgreSQL, change notifications) with its admin API mounted
under /admin: rollback, canary and limit changes reach the request path within 2 s."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.tokens import mint, mint_admin
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter
from tests.stub_worker import mock_worker_transport
from tests.worker_double import worker_client


@pytest.fixture
async def seeded(pg_url, tmp_path):
    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url, worker_urls=("http://worker",), registry_refresh_s=60.0)
    svc = RegistryService(settings)
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme", requests_per_min=1000, tokens_per_min=1_000_000, max_concurrent=50)
    await svc.create_tenant("globex")
    ids = []
    for seed in (1, 2, 3):
        d = write_adapter(Path(settings.resolved_adapter_root()) / f"support-{seed}", TINY, seed=seed)
        a = await svc.register_adapter("support", str(d), TINY.name, owner="acme")
        ids.append((await svc.activate_adapter(a.id, verification={"probe": "ok"})).id)
    await svc.bind("acme", "support", ids[0])
    await svc.bind("acme", "support", ids[1])
    yield settings, ids
    await svc.close()


async def _until(pred, seconds: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if await pred():
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError("change did not reach the gateway in time")


async def test_admin_changes_reach_the_request_path_within_2s(seeded):
    settings, ids = seeded
    sent: list[dict] = []
    app = create_app(settings, limiter=LocalLimiter(), residency=MemoryResidency(),
                     http_client=worker_client(mock_worker_transport(sent)))
    user = {"authorization": f"Bearer {mint(settings, 'u', tenant='acme')}"}
    admin = {"authorization": f"Bearer {mint_admin(settings)}"}
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:

        async def label(**extra) -> str:
            r = await c.post("/v1/chat/completions", json=body | extra, headers=user)
            assert r.status_code == 200, r.text
            return r.headers["x-loraplex-adapter"]

        assert await label() == "support@2"
        assert sent[-1]["loraplex"]["adapter"]["id"] == ids[1]
        # Rollback through the mounted admin API.
        r = await c.post("/admin/tenants/acme/bindings/support/rollback", headers=admin)
        assert r.status_code == 200, r.text

        async def rolled_back() -> bool:
            return await label() == "support@1"

        took = await _until(rolled_back, 2.0)
        assert took < 2.0
        # A canary at 30 %: observed share on 600 users, sticky per user.
        r = await c.post("/admin/tenants/acme/bindings/support/canary", headers=admin,
                         json={"adapter": ids[2], "percent": 30})
        assert r.status_code in (200, 201), r.text

        async def canary_seen() -> bool:
            return any([await label(user=f"probe-{i}") == "support@3" for i in range(20)])

        await _until(canary_seen, 2.0)
        labels = [await label(user=f"user-{i}") for i in range(600)]
        share = 100 * labels.count("support@3") / len(labels)
        assert abs(share - 30) <= 6, share
        assert [await label(user=f"user-{i}") for i in range(30)] == labels[:30]
        # New limits apply within about a second.
        r = await c.patch("/admin/tenants/acme/limits", headers=admin, json={"requests_per_min": 1})

        async def limited() -> bool:
            return (await c.post("/v1/chat/completions", json=body, headers=user)).status_code == 429

        await _until(limited, 2.0)
        # A disabled tenant is refused.
        await c.post("/admin/tenants/acme/disable", headers=admin)

        async def refused() -> bool:
            return (await c.post("/v1/chat/completions", json=body, headers=user)).status_code == 403

        await _until(refused, 2.0)
        # Admin routes need the admin scope; tenant tokens get 403.
        assert (await c.get("/admin/tenants", headers=user)).status_code == 403
        # Another tenant never sees acme's alias.
        other = {"authorization": f"Bearer {mint(settings, 'u', tenant='globex')}"}
        assert (await c.post("/v1/chat/completions", json=body, headers=other)).status_code == 404

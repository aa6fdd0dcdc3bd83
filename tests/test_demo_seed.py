"""The demo's seeding against the real admin API and SQLite registry: a second seeding (a restart)
changes nothing an operator did: a rollback to a version older than the newest, a bind, a canary
abort, an alias removed. (``tests/test_e2e_readme_ops.py`` restarts a real demo; this is the quick
check of every case, without a worker: the demo's adapters are activated without the gate.)"""

from __future__ import annotations

import asyncio
import shutil

import httpx

from gateway.app import create_app
from loraplex.settings import Settings
from loraplex_cli.serve import DEMO_BINDINGS, DEMO_DIR, DEMO_TENANTS, prepare, register_base_model, seed_demo
from registry.records import VersionRef
from registry.service import RegistryService
from tests.engine_fixtures import demo_model_file

CHECKED = {"note": "activated by the test, without the gate"}


async def _bindings(svc: RegistryService) -> dict[tuple[str, str], tuple[str | None, str | None, str | None]]:
    def label(ref: VersionRef | None) -> str | None:
        return ref.label if ref else None

    return {(b.tenant, b.alias): (label(b.active), label(b.previous), label(b.canary))
            for b in await svc.list_bindings()}


async def test_a_second_seeding_keeps_what_operators_did(tmp_path):
    settings = await asyncio.to_thread(prepare, Settings(home=str(tmp_path), model=str(demo_model_file()),
                                                         worker_urls=("http://worker",)))
    svc = RegistryService(settings)
    app = create_app(settings)
    try:
        # What the demo's first start registers, activated without a worker.
        base = await register_base_model(settings)
        for slug, limits in DEMO_TENANTS.items():
            await svc.create_tenant(slug, **limits)
        ids: dict[str, str] = {}
        for b, version in [(b, 1) for b in DEMO_BINDINGS] + [(DEMO_BINDINGS[0], 2), (DEMO_BINDINGS[2], 2)]:
            name = f"{b.tenant}-{b.adapter}"
            src = tmp_path / "adapters" / "test" / f"{name}-{version}"
            shutil.copytree(DEMO_DIR / b.adapter, src)
            a = await svc.register_adapter(name, str(src), base, owner=b.tenant)
            ids[f"{name}@{version}"] = (await svc.activate_adapter(a.id, verification=CHECKED)).id
        for b in DEMO_BINDINGS:  # the first start binds each demo alias (the newest active version)
            await svc.bind(b.tenant, b.alias, ids[f"{b.tenant}-{b.adapter}@1"], actor="demo")

        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            seeded = await seed_demo(settings, transport=transport)
            assert sorted(seeded.bindings) == [("acme", "assistant", "acme-french@1"),
                                               ("acme", "support", "acme-terse@1"),
                                               ("globex", "assistant", "globex-json@1")]
            # An operator: a bind and its rollback to a version older than the newest, a canary and its
            # abort, a bind to another adapter, an alias removed.
            await svc.bind("acme", "assistant", ids["acme-french@2"])
            await svc.rollback("acme", "assistant")
            await svc.canary_start("globex", "assistant", ids["globex-json@2"], 50)
            await svc.canary_abort("globex", "assistant")
            await svc.unbind("acme", "support")
            await svc.bind("acme", "brief", ids["acme-terse@1"])
            left = await _bindings(svc)
            assert left == {("acme", "assistant"): ("acme-french@1", "acme-french@2", None),
                            ("acme", "brief"): ("acme-terse@1", None, None),
                            ("globex", "assistant"): ("globex-json@1", None, None)}
            version = await svc.version()

            seeded = await seed_demo(settings, transport=transport)  # a restart
            assert await _bindings(svc) == left
            assert await svc.version() == version  # nothing re-bound, re-registered, re-activated
            assert ("acme", "support", "acme-terse@1") not in seeded.bindings
    finally:
        await svc.close()

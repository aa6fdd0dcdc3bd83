"""Seed a benchmark registry with the code of whichever tree is on ``PYTHONPATH``.

``bench/gateway_overhead.py`` runs this once per gateway it measures (the current tree, or
an exported older commit), so each registry is created by the same version that serves it.
Settings come from the ``LORAPLEX_*`` environment the gateway will get. It registers one base
model, a tenant ``bench`` with limits that never refuse, one adapter bound to ``support``,
and prints ``{"adapter_id": ..., "token": ...}`` (a tenant JWT) as one JSON line.

    PYTHONPATH=<tree> LORAPLEX_HOME=... python bench/gateway_seed.py
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path


async def seed() -> dict[str, str]:
    from loraplex.settings import Settings
    from loraplex.tokens import mint
    from registry.migrate import upgrade_async
    from registry.service import RegistryService
    from tests.registry_support import TINY, write_adapter

    settings = Settings.from_env()
    await upgrade_async(settings.resolved_database_url())
    svc = RegistryService(settings)
    try:
        await svc.register_base_model(TINY)
        await svc.create_tenant("bench", requests_per_min=2**31 - 1, tokens_per_min=2**31 - 1,
                                max_concurrent=100_000)
        d = write_adapter(Path(settings.resolved_adapter_root()) / "support-1", TINY, seed=1)
        a = await svc.register_adapter("support", str(d), TINY.name, owner="bench")
        a = await svc.activate_adapter(a.id, verification={"bench": "ok"})
        await svc.bind("bench", "support", a.id)
    finally:
        await svc.close()
    return {"adapter_id": a.id, "token": mint(settings, "bench-user", tenant="bench", ttl_s=24 * 3600)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(seed())))

"""Console page times with 100k tenants in PostgreSQL.

Seeds a fresh PostgreSQL database (``--tenants`` tenants, one adapter version and one binding
each, a canary on every tenth, and an audit row per write), then asks each console view
``--repeat`` times through the admin API in-process and reports the server time of each (the
``server-timing`` header: the view's own work, database included) as p50/p99, with the fleet
view over ``--workers`` reporting workers and the live view over ``--versions`` versions.
Prints a table and writes ``bench/results/console_pages.json``.

    python bench/console_pages.py                  # 100,000 tenants
    python bench/console_pages.py --tenants 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


async def seed(url: str, tenants: int) -> None:
    from sqlalchemy import insert, text

    from registry.db import make_engine
    from registry.migrate import upgrade_async
    from registry.models import AdapterVersion, AuditEntry, BaseModelRow, Binding, Tenant
    from tests.registry_support import TINY

    await upgrade_async(url)
    engine = make_engine(url, statement_timeout_s=None)
    now = datetime.now(UTC)
    try:
        async with engine.begin() as conn:
            await conn.execute(insert(BaseModelRow.__table__), [{
                "name": TINY.name, "revision": TINY.revision, "architecture": TINY.architecture, "created_at": now,
                **{k: getattr(TINY, k) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                 "num_kv_heads", "head_dim", "vocab_size", "context_length")}}])
        step = 5000
        for lo in range(0, tenants, step):
            hi = min(tenants, lo + step)
            ids = [str(uuid.uuid4()) for _ in range(lo, hi)]
            async with engine.begin() as conn:
                await conn.execute(insert(Tenant.__table__), [
                    {"slug": f"t-{i:07d}", "status": "active", "requests_per_min": 600, "tokens_per_min": 100_000,
                     "max_concurrent": 16, "priority": "normal", "created_at": now, "updated_at": now, "row_version": 1}
                    for i in range(lo, hi)])
                await conn.execute(insert(AdapterVersion.__table__), [
                    {"id": ids[i - lo], "name": f"t-{i:07d}-support", "version": 1, "base_model": TINY.name,
                     "uri": f"s3://adapters/t-{i:07d}/support/1", "sha256": f"{i:064x}", "size_bytes": 1 << 20,
                     "rank": 16, "alpha": 32.0, "target_modules": ["q_proj", "v_proj"], "owner_tenant": f"t-{i:07d}",
                     "status": "active", "verification": {"passed": True}, "created_at": now, "row_version": 1}
                    for i in range(lo, hi)])
                await conn.execute(insert(Binding.__table__), [
                    {"tenant": f"t-{i:07d}", "alias": "support", "base_model": TINY.name, "active_id": ids[i - lo],
                     "previous_id": None, "canary_id": ids[i - lo] if i % 10 == 0 else None,
                     "canary_percent": 10.0 if i % 10 == 0 else 0.0, "enabled": True, "on_disabled": "refuse",
                     "row_version": 1, "created_at": now, "updated_at": now} for i in range(lo, hi)])
                await conn.execute(insert(AuditEntry.__table__), [
                    {"registry_version": i + 1, "at": now, "actor": f"ops-{i % 7}",
                     "action": ("tenant.create", "adapter.register", "binding.create")[j],
                     "target": (f"tenant:t-{i:07d}", f"adapter:{ids[i - lo]}", f"binding:t-{i:07d}/support")[j],
                     "before": None, "after": {"n": i}} for i in range(lo, hi) for j in range(3)])
            print(f"  seeded {hi:,} tenants", flush=True)
        async with engine.begin() as conn:
            await conn.execute(text("ANALYZE"))
    finally:
        await engine.dispose()


class Sources:
    def __init__(self, workers: int, versions: int) -> None:
        from loraplex.wire import WorkerReport

        self.reports = [WorkerReport(worker_id=f"w{k:04d}", url=f"http://w{k}", base_model="tiny", base_revision="r",
                                     device_adapters=[], host_adapters=[], queue_depth=k % 5, running=k % 32,
                                     free_kv_blocks=100, total_kv_blocks=400, max_num_seqs=32, max_loras=8)
                        for k in range(workers)]
        self.stats = {f"t-{i:07d}-support@1": {"requests": i, "requests_per_s": i / 300, "error_rate": 0.0,
                                               "cold_loads": 0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.4}
                      for i in range(versions)}

    async def workers(self) -> list[Any]:
        return self.reports

    async def live(self) -> dict[str, dict[str, Any]]:
        return self.stats


async def measure(url: str, tenants: int, repeat: int, workers: int, versions: int) -> dict[str, dict[str, float]]:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from loraplex.settings import Settings
    from loraplex.tokens import mint_admin
    from registry.admin_api import admin_app
    from registry.service import RegistryService

    settings = Settings(database_url=url, home=str(RESULTS / "console_home"), jwt_secret="b" * 48)
    service = RegistryService(settings)
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings, console=Sources(workers, versions)))])
    last, mid = f"t-{tenants - 60:07d}", f"t-{tenants // 2:07d}"
    views = {
        "tenants, first page": "tenants",
        "tenants, a page deep in the list": f"tenants?after={last}",
        "tenants, prefix search": f"tenants?q={mid[:7]}",
        "tenant: limits, bindings, canary": f"tenant?slug={mid}",
        "adapters, first page": "adapters",
        "adapters, a page deep in the list": f"adapters?after={last}-support@1",
        "adapters, prefix search": f"adapters?q={last[:7]}",
        "audit, newest": "audit",
        "audit, by actor": "audit?actor=ops-3",
        "audit, target prefix": f"audit?target=binding:{mid[:7]}*",
        "confirm step, canary percent": f"confirm?action=percent&slug={mid}&alias=support&percent=25",
        f"fleet, {workers} workers": "fleet",
        f"live, {versions:,} versions": "live",
    }
    out: dict[str, dict[str, float]] = {}
    headers = {"authorization": f"Bearer {mint_admin(settings)}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b/admin",
                                 headers=headers) as http:
        for name, path in views.items():
            server, wall = [], []
            for _ in range(repeat + 2):
                t0 = time.perf_counter()
                r = await http.get("/console/view/" + path)
                wall.append(1000 * (time.perf_counter() - t0))
                assert r.status_code == 200, (path, r.status_code, r.text[:300])
                server.append(float(r.headers["server-timing"].split("dur=")[1]))
            server, wall = server[2:], wall[2:]  # the first two warm the pool and the templates
            out[name] = {"p50_ms": round(statistics.median(server), 1),
                         "p99_ms": round(sorted(server)[min(len(server) - 1, int(0.99 * len(server)))], 1),
                         "wall_p50_ms": round(statistics.median(wall), 1)}
    await service.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--workers", type=int, default=200)
    ap.add_argument("--versions", type=int, default=5000)
    args = ap.parse_args()
    from bench.scratch_db import scratch_database

    with scratch_database("loraplex_console") as url:
        t0 = time.perf_counter()
        asyncio.run(seed(url, args.tenants))
        print(f"seeded in {time.perf_counter() - t0:.0f} s", flush=True)
        result = asyncio.run(measure(url, args.tenants, args.repeat, args.workers, args.versions))
    print(f"\nconsole views, {args.tenants:,} tenants in PostgreSQL, {args.repeat} requests each (server time)")
    print("| view | p50 ms | p99 ms | wall p50 ms |")
    print("|---|---|---|---|")
    for view, r in result.items():
        print(f"| {view} | {r['p50_ms']} | {r['p99_ms']} | {r['wall_p50_ms']} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "console_pages.json").write_text(json.dumps({"tenants": args.tenants, "views": result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

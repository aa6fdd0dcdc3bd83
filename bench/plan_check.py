"""Does ``loraplex plan`` predict what a real fleet measures? Zipf traffic on real workers.

Starts a fleet of real processes (``tests.e2e_cluster``: PostgreSQL registry in a fresh
database, Redis, ``--workers`` ``loraplex worker`` processes on the demo model with small
tiers, one gateway), registers ``--adapters`` rank-8 adapters bound to aliases of a few
tenants, sends ``--requests`` chat requests whose alias follows Zipf(``--zipf``) from
``--clients`` concurrent clients, then compares:

* measured: each worker's ``loraplex_worker_adapter_arrivals_total{tier}`` (where each
  request's adapter was when it arrived: device, host, loading, absent);
* predicted: ``loraplex plan`` on the gateway's own access log, at the fleet's sizes.

Device-slot hit ratio: arrivals that found the adapter in a slot. Host-cache hit ratio:
arrivals that started no load (in a slot, in host memory, or already loading). Prints a
table and writes ``bench/results/plan_check.json``.

    python bench/plan_check.py                   # 2 workers, 64 adapters, 1200 requests
    python bench/plan_check.py --requests 400 --adapters 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TIERS = ("device", "host", "loading", "absent")


@dataclass
class Config:
    workers: int = 2
    adapters: int = 64
    tenants: int = 4
    requests: int = 1200
    clients: int = 4
    zipf: float = 1.0
    max_loras: int = 4
    max_cpu_loras: int = 16
    seed: int = 0


async def _seed(settings: Any, model: str, cfg: Config, home: Path) -> list[tuple[str, str]]:
    """Base model, tenants and adapters straight into the registry (active, no gate: the gate would
    load adapters on the workers before the measured traffic); ``(tenant, alias)`` per adapter."""
    from loraplex.modelinfo import describe_model
    from registry.migrate import upgrade_async
    from registry.service import RegistryService
    from tests.registry_support import write_adapter

    await upgrade_async(settings.resolved_database_url())
    svc = RegistryService(settings)
    out = []
    try:
        info = describe_model(model)
        base = await svc.register_base_model(info)
        for t in range(cfg.tenants):
            await svc.create_tenant(f"t{t}", requests_per_min=10**7, tokens_per_min=10**9, max_concurrent=1000)
        for i in range(cfg.adapters):
            tenant, alias = f"t{i % cfg.tenants}", f"a{i}"
            d = write_adapter(home / "adapters" / f"a{i}", info, rank=8, seed=i)
            a = await svc.register_adapter(f"{tenant}-{alias}", str(d), base.name, owner=tenant)
            await svc.activate_adapter(a.id, verification={"bench": "plan_check"})
            await svc.bind(tenant, alias, a.id)
            out.append((tenant, alias))
    finally:
        await svc.close()
    return out


async def _traffic(url: str, tokens: dict[str, str], picks: list[tuple[str, str]], clients: int) -> int:
    queue = list(reversed(picks))
    failed = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failed
        while queue:
            tenant, alias = queue.pop()
            r = await http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {tokens[tenant]}"},
                                json={"model": alias, "max_tokens": 2, "temperature": 0,
                                      "messages": [{"role": "user", "content": "Say hi."}]})
            failed += r.status_code != 200

    async with httpx.AsyncClient(timeout=300.0) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return failed


def _arrivals(metrics: str) -> dict[str, float]:
    out = dict.fromkeys(TIERS, 0.0)
    for m in re.finditer(r'^loraplex_worker_adapter_arrivals_total\{([^}]*)\} ([0-9.e+]+)$', metrics, re.M):
        tier = re.search(r'tier="([^"]+)"', m.group(1))
        if tier:
            out[tier.group(1)] += float(m.group(2))
    return out


def _zipf_picks(rng: random.Random, bound: list[tuple[str, str]], s: float, n: int) -> list[tuple[str, str]]:
    weights = [1.0 / (k + 1) ** s for k in range(len(bound))]
    order = bound[:]
    rng.shuffle(order)  # popularity independent of registration order
    return rng.choices(order, weights=weights, k=n)


def run(cfg: Config, home: Path, model: str, *, database_url: str, redis_url: str) -> dict[str, Any]:
    """Run the fleet, the traffic and ``loraplex plan``; measured and predicted hit ratios."""
    from tests.e2e_cluster import BIN, Cluster

    c = Cluster(home=home, database_url=database_url, redis_url=redis_url,
                redis_prefix=f"loraplex-plan-{uuid.uuid4().hex[:8]}", model=model,
                worker_env={"LORAPLEX_MAX_LORAS": str(cfg.max_loras), "LORAPLEX_MAX_CPU_LORAS": str(cfg.max_cpu_loras),
                            "LORAPLEX_WEIGHTS": "float32"})
    bound = asyncio.run(_seed(c.settings, model, cfg, home))
    picks = _zipf_picks(random.Random(cfg.seed), bound, cfg.zipf, cfg.requests)
    workers = tuple(f"w{k}" for k in range(1, cfg.workers + 1))
    with c.running(workers=workers, gateways=("g1",)):
        tokens = {f"t{t}": c.token(f"t{t}") for t in range(cfg.tenants)}
        t0 = time.perf_counter()
        failed = asyncio.run(_traffic(c.gateways[0].url, tokens, picks, cfg.clients))
        seconds = time.perf_counter() - t0
        per_worker = {p.name: _arrivals(httpx.get(p.url + "/metrics", timeout=10).text) for p in c.workers}
    log = c.gateways[0].log  # the gateway flushes its access log on the way out
    plan = subprocess.run([str(BIN), "plan", str(log), "--workers", str(cfg.workers), "--max-loras",
                           str(cfg.max_loras), "--max-cpu-loras", str(cfg.max_cpu_loras), "--json", "--jobs", "1"],
                          capture_output=True, text=True, env=c.env(), timeout=600)
    if plan.returncode:
        raise RuntimeError(f"loraplex plan failed:\n{plan.stderr}")
    predicted = json.loads(plan.stdout)
    total = {t: sum(w[t] for w in per_worker.values()) for t in TIERS}
    n = sum(total.values())
    measured = {"device": total["device"] / n if n else 0.0,
                "host": (total["device"] + total["host"] + total["loading"]) / n if n else 0.0}
    return {"config": cfg.__dict__, "requests_failed": failed, "seconds": round(seconds, 1),
            "arrivals": total, "arrivals_per_worker": per_worker, "measured": measured,
            "predicted": {"device": predicted["device_slots"][0]["hit_ratio"],
                          "host": predicted["host_cache"][0]["hit_ratio"]},
            "trace_requests": predicted["trace"]["adapter_requests"], "zipf_fitted": predicted["zipf_exponent"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in Config.__dataclass_fields__.values():
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = ap.parse_args()
    cfg = Config(**{k: getattr(args, k) for k in Config.__dataclass_fields__})
    from bench.scratch_db import scratch_database
    from engine.fetch_demo import demo_model_path

    home = RESULTS / "plan_check"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    with scratch_database("loraplex_plan") as url:
        out = run(cfg, home, str(demo_model_path()), database_url=url, redis_url=REDIS_URL)
    m, p = out["measured"], out["predicted"]
    print(f"{cfg.requests} requests, {cfg.clients} clients, Zipf {cfg.zipf} over {cfg.adapters} adapters "
          f"(fitted {out['zipf_fitted']}), {cfg.workers} workers, max_loras {cfg.max_loras}, "
          f"max_cpu_loras {cfg.max_cpu_loras}; {out['seconds']} s, {out['requests_failed']} failed")
    print("| tier | measured | predicted | difference (points) |")
    print("|---|---|---|---|")
    for tier in ("device", "host"):
        print(f"| {tier} | {m[tier]:.1%} | {p[tier]:.1%} | {100 * (p[tier] - m[tier]):+.1f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_check.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
